"""Decode's one-token Q8_0 products as a Mosaic GPU kernel whose weight loads run through an explicit TMA pipeline.

Why (experiments/README.md, thirty-first and thirty-second sessions): the Triton kernel (quant/triton_matvec.py)
is bound by latency, each program waiting for its step's loads; Triton pipelines loads that feed no dot only when
asked (quant/loop_stages.py), and whether it does so for the kernel's gathered loads is unmeasured. Pallas' Mosaic
GPU backend, which JAX asks Triton-backend users to move to, states the pipeline instead: `plgpu.emit_pipeline`
copies each step's tiles from HBM to shared memory with the Hopper TMA unit, `stages` steps in flight per CTA, and
the warpgroup computes on a step while the next ones arrive. This is that kernel for planar Q8_0 rows, the format
that is bound by bytes (V4.1's attention and shared expert: ~170 of a layer's ~230 MB of products). Opt-in:
nothing in the engine calls it unless JDS41_MOSAIC_Q8=1; experiments/bench_kernels.py --mgpu times it against the
Triton kernel and XLA.

Owns `q8_0_matvec(x_XI, raw_EOR, idx_K, *, stages, splits, interpret) -> f32 [K, O]`, the contract of
`triton_matvec.rows_matvec` for planar Q8_0 rows: y[k, o] = sum_i W[idx[k], o, i] x[k or 0, i], indices clamped.

The grid: one CTA (one warpgroup) per selection k, BO = 64 rows (the height of Mosaic's WGMMA register layout) and
split s of the row: a shape with few row tiles (V4.1's kv: 8 CTAs for 132 SMs) splits its rows' steps over S CTAs
(`default_splits`: the fewest that give 2 CTAs an SM), whose partial sums are added in split order after the call.
Its pipeline walks the row in steps of NB = 8 blocks of 32; a step's tiles are the rows' 256 quant bytes, their 16
scale bytes (planar rows hold every quant first, then every f16 scale: quant/planar.py) and x's 256 values. NB is
fixed by the TMA unit: a tile spans at most 256 elements along a dimension, and its row at least 16 bytes. Per
block: the [64, 32] int8 quants to f32 in WGMMA's layout (through 2^23's bits, no conversion instruction), times
x broadcast over the rows, summed over the 32 columns (within a thread, then across the lanes that share a row),
times the rows' f16 scale assembled from its two bytes, added to one f32 accumulator per row, block after block.
That order is not the Triton kernel's, so the two agree to f32 rounding, not bitwise: an engine that uses this
kernel (JDS41_MOSAIC_Q8=1, quant/qtensor.py) uses it for every dense Q8_0 product of those shapes.

Pallas' GPU interpreter runs the kernel on the CPU (`interpret=True`: the tests, against a float64 re-derivation
from gguf-py's dequantizer); there the loads take the refs as they are, since the interpreter has neither layouts
nor `plgpu.load`. The CUDA lowering, which also runs on the CPU, checks the layouts and the TMA tiles.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

BO, NB = 64, 8  # rows a CTA (the WGMMA layout's height), blocks a step (a step reads 16 KB of quants, 1 KB of x)
DEFAULT_STAGES = 4  # steps in flight a CTA (emit_pipeline's max_concurrent_steps)
TARGET_CTAS = 2 * 132  # two CTAs for each of the H100's and H200's 132 SMs
# int8 v to f32 as (2^23 + v + 128) - (2^23 + 128): v + 128 = byte ^ 0x80 ORed into 2^23's bits, exact, with integer
# and float ops at full rate (an int-to-float conversion runs at a quarter of it); triton_matvec._dot_q8_0's trick
_Q8_MAGIC, _Q8_OFFSET = np.uint32(0x4B000080), np.float32((1 << 23) + 128)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _kernel(idx_gmem, x_gmem, w_gmem, o_gmem, o_smem, *, n_in: int, n_out: int, E: int, stages: int, splits: int,
            x_per_row: bool, interpret: bool):
    plgpu = _plgpu()
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def load(ref, layout):
        """A shared-memory tile in the layout the arithmetic needs (bank conflicts allowed: the tile is read once);
        interpreted, the ref as it is."""
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout, optimized=False)

    k, j, split = lax.axis_index("k"), lax.axis_index("o"), lax.axis_index("s")
    share = n_in // splits  # the inputs this CTA sums
    expert = jnp.clip(idx_gmem[k], 0, E - 1)
    rows = pl.ds(expert * n_out + j * BO, BO)

    def step(_, q_smem, s_smem, x_smem, acc):
        for b in range(NB):
            q = load(q_smem.at[:, pl.ds(b * 32, 32)], plgpu.Layout.WGMMA)  # [64, 32] uint8
            w = lax.bitcast_convert_type(q.astype(jnp.uint32) ^ _Q8_MAGIC, jnp.float32) - _Q8_OFFSET
            x = load(x_smem.at[pl.ds(b * 32, 32)], col_layout)
            sums = jnp.sum(w * lax.broadcast_in_dim(x, (BO, 32), (1,)), axis=1)  # [64]
            lo = load(s_smem.at[:, 2 * b], row_layout).astype(jnp.uint32)
            hi = load(s_smem.at[:, 2 * b + 1], row_layout).astype(jnp.uint32)
            scale = lax.bitcast_convert_type((lo | (hi << 8)).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
            acc = acc + sums * scale
        return acc

    zeros = jnp.zeros((BO,), jnp.float32)
    acc = plgpu.emit_pipeline(
        step, grid=(share // (NB * 32),),
        in_specs=[plgpu.BlockSpec((BO, NB * 32), lambda t: (0, t)),  # quants
                  plgpu.BlockSpec((BO, 2 * NB), lambda t: (0, t)),  # f16 scales as bytes
                  plgpu.BlockSpec((NB * 32,), lambda t: (t,))],  # x
        max_concurrent_steps=stages,
        init_carry=zeros if interpret else plgpu.layout_cast(zeros, row_layout),
    )(w_gmem.at[rows, pl.ds(split * share, share)], w_gmem.at[rows, pl.ds(n_in + split * (share // 16), share // 16)],
      x_gmem.at[k if x_per_row else 0, pl.ds(split * share, share)])
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, k, pl.ds(j * BO, BO)])
    plgpu.wait_smem_to_gmem(0)


def supported(n_out: int, n_in: int) -> bool:
    """Whether the kernel takes [n_out, n_in] rows: whole CTAs of 64 rows, whole steps of 256 values."""
    return n_out % BO == 0 and n_in % (NB * 32) == 0


def default_splits(K: int, n_out: int, n_in: int) -> int:
    """The fewest splits of a row's steps (dividing them) that give TARGET_CTAS CTAs, or one a step."""
    steps = n_in // (NB * 32)
    return next((s for s in range(1, steps + 1) if steps % s == 0 and K * (n_out // BO) * s >= TARGET_CTAS), steps)


@functools.partial(jax.jit, static_argnames=("stages", "splits", "interpret"))
def q8_0_matvec(x_XI: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, *, stages: int = DEFAULT_STAGES,
                splits: int | None = None, interpret: bool = False) -> jax.Array:
    """y[k, o] = sum_i W[idx[k], o, i] x[k, i] (x [K, I]) or x[0, i] (x [1, I]) -> f32 [K, O], from planar Q8_0 rows
    `raw_EOR` uint8 [E, O, I / 32 * 34]; indices clamped to the stack. `stages`: pipeline steps in flight a CTA;
    `splits`: CTAs a row's steps are shared among (dividing them; None: `default_splits`), their sums added in split
    order; `interpret` runs Pallas' GPU interpreter (any platform)."""
    plgpu = _plgpu()
    E, n_out, R = raw_EOR.shape
    K, X, n_in = idx_K.shape[0], x_XI.shape[0], x_XI.shape[1]
    if not supported(n_out, n_in) or R != n_in // 32 * 34 or X not in (1, K) or stages < 1:
        raise ValueError(f"q8_0_matvec: [{n_out}, {n_in}] rows of {R} bytes (planar Q8_0, {BO}-row CTAs, "
                         f"{NB * 32}-value steps), x with {X} rows for {K} indices, {stages} stages")
    splits = default_splits(K, n_out, n_in) if splits is None else splits
    if splits < 1 or (n_in // (NB * 32)) % splits:
        raise ValueError(f"q8_0_matvec: {splits} splits do not divide a row's {n_in // (NB * 32)} steps")
    kernel = functools.partial(_kernel, n_in=n_in, n_out=n_out, E=E, stages=stages, splits=splits, x_per_row=X > 1,
                               interpret=interpret)
    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra["interpret"] = InterpretGPUParams()
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((splits, K, n_out), jnp.float32),
                        grid=(K, n_out // BO, splits), grid_names=("k", "o", "s"),
                        scratch_types=dict(o_smem=plgpu.SMEM((BO,), jnp.float32)), **extra)
    out = call(idx_K.astype(jnp.int32), x_XI.astype(jnp.float32), raw_EOR.reshape(E * n_out, R))
    # the splits' partial sums in split order, one add at a time (a reduction over the axis may take any order)
    return functools.reduce(operator.add, (out[s] for s in range(1, splits)), out[0])
