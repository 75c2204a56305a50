"""One-token products over quantized rows as Pallas (Triton) kernels for the GPU: the decode fast path.

Why (DESIGN.md §7, experiments/README.md "Where the step's time goes"): XLA:GPU fuses a block decode into the
multiply-and-sum of `qtensor._row_dot`, but it reads the sub-byte formats at a small share of HBM bandwidth (the
routed-expert product of the V4.1 shape: MXFP4 7%, Q8_0 30% on the H200), and decode is bound by those bytes. A
kernel that owns its loads reads the same raw GGUF rows at the bandwidth they allow.

Owns `rows_matvec(x_XI, raw_EOR, idx_K, qtype) -> f32 [K, O]`: y[k, o] = sum_i W[idx[k], o, i] x[k or 0, i] over
raw rows `raw[E, O, row_bytes]` exactly as they sit in the file (a whole stack, or the K rows a tier gathered), and
`supported(qtype)`, which says when it applies. `qtensor.qmatvec_experts` and `qtensor.qmatvec` call it on
CUDA only (`lax.platform_dependent`); every other platform, and `rows_as_dots` / `act_round` products, keep the XLA
spelling, which stays the reference (tests/test_triton_matvec.py runs the kernel in Pallas' interpreter on the CPU
against a float64 re-derivation from gguf-py's dequantizer, and on the GPU against the XLA path).

The layout: a GGML row is a run of blocks of `block_bytes` (17 for MXFP4, 34 for Q8_0) that are not a power of two,
which Triton's tiles must be. So a program reads NB blocks of BO rows per step as strided tiles: one [BO, NB] tile
per byte position of the block (stride `block_bytes`), and the matching [NB] values of x (stride 32). The NB * 17
(or 34) bytes of a row are contiguous, so the strided loads of one step touch the same cache lines and DRAM sees
each byte once.

Arithmetic (the same for every program, whatever E, K, the row's tier or the grid): within a block, the 32 values
are summed in byte order (low nibble then high nibble for MXFP4), the sum is scaled by the block's scale, and
blocks add left to right into one f32 accumulator per row. This is not XLA's order, so the kernel agrees with the
XLA path to f32 rounding, not bitwise; decode is exact against itself because every decode product of a format
goes through the one kernel (placements, drafting and prompt pieces included).
`JDS41_TRITON=0` in the environment turns the kernels off (read once, at import: for A/B benchmarks).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl

ENABLED = os.environ.get("JDS41_TRITON", "1") != "0"
VALUES = 32  # values per block in both formats
BLOCK_BYTES = {T.MXFP4: 17, T.Q8_0: 34}
# The tile (rows per program BO, blocks per step NB, warps): BO and NB are the largest choices that divide the
# shape (both must be powers of two for Triton), so any whole-block row length runs.
BO_MAX, NB_MAX, NUM_WARPS = 16, 16, 4


def supported(qtype) -> bool:
    """Whether `rows_matvec` takes rows of this type (else the XLA path computes the product)."""
    return ENABLED and qtype in BLOCK_BYTES


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    b = most
    while n % b:
        b //= 2
    return b


def _mxfp4_scale(e):
    """e8m0 byte -> 2^(e - 128) as f32 (ggml keeps the e2m1 values doubled and halves the scale), subnormals
    included (e < 2), assembled from bits so nothing flushes."""
    e = e.astype(jnp.int32)
    bits = jnp.where(e >= 2, (e - 1) << 23, jnp.left_shift(jnp.int32(1), 21 + e))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _e2m1(n):
    """4-bit e2m1 code (bit 3 the sign) -> its doubled value {0, 1, 2, 3, 4, 6, 8, 12} with sign, as f32."""
    m = n & 7
    mag = (m + jnp.maximum(m - 4, 0) + 2 * jnp.maximum(m - 6, 0)).astype(jnp.float32)
    return jnp.where((n & 8) != 0, -mag, mag)


def _signed_byte(q):
    v = q.astype(jnp.int32)
    return (v - ((v >> 7) << 8)).astype(jnp.float32)


def _f16_pair(lo, hi):
    """Two little-endian bytes -> their f16 value as f32."""
    u = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _block_sums(qtype, load_w, load_x):
    """([BO, NB] sum of each block's 32 products, [BO, NB] block scales) for one step.

    `load_w(c)` gives the [BO, NB] tile of byte c of each block, `load_x(v)` the [NB] x values at position v of each
    block."""
    if qtype == T.MXFP4:
        scale = _mxfp4_scale(load_w(0))
        acc = None
        for p in range(16):  # byte 1 + p holds value p (low nibble) and value 16 + p (high nibble)
            q = load_w(1 + p).astype(jnp.int32)
            term = _e2m1(q & 15) * load_x(p)[None, :] + _e2m1(q >> 4) * load_x(16 + p)[None, :]
            acc = term if acc is None else acc + term
        return acc, scale
    scale = _f16_pair(load_w(0), load_w(1))  # Q8_0: f16 d, then 32 int8
    acc = None
    for p in range(VALUES):
        term = _signed_byte(load_w(2 + p)) * load_x(p)[None, :]
        acc = term if acc is None else acc + term
    return acc, scale


def _kernel(idx_ref, x_ref, w_ref, o_ref, *, qtype, bo: int, nb: int, steps: int, x_per_row: bool):
    k, j = pl.program_id(0), pl.program_id(1)
    e = idx_ref[k]
    kx = k if x_per_row else jnp.int32(0)
    rows = pl.ds(j * bo, bo)
    bb = BLOCK_BYTES[qtype]

    def step(t, acc_O):
        b0 = t * nb
        load_w = lambda c: w_ref[e, rows, pl.ds(b0 * bb + c, nb, stride=bb)]
        load_x = lambda v: x_ref[kx, pl.ds(b0 * VALUES + v, nb, stride=VALUES)]
        sums, scale = _block_sums(qtype, load_w, load_x)
        return acc_O + jnp.sum(sums * scale, axis=1)

    o_ref[0, :] = lax.fori_loop(0, steps, step, jnp.zeros((bo,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("qtype", "interpret", "tile"))
def rows_matvec(x_XI: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype, interpret: bool = False,
                tile: tuple[int, int, int] | None = None) -> jax.Array:
    """y[k, o] = sum_i W[idx[k], o, i] x[k, i] (x [K, I]) or x[0, i] (x [1, I]) -> f32 [K, O], from raw GGML rows
    `raw_EOR` uint8 [E, O, row_bytes] of `qtype`. Indices are clamped to the stack like `jnp.take(mode="clip")`.
    `interpret` runs the kernel in Pallas' interpreter (any platform: the CPU tests); `tile` (BO, NB, warps)
    overrides the tile for benchmarks (BO must divide O and NB the row's blocks)."""
    E, n_out, R = raw_EOR.shape
    K, X, n_in = idx_K.shape[0], x_XI.shape[0], x_XI.shape[1]
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"rows_matvec does not take {qtype.name} rows")
    if n_in % VALUES or R != n_in // VALUES * BLOCK_BYTES[qtype] or X not in (1, K):
        raise ValueError(f"rows_matvec: rows of {R} bytes for {n_in} inputs, x with {X} rows for {K} indices")
    bo, nb, warps = tile or (_largest_power_of_two_dividing(n_out, BO_MAX),
                             _largest_power_of_two_dividing(n_in // VALUES, NB_MAX), NUM_WARPS)
    if n_out % bo or (n_in // VALUES) % nb:
        raise ValueError(f"tile ({bo}, {nb}) does not divide {n_out} rows of {n_in // VALUES} blocks")
    kernel = functools.partial(_kernel, qtype=qtype, bo=bo, nb=nb, steps=n_in // (nb * VALUES), x_per_row=X > 1)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=warps, num_stages=2)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((K, n_out), jnp.float32), grid=(K, n_out // bo),
        out_specs=pl.BlockSpec((1, bo), lambda k, j: (k, j)), compiler_params=params, interpret=interpret,
        name=f"rows_matvec_{qtype.name.lower()}",
    )(jnp.clip(idx_K.astype(jnp.int32), 0, E - 1), x_XI.astype(jnp.float32), raw_EOR)


def reference_rows_matvec(x_XI: np.ndarray, raw_EOR: np.ndarray, idx_K: np.ndarray, qtype) -> np.ndarray:
    """The same product in float64 numpy from gguf-py's dequantizer: what the kernel is tested against."""
    import gguf

    x = np.asarray(x_XI, np.float64)
    out = []
    for k, e in enumerate(np.clip(np.asarray(idx_K), 0, raw_EOR.shape[0] - 1)):
        w = gguf.quants.dequantize(np.asarray(raw_EOR[e]), qtype).astype(np.float64)
        out.append(w @ x[k if x.shape[0] > 1 else 0])
    return np.stack(out)
