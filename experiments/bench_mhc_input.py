"""V4.1's sublayer input alone on the GPU: XLA's spelling (mix, split, Sinkhorn, collapse, norm: the reference)
against layers/mhc_input_kernel.py's two launches over a sweep of their layout (the columns a `_partials` program
takes, its warps), at V4.1's shape (4 copies of D = 5120, a 24-row mix).

    python experiments/bench_mhc_input.py [--chain 32] [--layouts 128:4,64:1,...] [--out FILE]

Why: in the decode profiles of the thirty-sixth session (results/profile_decode_mhc36_v41_4L_h100.jsonl,
profile_decode_mhc_two36_v41_4L_h100.jsonl) the launches take ~4.0 and ~4.6 us a sublayer, two sublayers a layer;
this times their layouts without a decode run.
A timed call runs `--chain` sublayer inputs in one jitted straight-line chain (no loop: a loop's own round trip
would swamp ~10 us), each taking the previous one's pre as its handed-over pre, so none can be hoisted or run
ahead, and every h is summed into the result (one small XLA add a call, the same for every layout: otherwise XLA
drops a launch whose only output is an unused h); the row gives the time a sublayer input, launches and the gaps
between them included, as in decode. One
JSON line per layout, with the largest difference from XLA's output. CPU runs check the code path only (the kernels
then run in Pallas' interpreter on a shrunk shape).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit, _machine, emit  # noqa: E402  (sibling scripts, run as files)
from bench_kernels import _seconds  # noqa: E402

from jds41.layers import mhc_input_kernel  # noqa: E402
from jds41.layers.mhc import hc_collapse, hc_mix, hc_split  # noqa: E402
from jds41.layers.norm import rms_norm  # noqa: E402

DEFAULT_LAYOUTS = "128:4,128:1,64:4,64:1,32:1"
EPS, ITERS = 1e-6, 20


def _xla(x_HD, pre_prev, fn, scale, base, norm):
    pre, post, comb = hc_split(hc_mix(x_HD, fn, EPS), scale, base, EPS, ITERS)
    return rms_norm(hc_collapse(x_HD, pre_prev), norm, EPS), pre, post, comb


def _chain(one, length: int):
    """`length` sublayer inputs, each fed the previous one's pre; returns the last (h, pre, post, comb)."""
    def run(x, pre, fn, scale, base, norm):
        out, hs = None, 0
        for _ in range(length):
            out = one(x, pre, fn, scale, base, norm)
            pre, hs = out[1], hs + out[0]
        return hs, out
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated columns:partial-warps layouts")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    d, chain = (5120, a.chain) if gpu else (256, min(a.chain, 2))  # the interpreter is slow: a small shape off the GPU
    layouts = [tuple(int(v) for v in t.split(":")) for t in a.layouts.split(",")]
    common = {"bench": "mhc_input", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv),
              "chain": chain, "copies": 4, "dim": d, "iters": ITERS}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, d)), jnp.float32)
    pre = jnp.asarray(rng.uniform(0.05, 1.0, 4), jnp.float32)
    fn = jnp.asarray(rng.standard_normal((24, 4 * d)) / np.sqrt(4 * d), jnp.float16)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32)
    base = jnp.asarray(rng.standard_normal(24), jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    args = (x, pre, fn, scale, base, norm)
    xla = lambda x, p, f, s, b, n: _xla(x, p, f.astype(jnp.float32), s, b, n)  # noqa: E731
    want = [np.asarray(v) for v in jax.jit(xla)(*args)]
    for cols, warps in [(None, None)] + layouts:
        row = {**common, "path": "xla" if cols is None else "kernels", "cols": cols, "partial_warps": warps}
        if cols is None:
            one = xla
        else:
            def one(x, p, f, s, b, n, cols=cols, warps=warps):
                h, pre, post, comb = mhc_input_kernel.sublayer_input_rows(
                    x[None], p[None], f, s, b, n, rms_eps=EPS, hc_eps=EPS, iters=ITERS, interpret=not gpu,
                    most_cols=cols, partial_warps=warps)
                return h[0], pre[0], post[0], comb[0]
        try:
            got = [np.asarray(v) for v in jax.jit(one)(*args)]
            s = _seconds(_chain(one, chain), *args) / chain
        except Exception as e:  # a layout Triton cannot compile: report it and go on
            emit({**row, "error": f"{type(e).__name__}: {e}"[:400]}, a.out)
            continue
        diff = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))
        emit({**row, "us": round(s * 1e6, 2), "max_rel_diff_vs_xla": diff}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
