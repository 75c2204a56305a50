"""The one-token quantized products alone on the GPU: XLA's fused decode (`qtensor.xla_rows_matvec`, the reference)
against the Triton kernel (`quant/triton_matvec.rows_matvec`) at the decode step's shapes, each in the GGML row
layout and the planar one (quant/planar.py), with each one's GB/s, share of HBM bandwidth and distance from XLA
over GGML rows. One JSON line per (shape, path, tile). Issue #5, item 4: the
routed-expert product read MXFP4 at 7% of HBM bandwidth through XLA (experiments/README.md, step parts).

    python experiments/bench_kernels.py [--reps 50] [--tiles [--warps 4,8] [--splits 1,4] [--rows 8,16]
        [--blocks 8,16]] [--shapes a,b] [--out FILE]

Each timed call runs `--reps` products in one jitted `fori_loop`, the expert indices moving on every iteration so
the rows come from HBM, not from the 60 MB L2 (one call reads 27 MB; 50 calls walk 300 experts of the 1.1 GB
stack). Each row also has the loop's own cost a call without a product ("loop_us") and the time without it
("net_us", "net_gb_per_s"). `--tiles` also sweeps the kernel's tile (rows per program, blocks per step, the
`--warps` counts and the `--splits` of a row; `--rows` and `--blocks` narrow the first two) on every shape but
"dense". The two-bit formats also run the "int8" numerics' dp4a kernel (path "int8", quant/triton_int8.py,
x rounded in the call), whose distance from XLA is the rounding's (its tiles swept with the f32 kernel's).
CPU runs check the code path only (the kernel then runs in Pallas' interpreter on a shrunk shape).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import BW, _commit, _machine, emit, kernel_ab  # noqa: E402  (sibling script, run as a file)

from jds41.quant import row_bytes  # noqa: E402
from jds41.quant.int8_act import round_int8  # noqa: E402
from jds41.quant.planar import PLANAR_TYPES, to_planar  # noqa: E402
from jds41.quant.qtensor import xla_rows_matvec  # noqa: E402
from jds41.quant.random_blocks import random_quantized  # noqa: E402
from jds41.quant.triton_int8 import rows_matvec_int8  # noqa: E402
from jds41.quant.triton_int8 import supported as int8_supported  # noqa: E402
from jds41.quant.triton_matvec import BLOCKS, Q2K_KERNEL, default_tile, rows_matvec, supported  # noqa: E402

# (name, type, experts in the stack, out, in, selected K, x rows): V4-Flash's routed gate/up and down (MXFP4), one
# dense MXFP4 matrix of the model width, and its dense Q8_0 matrices: attention's q_b [32768, 1024] and o_b
# [4096, 8192], and the output head [129280, 4096] (562 MB); V4.1's two-bit routed experts as the file stores them
# (IQ2_XXS gate/up [2304, 5120], Q2_K down [5120, 2304], 384 per layer). A dense matrix smaller than the L2 cache
# comes as a stack of copies that the calls walk (K = 1), as the layers of a step do, so its bytes are read from HBM.
SHAPES = (
    ("experts-gate-up", T.MXFP4, 256, 2048, 4096, 6, 1),
    ("experts-down", T.MXFP4, 256, 4096, 2048, 6, 6),
    ("dense", T.MXFP4, 32, 4096, 4096, 1, 1),
    ("shared-expert", T.Q8_0, 16, 2048, 4096, 1, 1),
    ("attn-q-b", T.Q8_0, 8, 32768, 1024, 1, 1),
    ("attn-o-b", T.Q8_0, 8, 4096, 8192, 1, 1),
    ("head", T.Q8_0, 1, 129280, 4096, 1, 1),
    # V4-Flash's small products of the attention input: W_qa [1024, 4096] (and a ratio-4 compressor's W_kv, W_gate),
    # W_kv [512, 4096] (and a ratio-128 compressor's), ~140 MB stacks
    ("attn-q-a", T.Q8_0, 32, 1024, 4096, 1, 1),
    ("attn-kv", T.Q8_0, 64, 512, 4096, 1, 1),
    ("v41-experts-gate-up", T.IQ2_XXS, 384, 2304, 5120, 6, 1),
    ("v41-experts-down", T.Q2_K, 384, 5120, 2304, 6, 6),
    # V4.1's dense Q8_0 products (a layer's attention q_a, kv, q_b, o_a in 8 groups of 1024 rows, each with its own
    # input, o_b; the shared expert's gate/up and down; the head), each stack ~110-180 MB so the calls read HBM
    ("v41-attn-q-a", T.Q8_0, 16, 1280, 5120, 1, 1),
    ("v41-attn-kv", T.Q8_0, 48, 512, 5120, 1, 1),
    ("v41-attn-q-b", T.Q8_0, 4, 32768, 1280, 1, 1),
    ("v41-attn-o-a", T.Q8_0, 32, 1024, 4096, 8, 8),
    ("v41-attn-o-b", T.Q8_0, 4, 5120, 8192, 1, 1),
    ("v41-shexp-gate-up", T.Q8_0, 12, 2304, 5120, 1, 1),
    ("v41-shexp-down", T.Q8_0, 12, 5120, 2304, 1, 1),
    ("v41-head", T.Q8_0, 1, 129280, 5120, 1, 1),
)
# --tiles: filtered by shape (steps of at least 256 values, at most 16 KB loaded per step)
TILES = [(bo, nb) for bo in (1, 2, 4, 8, 16, 32) for nb in (1, 2, 4, 8, 16, 32, 64, 128)]


def _stack(rng, qtype, E: int, n_out: int, n_in: int) -> jax.Array:
    """E random experts: one quantized block of at most 2048 rows written once and tiled over the rows and the
    experts (the bytes, not their values, set the speed), so a 256-expert stack costs one small quantization."""
    n = next(d for d in range(min(n_out, 2048), 0, -1) if n_out % d == 0)
    one = random_quantized(rng, qtype, (1, n, n_in))
    return jax.device_put(np.tile(one, (E, n_out // n, 1)))


def _loop(product, reps: int, E: int, K: int):
    def run(x, raw, idx0):
        def body(i, acc):
            idx = (idx0 + i * K) % E
            return acc + jnp.sum(product(x, raw, idx))
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
    return jax.jit(run)


def _seconds(fn, *args, repeats: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiles", action="store_true", help="also sweep the kernel tile (every shape but dense)")
    ap.add_argument("--warps", default="4", help="comma-separated warp counts the --tiles sweep tries")
    ap.add_argument("--splits", default="1", help="comma-separated row splits the --tiles sweep tries")
    ap.add_argument("--rows", default=None, help="comma-separated rows per program the --tiles sweep keeps (all)")
    ap.add_argument("--blocks", default=None, help="comma-separated blocks per step the --tiles sweep keeps (all)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    names = [s[0] for s in SHAPES]
    wanted = set(a.shapes.split(",")) if a.shapes else set(names)
    if wanted - set(names):
        ap.error(f"unknown shapes {sorted(wanted - set(names))}; known: {names}")
    rows_kept = {int(v) for v in a.rows.split(",")} if a.rows else {t[0] for t in TILES}
    blocks_kept = {int(v) for v in a.blocks.split(",")} if a.blocks else {t[1] for t in TILES}
    gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    common = {"bench": "kernels", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv),
              "reps": a.reps, **kernel_ab()}
    for name, qtype, E, n_out, n_in, K, X in (s for s in SHAPES if s[0] in wanted):
        if not gpu:  # the interpreter is slow: a small stack of the same kind checks the path
            E, n_out, n_in = min(E, 4), 64, 512
        if not gpu and qtype == T.Q8_0:
            n_out = 32
        ggml = _stack(rng, qtype, E, n_out, n_in)
        rows = {"ggml": ggml}
        if qtype in PLANAR_TYPES:
            rows["planar"] = jax.jit(to_planar, static_argnums=1)(ggml, qtype)
        x = jnp.asarray(rng.standard_normal((X, n_in)), jnp.float32)
        idx0 = jnp.arange(K, dtype=jnp.int32)
        nbytes = K * n_out * row_bytes(qtype, n_in)
        shape = {"shape": name, "qtype": qtype.name, "experts": E, "out": n_out, "in": n_in, "k": K, "bytes": nbytes}
        if qtype == T.Q2_K:
            shape["q2k_kernel"] = Q2K_KERNEL
        want = np.asarray(jax.jit(lambda x, r, i, q=qtype: xla_rows_matvec(x, r, i, q))(x, ggml, idx0))
        # The timing loop's own cost a call (its trip, the index update, the sum of a [K, O] output), with no
        # product: on the H200 ~8 us, which a small product's "us" carries (V4.1's kv: 13.3 here, 5.2 in the decode
        # profile). "net_us" leaves it out.
        empty = lambda x, r, i, K=K, n_out=n_out: (  # noqa: E731
            jnp.broadcast_to(x[:1, :1], (K, n_out)) + i[:, None].astype(jnp.float32))
        loop_s = _seconds(_loop(empty, a.reps, E, K), x, ggml, idx0) / a.reps
        paths = [("xla", lay, None) for lay in rows]
        paths += [("triton", lay, None) for lay in ("ggml", "planar") if supported(qtype, 0, lay)]
        paths += [("int8", "planar", None)] if int8_supported(qtype, 0, "planar") else []
        if a.tiles and name != "dense":  # the layout the engine gives the kernel: planar where the kernel reads
            lay = "planar" if supported(qtype, 0, "planar") else "ggml"  # it, else the file's
            values, _, loaded = BLOCKS[qtype]
            paths += [("triton", lay, (*t, int(w), int(sp))) for t in TILES if t[0] in rows_kept
                      and t[1] in blocks_kept for w in a.warps.split(",")
                      for sp in a.splits.split(",") if n_out % t[0] == 0 and (n_in // values) % (t[1] * int(sp)) == 0
                      and t[1] * values >= 256 and t[0] * t[1] * loaded <= 16384
                      and (*t, int(w), int(sp)) != default_tile(qtype, K, n_out, n_in)]
            paths += [("int8", "planar", t) for p, lay_, t in paths if p == "triton" and t is not None
                      and int8_supported(qtype, 0, "planar")]
        for path, layout, tile in paths:
            if path == "xla":
                product = lambda x, r, i, q=qtype, lay=layout: xla_rows_matvec(x, r, i, q, lay)
            elif path == "int8":  # x rounded in the call (quant/int8_act.py): the gap to xla is the rounding's
                product = lambda x, r, i, q=qtype, lay=layout, t=tile: rows_matvec_int8(
                    *round_int8(x), r, i, q, lay, interpret=not gpu, tile=t)
            else:
                product = lambda x, r, i, q=qtype, lay=layout, t=tile: rows_matvec(x, r, i, q, layout=lay,
                                                                                 interpret=not gpu, tile=t)
            raw = rows[layout]
            try:
                got = np.asarray(jax.jit(product)(x, raw, idx0))
                s = _seconds(_loop(product, a.reps, E, K), x, raw, idx0) / a.reps
            except Exception as e:  # a tile Triton cannot compile: report it and go on
                emit({**common, **shape, "path": path, "layout": layout, "tile": tile,
                      "error": f"{type(e).__name__}: {e}"[:400]}, a.out)
                continue
            tile = tile or (default_tile(qtype, K, n_out, n_in) if path != "xla" else None)
            net = max(s - loop_s, 1e-9)
            emit({**common, **shape, "path": path, "layout": layout, "tile": tile, "us": round(s * 1e6, 2),
                  "gb_per_s": round(nbytes / s / 1e9, 1), "hbm_share": round(nbytes / s / BW["hbm"], 4),
                  "loop_us": round(loop_s * 1e6, 2), "net_us": round(net * 1e6, 2),
                  "net_gb_per_s": round(nbytes / net / 1e9, 1),
                  "max_rel_diff_vs_xla": float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
