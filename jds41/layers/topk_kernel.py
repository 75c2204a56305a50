"""The router's top-K of a token's expert scores as one Pallas (Triton) program on the GPU.

Why: `jax.lax.top_k` over a router's E = 256 or 384 scores ran on the H200 as an XLA sort, 5.6 us a layer in the
V4.1 decode profile (`sort_*` in results/profile_decode_int8_26_v41_4L_h200.jsonl, one a layer), where the rest
of the router is ~1 us kernels. K is 6: one program can hold the E scores in registers and take K maxima, each a
max and a min-index reduction over the row, with no sort: 2.4 us a layer in the same profile with it
(results/profile_decode_optins_v41_4L_h200.jsonl).

`top_k(x_E, k)` -> (values [k], indices [k] int32) with `lax.top_k`'s result for scores that are finite or -inf:
descending values, and on equal values the lower index first (so an exact tie keeps the lower expert, as the
router's docstring promises); the same K picks whatever their order, since each round takes the lowest untaken
index holding the largest untaken value. NaN scores are outside that promise (a router never makes them). On CUDA
it runs the kernel (JDS41_TOPK_KERNEL=0, read at import, keeps XLA's sort there, for A/B runs), elsewhere
`lax.top_k`, the reference; JDS41_TRITON=interpret runs the kernel on every platform through Pallas' interpreter
(tests/test_topk_kernel.py). Values are copied, never computed, so the kernel and the reference agree bit for bit.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

ENABLED = os.environ.get("JDS41_TOPK_KERNEL", "1") == "1"
MAX_N = 1024  # scores one program holds (a router's experts; V4.1 384, V4-Flash 256)


def _kernel(x_ref, v_ref, i_ref, *, n: int, k: int, width: int):
    row = pl.program_id(0)
    at = jnp.arange(width, dtype=jnp.int32)
    inside = at < n
    x = jnp.where(inside, x_ref[row, jnp.minimum(at, n - 1)], -jnp.inf)  # a power-of-two block over the n scores
    taken = ~inside  # positions past the row are never picked
    for j in range(k):
        best = jnp.max(jnp.where(taken, -jnp.inf, x))
        pick = jnp.min(jnp.where(~taken & (x == best), at, width))  # the lowest untaken index holding it
        taken = taken | (at == pick)
        v_ref[row, j] = best
        i_ref[row, j] = pick


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def top_k_rows(x_NE: jax.Array, k: int, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The kernel over N rows of E scores -> (values [N, k] f32, indices [N, k] int32), one program a row."""
    n_rows, n = x_NE.shape
    width = 1 << max(n - 1, 1).bit_length()  # Triton's blocks are powers of two
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, n=n, k=k, width=width),
        out_shape=(jax.ShapeDtypeStruct((n_rows, k), jnp.float32), jax.ShapeDtypeStruct((n_rows, k), jnp.int32)),
        grid=(n_rows,), compiler_params=params, interpret=interpret, name="router_top_k",
    )(x_NE.astype(jnp.float32))


def applies(n: int, k: int) -> bool:
    """Whether `top_k` can run the kernel: not switched off, Pallas' Triton backend (or the interpreter), a short
    row."""
    return ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET) \
        and k <= n <= MAX_N


def top_k(x_E: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x_E, k)` for a row of scores [..., E] (module docstring), by the kernel where it `applies`."""
    x_E = jnp.asarray(x_E, jnp.float32)
    n = x_E.shape[-1]

    def xla(x):
        values, idx = lax.top_k(x, k)
        return values, idx.astype(jnp.int32)

    if not applies(n, k):
        return xla(x_E)
    lead = x_E.shape[:-1]
    flat = x_E.reshape(-1, n)
    if triton_matvec.INTERPRET:
        values, idx = top_k_rows(flat, k, interpret=True)
    else:
        values, idx = lax.platform_dependent(flat, cuda=lambda x: top_k_rows(x, k), default=xla)
    return values.reshape(*lead, k), idx.reshape(*lead, k)
