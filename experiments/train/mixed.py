"""Mixed-precision products: inputs rounded to the compute dtype (bf16 in training), f32 accumulation.

On GPU this is one dot with bf16 operands and `preferred_element_type=f32`. XLA:CPU (jax 0.10) has no
bf16 x bf16 -> f32 dot, so there the operands are rounded to bf16 and multiplied in f32: the same input rounding,
so CPU tests exercise the bf16 training path's numerics up to the accumulation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def dot(eq: str, a, b, dtype) -> jax.Array:
    """jnp.einsum(eq, a, b) with a, b rounded to `dtype`, accumulated and returned in f32."""
    if jnp.dtype(dtype) == jnp.dtype(F32):
        return jnp.einsum(eq, a.astype(F32), b.astype(F32), preferred_element_type=F32)
    if jax.default_backend() == "cpu":
        return jnp.einsum(eq, a.astype(dtype).astype(F32), b.astype(dtype).astype(F32), preferred_element_type=F32)
    return jnp.einsum(eq, a.astype(dtype), b.astype(dtype), preferred_element_type=F32)
