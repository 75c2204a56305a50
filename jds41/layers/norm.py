"""RMS normalisation, the one norm of DeepSeek V4 / V4.1 (MODEL.md §2, LLAMACPP_DEEPSEEK4.md §3).

Owns `rms_norm(x, weight, eps)`: y = x * rsqrt(mean(x^2) + eps) over the last axis, then times `weight` when one
is given (attn/ffn/q_a/kv/compressor/output norms); the V4 per-head q norm passes `weight=None`. Always f32.

Leading axes broadcast (per-head q norm passes [H, HD]). Row invariance: XLA may lower a reduction over many rows
differently from the same reduction over one row (seen on CPU with 64 rows of width <= 512), so paths that must be
bit-identical to one-token decode (speculative verify) call this inside a per-row `jax.lax.map`, where every row
sees exactly the decode shapes; router.py / moe.py / mhc.py do that in their `*_rows` functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2, last axis) + eps) [* weight]; `x` [..., D], `weight` [D] or None; f32 result."""
    x = jnp.asarray(x, jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps))
    if weight is not None:
        y = y * jnp.asarray(weight, jnp.float32)
    return y
