"""The "int8" numerics' rounding of an activation (int8_act.round_int8) as one Pallas (Triton) kernel on the GPU
(the default where the int8 products run on CUDA; JDS41_INT8_ROUND_KERNEL=0 keeps XLA's three kernels).

Why (experiments/README.md, 28th session): XLA:GPU computes `round_int8` as three kernels, a block maximum, the
rounding and the scales (an amax reduction feeds elementwise work, which XLA does not fuse into one kernel), about
1.1 us each. A V4.1 layer rounds two activations for its two-bit experts, and seven with the Q8_0 products rounded
too (JDS41_INT8_Q8_0=1): ~16 of its ~80 kernels. One program here rounds a chunk of a row's blocks in one pass: the
block maxima, q and d, written in one launch; for Q2_K's kernel it writes q in the order that kernel reads
(`triton_matvec._crumb_major`), which took a fourth kernel, a transpose.

Bits: the same as `round_int8`'s on the same platform, not merely close. inv = 127 / amax is an IEEE division (PTX
div.rn.f32: Triton's own f32 division is the approximate div.full) and d = amax * f32(1 / 127), the product XLA's
algebraic simplifier makes of round_int8's division by the constant 127 on every platform (the compiled HLO has a
multiply there; this kernel's first GPU run divided and failed its bit test at 5 of 6 shapes, experiments/README.md,
thirtieth session); q = round-half-even of x * inv (cvt.rni), clipped to [-127, 127]; a zero block gives q = 0
and d = 0. Pallas' interpreter has no inline assembly, so there (the CPU tests) the same steps are jnp's division
and `jnp.round`, which are IEEE and half-to-even. tests/test_int8_round_kernel.py checks both against
`round_int8`, bit for bit.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant.int8_act import BLOCK

# On by default (read at import) since its GPU run at 451c1c4 (H100; experiments/README.md, thirty-first session):
# bit-equal to round_int8 at every tested shape, 12 fewer kernels and 12-14 us less device time a V4.1 4-layer
# token; decode tok/s within noise. JDS41_INT8_ROUND_KERNEL=0 rounds with XLA's kernels.
ENABLED = os.environ.get("JDS41_INT8_ROUND_KERNEL", "1") != "0"
_MOST_BLOCKS = 32  # blocks of 32 a program rounds (a power of two: Triton's blocks are)


def _div_rn_asm(a, b):
    """a / b rounded to nearest (IEEE), f32, elementwise over one shape."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def _rint_asm(v):
    """f32 -> int32, rounded half to even (PTX cvt.rni)."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm("cvt.rni.s32.f32 $0, $1;", args=[v], constraints="=r,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int32)])
    return out


def _div_rn_plain(a, b):
    return a / b


def _rint_plain(v):
    return jnp.round(v).astype(jnp.int32)  # half to even, as round_int8's


def block_positions(first, nbk: int):
    """[nbk, 32] positions in a row of the nbk blocks of 32 from block `first` on."""
    return (first + jnp.arange(nbk, dtype=jnp.int32)[:, None]) * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)[None, :]


def round_blocks(b, *, div, rint):
    """f32 blocks [nb, 32] -> (q int8 [nb, 32], d f32 [nb]) as `round_int8` rounds them (module docstring)."""
    amax = jnp.max(jnp.abs(b), axis=1)
    live = amax != 0
    amax_or_1 = jnp.where(live, amax, np.float32(1))
    inv = jnp.where(live, div(jnp.full_like(amax, 127), amax_or_1), np.float32(0))
    q = jnp.clip(rint(b * inv[:, None]), -127, 127).astype(jnp.int8)
    return q, amax * np.float32(1 / 127)


def crumb_major_positions(at):
    """Where Q2_K's kernel reads the values at row positions `at` (`triton_matvec._crumb_major`): value 4t + u of
    a block of 256 at 64u + t of it."""
    within = at % 256
    return at - within + (within % 4) * 64 + within // 4


def row_chunk(n_in: int, crumb_major: bool) -> int:
    """Blocks of 32 a program takes of a row of n_in values: the largest power of two dividing the row's blocks,
    capped, and whole blocks of 256 where q is written crumb-major (n_in % 256 == 0 makes 8 divide the blocks)."""
    blocks = n_in // BLOCK
    nbk = min(blocks & -blocks, _MOST_BLOCKS)
    return max(nbk, 8) if crumb_major else nbk


def asm_or_plain(interpret: bool):
    """(div, rint) for a kernel body: PTX's IEEE division and half-to-even conversion compiled, jnp's interpreted."""
    return (_div_rn_plain, _rint_plain) if interpret else (_div_rn_asm, _rint_asm)


def _kernel(x_ref, q_ref, d_ref, *, nbk: int, crumb_major: bool, div, rint):
    row, chunk = pl.program_id(0), pl.program_id(1)
    first = chunk * nbk  # the chunk's first block of 32
    at = block_positions(first, nbk)
    q, d = round_blocks(x_ref[row, at], div=div, rint=rint)
    q_ref[row, crumb_major_positions(at) if crumb_major else at] = q
    d_ref[row, first + jnp.arange(nbk, dtype=jnp.int32)] = d


@functools.partial(jax.jit, static_argnames=("crumb_major", "interpret"))
def round_int8_rows(x_XI: jax.Array, crumb_major: bool = False, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`round_int8(x)` for x f32 [X, I] (I a multiple of 32) -> (q int8 [X, I], d f32 [X, I / 32]) by the kernel;
    `crumb_major` writes q permuted as `triton_matvec._crumb_major` (I a multiple of 256); `interpret` runs it in
    Pallas' interpreter (any platform)."""
    X, n_in = x_XI.shape
    if n_in % BLOCK or (crumb_major and n_in % 256):
        raise ValueError(f"round_int8_rows: {n_in} values a row are not whole blocks of {256 if crumb_major else 32}")
    blocks = n_in // BLOCK
    nbk = row_chunk(n_in, crumb_major)
    params = None
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        x_XI = lax.optimization_barrier(x_XI)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=2, num_stages=1)
    div, rint = asm_or_plain(interpret)
    kernel = functools.partial(_kernel, nbk=nbk, crumb_major=crumb_major, div=div, rint=rint)
    q, d = pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((X, n_in), jnp.int8), jax.ShapeDtypeStruct((X, blocks), jnp.float32)),
        grid=(X, blocks // nbk), compiler_params=params, interpret=interpret, name="round_int8",
    )(jnp.asarray(x_XI, jnp.float32))
    return lax.optimization_barrier((q, d)) if interpret else (q, d)
