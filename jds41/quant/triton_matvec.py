"""The one-token MXFP4 and Q8_0 products over raw rows as a Pallas (Triton) kernel for the GPU: decode's fast path.

Why (experiments/README.md, "Where the step's time goes" and "The Triton kernel"): XLA:GPU fuses the block decode
of `blocks._dec_mxfp4` into the multiply-and-sum of `qtensor._row_dot`, but read MXFP4 experts at 4-7% of HBM
bandwidth on the H200: that decode assembles each value from bit fields with selects (exact on every backend, with
subnormal scales), and its integer work, not the bytes, bounds the product. Q8_0 rows in the GGML layout XLA read
at ~900 GB/s (20% of HBM), and a kernel over them must load byte by byte (a first, strided-load design ran 4x
slower than XLA and was dropped); in the planar layout (quant/planar.py) every load is contiguous and aligned.

Owns `rows_matvec(x_XI, raw_EOR, idx_K, qtype, layout) -> f32 [K, O]`: y[k, o] = sum_i W[idx[k], o, i] x[k or 0, i]
over raw rows `raw[E, O, row_bytes]` (a whole stack, or the K rows a tier gathered): MXFP4 in the GGML layout (as
in the file: the tiers' rows) or the planar one (resident weights), Q8_0 in the planar one; `supported(...)`, which
says when it applies; and `planar_weights()`, whether an engine regroups its resident weights for it.
`qtensor.qmatvec_experts` and `qtensor.qmatvec` call it on CUDA only (`lax.platform_dependent`); every other
platform and format, and the `rows_as_dots` / `act_round` products, keep the XLA spelling, which stays the
reference (tests/test_triton_matvec.py: the kernel in Pallas' interpreter on the CPU against a float64
re-derivation from gguf-py's dequantizer; on the GPU against XLA).

Loads: a program's step gathers [BO rows, NB blocks, P] quant bytes with explicit offsets (row * row_bytes + the
block's quant offset + p): in the GGML layout an MXFP4 block's 16 bytes start at block * 17 + 1 (contiguous, so a
warp's loads coalesce, but unaligned); in the planar layout at block * P from the row's start (P = 16 for MXFP4,
32 for Q8_0; aligned, so Triton can load 16 bytes at once). Then the [BO, NB] scale bytes and the x values.
MXFP4 decode: `_e2m1_doubled`, integer and float ops per value, no conversion or select.

Arithmetic (the same for every program, whatever E, K, the row's tier, the layout or the grid): within a block the
quant * x terms are summed (MXFP4: 16 low * x + high * x terms), times the block's scale; the NB blocks of a step
are summed and added to one f32 accumulator per row, step after step. That is not XLA's order, so the kernel
agrees with the XLA path to f32 rounding, not bitwise; decode stays exact against itself because every such
one-token product on CUDA is this kernel with a tile set by the shape alone (placements, layouts, drafting, prompt
pieces and row-batched decode alike). `JDS41_TRITON=0` in the environment turns the kernel off (read once, at
import: for A/B benchmarks); without Pallas' Triton backend (deprecated in jax 0.11) the XLA path runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl

# JDS41_TRITON: "1" (default) the kernel on CUDA, "0" off (XLA everywhere), "interpret" the kernel on every
# platform through Pallas' interpreter: the engine's tests then run the kernel's arithmetic on the CPU
# (tests/test_triton_engine.py).
_MODE = os.environ.get("JDS41_TRITON", "1")
ENABLED, INTERPRET = _MODE != "0", _MODE == "interpret"
# JDS41_PLANAR=0 keeps resident weights in the GGML layout (for A/B benchmarks of the planar kernels).
PLANAR = os.environ.get("JDS41_PLANAR", "1") != "0"
_BACKEND = importlib.util.find_spec("jax.experimental.pallas.triton") is not None  # deprecated upstream (jax 0.11)
VALUES, BLOCK_BYTES = 32, 17  # an MXFP4 block: one e8m0 scale byte, then 16 bytes of e2m1 nibbles
Q8_0_BLOCK_BYTES = 34  # a Q8_0 block: an f16 scale, then 32 int8 values
# The tile (rows per program BO, blocks per step NB, warps): BO and NB are the largest powers of two up to these
# that divide the shape (Triton's tiles are powers of two), so any whole-block row length runs.
# The tile, set by the product's shape alone (so every path that computes a product of that shape, whatever the
# tier, layout or batching, sums in the same order): BO rows per program, NB blocks per step, NUM_WARPS warps.
# BO is made small enough that the grid has about PROGRAMS programs (a [2048, 4096] shared-expert matrix at BO = 16
# was 128 programs for 132 SMs: latency-bound), NB large enough that a program's step loads about STEP_BYTES.
BO_MAX, PROGRAMS, STEP_BYTES, NB_MIN, NUM_WARPS = 16, 1024, 8192, 16, 4
# Offsets into the stack are 32-bit in Triton's lowering below 2^32 bytes, and signed products overflowed past
# 2^31 on the H200 (an illegal address with a 2.3 GB Q8_0 stack): larger stacks keep the XLA path.
MAX_STACK_BYTES = (1 << 31) - 1


def has_triton_backend() -> bool:
    """Whether this JAX has Pallas' Triton backend (deprecated upstream in jax 0.11)."""
    return _BACKEND


def supported(qtype, stack_bytes: int, layout: str = "ggml") -> bool:
    """Whether `rows_matvec` takes this stack (else the XLA path computes the product): MXFP4 rows in either layout,
    Q8_0 rows in the planar one (jds41/quant/planar.py), stacks under 2^31 bytes."""
    kinds = {(T.MXFP4, "ggml"), (T.MXFP4, "planar"), (T.Q8_0, "planar")}
    return ENABLED and (_BACKEND or INTERPRET) and (qtype, layout) in kinds and stack_bytes <= MAX_STACK_BYTES


def planar_weights(act_round: str | None = None) -> bool:
    """Whether an engine regroups its resident Q8_0 / MXFP4 weights into planar rows (jds41/quant/planar.py) for
    these kernels: where they run (CUDA, or every platform with JDS41_TRITON=interpret) and the activation is read
    as is. Elsewhere the GGML rows stay, and XLA reads either layout to the same bits."""
    if not (ENABLED and PLANAR) or act_round is not None or not (_BACKEND or INTERPRET):
        return False
    return INTERPRET or jax.default_backend() == "gpu"


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    b = 1 << max(0, int(most).bit_length() - 1)  # the largest power of two <= most
    while n % b:
        b //= 2
    return b


def default_tile(qtype, K: int, n_out: int, n_in: int) -> tuple[int, int, int]:
    """(BO, NB, warps) for K products of [n_out, n_in] rows (the module's tile rule; a function of the shape only)."""
    bo = _largest_power_of_two_dividing(n_out, min(BO_MAX, max(1, K * n_out // PROGRAMS)))
    quant = VALUES if qtype == T.Q8_0 else VALUES // 2  # quant bytes per block
    nb = _largest_power_of_two_dividing(n_in // VALUES, max(NB_MIN, STEP_BYTES // (bo * quant)))
    return bo, nb, NUM_WARPS


def _mxfp4_scale(e):
    """e8m0 byte -> 2^(e - 128) as f32 (ggml keeps the e2m1 values doubled and halves the scale), subnormals
    included (e < 2), assembled from bits so nothing flushes."""
    e = e.astype(jnp.int32)
    bits = jnp.where(e >= 2, (e - 1) << 23, jnp.left_shift(jnp.int32(1), 21 + e))
    return lax.bitcast_convert_type(bits, jnp.float32)


_MAG, _SIGN, _ONE = np.uint32(0x01C00000), np.uint32(0x80000000), np.uint32(0x3F800000)


def _e2m1_doubled(q, shift: int):
    """The doubled e2m1 value ({0, 1, 2, 3, 4, 6, 8, 12}, sign at bit 3) of the nibble of uint32 bytes `q` at bit
    `shift` (0 or 4), with no lookup, conversion or select: the 3 magnitude bits m added at bits 22-24 to 1.0f read
    as g = {1, 1.5, 2, 3, 4, 6, 8, 12}, which is the value from m = 2 up; g + min(g - 2, 0) maps 1 and 1.5 (m = 0,
    1) to 0 and 1; the sign bit is then XORed in. Every intermediate is a normal f32, so no backend can flush it.
    XLA's decode (blocks._dec_mxfp4) assembles each value with selects and a conversion, and that work, not the
    bytes, bounded it on the H200."""
    g = lax.bitcast_convert_type(((q << (22 - shift)) & _MAG) + _ONE, jnp.float32)
    kv = g + jnp.minimum(g - np.float32(2), np.float32(0))
    sign = (q << (28 - shift)) & _SIGN
    return lax.bitcast_convert_type(lax.bitcast_convert_type(kv, jnp.uint32) ^ sign, jnp.float32)


def _mxfp4_block_sums(q, x_lo, x_hi):
    """[BO, NB, 16] nibble bytes (uint32) times the block's [1, NB, 16] low / high x values -> [BO, NB] sums."""
    return jnp.sum(_e2m1_doubled(q, 0) * x_lo + _e2m1_doubled(q, 4) * x_hi, axis=2)


def _kernel(idx_ref, x_ref, w_ref, o_ref, *, qtype, planar: bool, n_in: int, n_out: int, bo: int, nb: int,
            steps: int, x_per_row: bool):
    k, j = pl.program_id(0), pl.program_id(1)
    e = idx_ref[k]
    kx = k if x_per_row else jnp.int32(0)
    rows = e * n_out + j * bo + jnp.arange(bo, dtype=jnp.int32)  # rows of the flattened [E * O, row_bytes] stack
    r3, r2 = rows[:, None, None], rows[:, None]
    blk = jnp.arange(nb, dtype=jnp.int32)[:, None]

    def step(t, acc_O):
        b = t * nb + blk  # [NB, 1]: this step's blocks
        if qtype == T.Q8_0:  # planar only: 32 quant bytes per block from the row's start, f16 scales after them
            pos = jnp.arange(VALUES, dtype=jnp.int32)[None, :]
            q = lax.bitcast_convert_type(w_ref[r3, (b * VALUES + pos)[None]], jnp.int8).astype(jnp.float32)
            x = x_ref[kx, b * VALUES + pos][None]  # [1, NB, 32]
            lo = w_ref[r2, (n_in + 2 * b[:, 0])[None, :]].astype(jnp.uint16)  # [BO, NB]: the f16 scale's bytes
            hi = w_ref[r2, (n_in + 2 * b[:, 0] + 1)[None, :]].astype(jnp.uint16)
            scale = lax.bitcast_convert_type(lo | (hi << 8), jnp.float16).astype(jnp.float32)
            sums = jnp.sum(q * x, axis=2)
        else:  # MXFP4: 16 nibble bytes per block; planar rows hold them from the row's start, scale bytes after
            pos = jnp.arange(16, dtype=jnp.int32)[None, :]
            q_at, e_at = (b * 16, n_in // 2 + b[:, 0]) if planar else (b * BLOCK_BYTES + 1, b[:, 0] * BLOCK_BYTES)
            q = w_ref[r3, (q_at + pos)[None]].astype(jnp.uint32)  # [BO, NB, 16]
            scale = _mxfp4_scale(w_ref[r2, e_at[None, :]])  # [BO, NB]
            x_lo = x_ref[kx, b * VALUES + pos][None]  # [1, NB, 16]: values 0-15 of each block (low nibbles)
            x_hi = x_ref[kx, b * VALUES + 16 + pos][None]  # values 16-31 (high nibbles)
            sums = _mxfp4_block_sums(q, x_lo, x_hi)
        return acc_O + jnp.sum(sums * scale, axis=1)

    o_ref[0, :] = lax.fori_loop(0, steps, step, jnp.zeros((bo,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("qtype", "layout", "interpret", "tile"))
def rows_matvec(x_XI: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype, layout: str = "ggml",
                interpret: bool = False, tile: tuple[int, int, int] | None = None) -> jax.Array:
    """y[k, o] = sum_i W[idx[k], o, i] x[k, i] (x [K, I]) or x[0, i] (x [1, I]) -> f32 [K, O], from raw rows
    `raw_EOR` uint8 [E, O, row_bytes] of `qtype` in `layout` ("ggml" as in the file, or "planar"). Indices are
    clamped to the stack like `jnp.take(mode="clip")`. `interpret` runs the kernel in Pallas' interpreter (any
    platform: the CPU tests); `tile` (BO, NB, warps) overrides the tile for benchmarks (BO must divide O and NB the
    row's blocks)."""
    E, n_out, R = raw_EOR.shape
    K, X, n_in = idx_K.shape[0], x_XI.shape[0], x_XI.shape[1]
    if (qtype, layout) not in {(T.MXFP4, "ggml"), (T.MXFP4, "planar"), (T.Q8_0, "planar")}:
        raise ValueError(f"rows_matvec does not take {qtype.name} rows in the {layout} layout")
    block_bytes = BLOCK_BYTES if qtype == T.MXFP4 else Q8_0_BLOCK_BYTES
    if n_in % VALUES or R != n_in // VALUES * block_bytes or X not in (1, K):
        raise ValueError(f"rows_matvec: rows of {R} bytes for {n_in} inputs, x with {X} rows for {K} indices")
    if E * n_out * R > MAX_STACK_BYTES:
        raise ValueError(f"rows_matvec: a stack of {E * n_out * R} bytes needs 64-bit offsets")
    bo, nb, warps = tile or default_tile(qtype, K, n_out, n_in)
    if n_out % bo or (n_in // VALUES) % nb:
        raise ValueError(f"tile ({bo}, {nb}) does not divide {n_out} rows of {n_in // VALUES} blocks")
    kernel = functools.partial(_kernel, qtype=qtype, planar=layout == "planar", n_in=n_in, n_out=n_out, bo=bo, nb=nb,
                               steps=n_in // (nb * VALUES), x_per_row=X > 1)
    params = None
    if interpret:  # Interpreted, the kernel is XLA:CPU code inlined into the caller (loops of one trip vanish): two
        # calls on one weight could then share its decoded loads (CSE) and fuse, and so round, by their surroundings.
        # The barrier keeps each call's arithmetic its own, as the compiled Triton kernel's is on the GPU.
        x_XI, raw_EOR = lax.optimization_barrier((x_XI, raw_EOR))
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=warps, num_stages=2)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((K, n_out), jnp.float32), grid=(K, n_out // bo),
        out_specs=pl.BlockSpec((1, bo), lambda k, j: (k, j)), compiler_params=params, interpret=interpret,
        name=f"rows_matvec_{qtype.name.lower()}_{layout}",
    )(jnp.clip(idx_K.astype(jnp.int32), 0, E - 1), x_XI.astype(jnp.float32), raw_EOR.reshape(E * n_out, R))
