"""One token's attention alone on the GPU: XLA's spelling (`attention.attend_xla`, the reference) against the
Triton kernel (`layers/attention_kernel.attend_kernels`, q turned and the output turned back inside) over a sweep
of its tiles, at V4's and V4.1's shape (64 heads, 512-wide latents) and key counts of a short and a long window.

    python experiments/bench_attention.py [--reps 50] [--keys 136,640,1152] [--tiles BH:BN:BK:BV:W,...]
        [--dots ieee,tf32x3] [--out FILE]

Why: this isolates the kernel so its tile, warps and products can be varied without a decode run (in the decode
profile of 2026-12-05, results/profile_decode_round30_v41_4L_h200.jsonl, the first, two-launch form took ~120 us a
call where XLA's seven kernels take ~18 us a layer). Each timed call runs `--reps` attentions in one jitted
`fori_loop`, q moving with the iteration (nothing is hoisted); "loop_us" is the loop's own cost a call. One JSON
line per (keys, path, tile, dot: the products' form, attention_kernel.DOTS), with the largest difference from
XLA's output. CPU runs check the code path only (the kernels then run in Pallas' interpreter on a shrunk shape,
where every form computes "ieee").
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit, _machine, emit  # noqa: E402  (sibling scripts, run as files)
from bench_kernels import _seconds  # noqa: E402

from jds41.layers import attention, attention_kernel  # noqa: E402
from jds41.layers.rope import rope_freqs  # noqa: E402

DEFAULT_TILES = ("16:32:128:128:4,16:32:128:64:4,16:32:128:256:8,16:32:128:512:8,16:64:128:128:4,16:16:128:128:4,"
                 "16:32:64:128:4")


def _loop(attend, reps: int):
    def run(q, keys, valid, pos):
        def body(i, acc):
            return acc + jnp.sum(attend(q * (1 + i.astype(jnp.float32) * 1e-6), keys, valid, pos + i))
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--keys", default="136,640,1152", help="comma-separated key counts (window plus selected rows)")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="comma-separated BH:BN:BK:BV:warps tiles of the kernel")
    ap.add_argument("--dots", default="tf32x3", help="comma-separated forms of the kernel's products "
                    "(attention_kernel.DOTS); every tile runs in each")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    heads, kdim, rope = (64, 512, 64) if gpu else (16, 64, 16)  # the interpreter is slow: a small shape off the GPU
    cfg = types.SimpleNamespace(head_dim=kdim, q_head_norm=False, rms_eps=1e-6)
    freqs = jnp.asarray(rope_freqs(rope, 10000.0))
    tiles = [tuple(int(v) for v in t.split(":")) for t in a.tiles.split(",")]
    dots = [attention_kernel.parse_dot(d) for d in a.dots.split(",")]
    common = {"bench": "attention", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv),
              "reps": a.reps, "heads": heads, "kdim": kdim, "rope_dims": rope}
    rng = np.random.default_rng(0)
    sink = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    for n in (int(v) for v in a.keys.split(",")):
        n = n if gpu else min(n, 70)
        q = jnp.asarray(rng.standard_normal((heads, kdim)), jnp.float32)
        keys = jnp.asarray(rng.standard_normal((n, kdim)), jnp.float32)
        valid = jnp.asarray(rng.random(n) >= 0.1)
        pos = jnp.int32(5000)
        xla = lambda q, k, v, p: attention.attend_xla(cfg, sink, q, k, v, p, freqs)  # noqa: E731
        want = np.asarray(jax.jit(xla)(q, keys, valid, pos))
        loop_s = _seconds(_loop(lambda q, k, v, p: q[:1, :1], a.reps), q, keys, valid, pos) / a.reps
        for path, tile, dot in [("xla", None, None)] + [("kernel", t, d) for t in tiles for d in dots]:
            fn = xla if tile is None else (lambda q, k, v, p, t=tile, d=dot: (  # noqa: E731
                attention_kernel.attend_kernels(q, k, v, sink, p, freqs, kdim ** -0.5, None, interpret=not gpu,
                                                turn_inside=True, tile=t, dot=d)))
            row = {**common, "keys": n, "path": path, "tile": tile, "dot": dot}
            try:
                got = np.asarray(jax.jit(fn)(q, keys, valid, pos))
                s = _seconds(_loop(fn, a.reps), q, keys, valid, pos) / a.reps
            except Exception as e:  # a tile Triton cannot compile: report it and go on
                emit({**row, "error": f"{type(e).__name__}: {e}"[:400]}, a.out)
                continue
            emit({**row, "us": round(s * 1e6, 2), "loop_us": round(loop_s * 1e6, 2),
                  "net_us": round(max(s - loop_s, 0) * 1e6, 2),
                  "max_rel_diff_vs_xla": float(np.abs(got - want).max() / np.abs(want).max())}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
