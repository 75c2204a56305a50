"""The "int8" activation numerics: the routed experts' products read the activation rounded to int8 blocks of 32.

What it is: before a product with IQ2_XXS, Q2_K or MXFP4 weights (V4.1's and V4-Flash's routed experts), x is
rounded per block of 32 values to q * d, d = amax / 127 (f32), q = round-half-even(x * 127 / amax) in [-127, 127]
(q = d = 0 for a zero block). llama.cpp's CUDA backend rounds the same way before its quantized matrix-vector
products (q8_1 blocks of 32, whose d it stores as f16), and its CPU backend rounds the two-bit formats to Q8_K
(blocks of 256). With JDS41_INT8_Q8_0=1 the Q8_0 products round too (as llama.cpp's CUDA backend does; opt-in:
its rounding launches cost what its products saved). Every other format, and every
product when the numerics is off (`QTensor.act_round` None), reads x as is.

Why: with int8 activations a product is an integer dot product within each block of 32 and a few float
multiplies per block, which the GPU does four values an instruction (dp4a): the two-bit expert kernels were bound
by their per-value float arithmetic and their table lookups (quant/triton_matvec.py, `_iq2xxs_grid_words`). The
rounding changes the numbers, so it is a numerics of its own (`Engine.open(numerics="int8")`), never the default,
and its fidelity against the f32 activation is measured, not assumed (experiments/README.md).

The product, per weight block b of 256 and activation block c of 32 (its 32 values in group g = c mod 8 of b):
  IQ2_XXS  y += d_b * sum_g (dx_c * f32((2 s_g + 1) * sum_32 w * q)) / 8        (w the signed grid value)
  Q2_K     y += d_b * sum_j (dx_j * f32(sc_j * sum_16 code * q)) - dmin_b * sum_j (dx_j * f32(m_j * sum_16 q))
           over the 16 sub-blocks j of 16 values, dx_j the scale of the activation block holding j.
  Q8_0     y += d_b * (dx_b * f32(sum_32 w * q))                                 (blocks of 32: b = c)
  MXFP4    y += 2^(e_b - 128) * (dx_b * f32(sum_32 w * q))   (w ggml's doubled e2m1 integer, -12..12; b = c)
Integer sums are exact; the float sums run in a fixed order here (left to right, so a product's bits do not depend
on its shape) and in the kernel's order on the GPU (quant/triton_int8.py), which agree to f32 rounding.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax

from jds41.quant.blocks import _f16, iq2_xxs_integers, mxfp4_half_scale, mxfp4_integers
from jds41.quant.planar import _unpack_crumbs, block_parts

PRODUCT_TYPES = frozenset({T.IQ2_XXS, T.Q2_K, T.MXFP4, T.Q8_0})  # the formats the integer product takes
# the formats whose products the "int8" numerics rounds x for: the routed experts' (two-bit and MXFP4), and Q8_0
# too with JDS41_INT8_Q8_0=1 (read at import; its own rounding launches cost what its faster products saved on an
# H100, experiments/README.md, thirty-first session)
INT8_TYPES = PRODUCT_TYPES if os.environ.get("JDS41_INT8_Q8_0", "0") == "1" else frozenset({T.IQ2_XXS, T.Q2_K,
                                                                                             T.MXFP4})
BLOCK = 32  # activation values per int8 block


def round_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 x[..., n] (n % 32 == 0) -> (q int8[..., n], d f32[..., n / 32]): x ~ q * d per block of 32."""
    b = jnp.asarray(x, jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(b), axis=-1)
    live = amax != 0
    inv = jnp.where(live, np.float32(127) / jnp.where(live, amax, 1), 0)
    q = jnp.clip(jnp.round(b * inv[..., None]), -127, 127).astype(jnp.int8)  # jnp.round: half to even
    # d = amax * f32(1/127), spelled as XLA's simplifier rewrites amax / 127 anyway (the bits it always had), so the
    # GPU rounding kernel (quant/int8_round_kernel.py) can write the same product
    return q.reshape(x.shape), amax * np.float32(1 / 127)


def int8_values(x: jax.Array) -> jax.Array:
    """x as the "int8" numerics reads it, f32: q * d of `round_int8` (what a product's dot form multiplies)."""
    q, d = round_int8(x)
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, BLOCK) * d[..., None]
    return blocks.reshape(x.shape)


def _chain(parts):
    """parts[0] + parts[1] + ... left to right: a fixed order whatever the arrays' shapes."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _last_axis_chain(a: jax.Array) -> jax.Array:
    return _chain([a[..., i] for i in range(a.shape[-1])])


def xla_int8_rows_matvec(q_XI: jax.Array, d_XC: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype,
                         layout: str = "ggml") -> jax.Array:
    """y[k, o] = sum_i W[idx[k], o, i] x[k or 0, i] with x = int8 blocks (q [1 or K, I], d [1 or K, I / 32]) and W
    raw rows [E, O, R] of one of PRODUCT_TYPES in `layout`, by the module's formula -> f32 [K, O]; indices clamped."""
    if qtype not in PRODUCT_TYPES:
        raise ValueError(f"the int8 product takes {sorted(t.name for t in PRODUCT_TYPES)}, not {T(qtype).name}")
    raw_KOR = jnp.take(jnp.asarray(raw_EOR), idx_K, axis=0, mode="clip")
    scales, quants = block_parts(raw_KOR, qtype, layout)  # [K, O, nb, h], [K, O, nb, p]
    nb = scales.shape[-2]
    q = jnp.asarray(q_XI).astype(jnp.int32)[:, None]  # [X, 1, I]
    dx = jnp.asarray(d_XC, jnp.float32)[:, None]  # [X, 1, I / 32]
    if qtype == T.IQ2_XXS:
        w, ls = iq2_xxs_integers(quants)  # [K, O, nb, 8, 32], [K, O, nb, 8]
        isum = jnp.sum(w * q.reshape(*q.shape[:2], nb, 8, 32), axis=-1)
        per_group = dx.reshape(*dx.shape[:2], nb, 8) * (isum * ls).astype(jnp.float32)
        per_block = _f16(scales) * _last_axis_chain(per_group) * np.float32(0.125)  # [K, O, nb]
    elif qtype == T.Q8_0:
        isum = jnp.sum(lax.bitcast_convert_type(quants, jnp.int8).astype(jnp.int32) * q.reshape(*q.shape[:2], nb, 32),
                       axis=-1)
        per_block = _f16(scales) * (dx * isum.astype(jnp.float32))
    elif qtype == T.MXFP4:
        nibbles = jnp.concatenate([quants & 15, quants >> 4], axis=-1).astype(jnp.int32)  # value j: byte j % 16
        isum = jnp.sum(mxfp4_integers(nibbles) * q.reshape(*q.shape[:2], nb, 32), axis=-1)
        per_block = mxfp4_half_scale(scales[..., 0]) * (dx * isum.astype(jnp.float32))
    else:
        codes = _unpack_crumbs(quants).reshape(*quants.shape[:-1], 16, 16).astype(jnp.int32)  # [K, O, nb, 16, 16]
        sc = scales[..., :16].astype(jnp.int32)
        q16 = q.reshape(*q.shape[:2], nb, 16, 16)
        dx16 = jnp.repeat(dx.reshape(*dx.shape[:2], nb, 8), 2, axis=-1)  # sub-block j reads block j // 2's d
        scaled = _last_axis_chain(dx16 * ((sc & 15) * jnp.sum(codes * q16, axis=-1)).astype(jnp.float32))
        mins = _last_axis_chain(dx16 * ((sc >> 4) * jnp.sum(q16, axis=-1)).astype(jnp.float32))
        per_block = _f16(scales[..., 16:18]) * scaled - _f16(scales[..., 18:20]) * mins
    return _last_axis_chain(per_block)
