"""Engram combine in the graph (MODEL.md §3 "Combine"): gathered table rows -> gated update of the 4-copy stream.

Runs at the entry of each Engram layer (V4.1: layers 1 and 14), before that block's hc_pre. The row ids and row
bytes come from the host (`jds41.layers.engram_rows`); here:
1. dequantize the n_buckets rows ("e4m3_e8m0_32": head_dim E4M3 codes then head_dim/32 E8M0 scales per row;
   value = e4m3 * 2^(scale - 127)) and concatenate them in bucket order -> E [embed_dim];
2. kv = wkv @ E, wkv [(H+1)*D, embed_dim]: rows 0..H*D-1 are the H keys k_c (copy-major), the last D the shared
   value v;
3. per copy c: dot = sum_d x_c[d] q_w[c,d] k_w[c,d] k_c[d] * rsqrt(mean x_c^2 + eps) * rsqrt(mean k_c^2 + eps)
   / sqrt(D) (q_w and k_w [H, D] only ever appear as their product), g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))),
   x_c += g v; g = 0 for inactive (image) tokens.

All arithmetic is f32. The T-row form is the one-row form under `vmap`, with the weight unbatched, so a verify
batch of T rows does the per-row arithmetic of T single-token steps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jds41.quant import QTensor, qmatvec

SCALE_BLOCK = 32  # values per E8M0 scale
GATE_FLOOR = 1e-6  # |dot| floor under the square root


def head_dim_of(row_bytes: int) -> int:
    """Values per row from its byte width: row_bytes = head_dim + head_dim / 32."""
    head_dim, rem = divmod(row_bytes * SCALE_BLOCK, SCALE_BLOCK + 1)
    if rem or head_dim % SCALE_BLOCK:
        raise ValueError(f"{row_bytes} bytes is not an e4m3_e8m0_32 row (head_dim + head_dim/32)")
    return head_dim


def dequant_rows(rows_u8: jax.Array) -> jax.Array:
    """uint8 [..., row_bytes] "e4m3_e8m0_32" rows -> f32 [..., head_dim].

    The scale 2^(s-127) is assembled from its f32 bit pattern (s = 0 gives the denormal 2^-127, s = 255 NaN as in
    E8M0), and e4m3 * 2^k is exact in f32, so values are bit-exact with the host decoder except where the
    product is an f32 denormal, which XLA:CPU flushes to zero.
    """
    rows = jnp.asarray(rows_u8).astype(jnp.uint8)
    head_dim = head_dim_of(rows.shape[-1])
    nb = head_dim // SCALE_BLOCK
    codes = lax.bitcast_convert_type(rows[..., :head_dim], jnp.float8_e4m3fn).astype(jnp.float32)
    s = rows[..., head_dim:].astype(jnp.uint32)
    bits = jnp.where(s == 0, jnp.uint32(0x00400000), jnp.where(s == 255, jnp.uint32(0x7FC00000), s << 23))
    scale = lax.bitcast_convert_type(bits, jnp.float32)
    vals = codes.reshape((*codes.shape[:-1], nb, SCALE_BLOCK)) * scale[..., None]
    return vals.reshape(codes.shape)


def _matvec(e_K: jax.Array, w) -> jax.Array:
    """w [O, K] @ e [K] in f32, for a QTensor or a plain float array (same multiply-and-sum form)."""
    if isinstance(w, QTensor):
        return qmatvec(e_K, w)
    return jnp.sum(jnp.asarray(w).astype(jnp.float32) * e_K, axis=-1)


def engram_combine(x_HD: jax.Array, rows_u8: jax.Array, wkv, q_w: jax.Array, k_w: jax.Array, eps: float,
                   active=True) -> jax.Array:
    """One token: x [H, D] (the H hyper-connection copies) plus its rows uint8 [n_buckets, row_bytes] -> new x.

    `wkv` [(H+1)*D, n_buckets*head_dim] (QTensor or array), `q_w`, `k_w` [H, D], `eps` the model's RMS eps,
    `active` a bool (scalar, may be traced): False leaves x unchanged (image tokens).
    """
    H, D = x_HD.shape
    e_K = dequant_rows(rows_u8).reshape(-1)
    kv = _matvec(e_K, wkv)
    if kv.shape != ((H + 1) * D,):
        raise ValueError(f"engram wkv gives {kv.shape[0]} outputs, expected (H+1)*D = {(H + 1) * D}")
    k_HD = kv[:H * D].reshape(H, D)
    v_D = kv[H * D:]
    x = x_HD.astype(jnp.float32)
    qk_HD = q_w.astype(jnp.float32) * k_w.astype(jnp.float32)
    dot_H = jnp.sum(x * qk_HD * k_HD, axis=-1)
    r_x = lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)
    r_k = lax.rsqrt(jnp.mean(k_HD * k_HD, axis=-1) + eps)
    dot_H = dot_H * r_x * r_k / math.sqrt(D)
    g_H = jax.nn.sigmoid(jnp.sign(dot_H) * jnp.sqrt(jnp.maximum(jnp.abs(dot_H), GATE_FLOOR)))
    g_H = jnp.where(active, g_H, 0.0)
    return (x + g_H[:, None] * v_D[None, :]).astype(x_HD.dtype)


def engram_combine_T(x_THD: jax.Array, rows_TNB: jax.Array, wkv, q_w: jax.Array, k_w: jax.Array, eps: float,
                     active_T: jax.Array | None = None) -> jax.Array:
    """T tokens: x [T, H, D], rows uint8 [T, n_buckets, row_bytes], `active_T` bool [T] (None: all active)."""
    if active_T is None:
        active_T = jnp.ones((x_THD.shape[0],), bool)
    return jax.vmap(engram_combine, in_axes=(0, 0, None, None, None, None, 0))(
        x_THD, rows_TNB, wkv, q_w, k_w, eps, active_T)
