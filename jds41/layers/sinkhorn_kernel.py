"""mHC's Sinkhorn normalisation (layers/mhc.py `_sinkhorn`) as one Pallas (Triton) kernel per call on the GPU.

Why (experiments/README.md, "Where a decode token's time goes"): the comb matrix is 4 x 4, and its 20 rounds of
row and column normalisation are a chain in which every round reads every value of the round before. As the
reference's `fori_loop`, XLA:GPU ran every round as a host-launched loop iteration; unrolled, it cannot fuse such a
chain without recomputing it exponentially, so it cut it into about 20 kernels of ~1.3 us per sublayer: on the
V4-Flash 8-layer shape, 370 of the 857 kernels of a decode step. Here one program takes one row's 16 logits
as one [4, 4] tile, a lane each, and runs the whole normalisation there, so a sublayer's comb is one launch. A
round's four row (or column) sums are reductions across lanes, and each normalisation multiplies by the sums'
reciprocals (4 divisions a round, not 16). An earlier form kept the 16 values as one thread's scalars and summed
left to right, as `_sinkhorn` writes it: its serial chain of adds and divisions took 4.2 us a call on the H200,
this form 3.3 (results/profile_decode_optins_v41_4L_h200.jsonl against profile_decode_int8_26_v41_4L_h200.jsonl).

`sinkhorn(logits_SD, hc_eps, iters)` takes logits [..., H, H] (any leading axes: decode's one row, a block's rows,
a vmapped batch); on CUDA it runs the kernel (one program per row: each row's arithmetic is the same whatever the
rows around it), elsewhere `default` (mhc's XLA spelling, the reference). The kernel's exp and division are
Triton's, so it agrees with the XLA spelling to f32 rounding, not bitwise; every comb on CUDA is this kernel, so
decode, verification and prefill rows stay exact against each other there. JDS41_TRITON=0 turns it off, and
JDS41_TRITON=interpret runs it on every platform in Pallas' interpreter (tests/test_sinkhorn_kernel.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

H = 4  # hyper-connection copies: the only count the validated configs allow


def normalise(lg, eps: float, iters: int):
    """Inside a kernel: the comb [H, H] of one row's logits [src, dst] (also layers/mhc_input_kernel.py's)."""
    eps, one = jnp.float32(eps), jnp.float32(1)
    e = jnp.exp(lg - jnp.max(lg, axis=1, keepdims=True))
    c = e * (one / jnp.sum(e, axis=1, keepdims=True)) + eps  # softmax over dst, + hc_eps
    cols = lambda c: c * (one / (jnp.sum(c, axis=0, keepdims=True) + eps))  # noqa: E731
    rows = lambda c: c * (one / (jnp.sum(c, axis=1, keepdims=True) + eps))  # noqa: E731
    c = cols(c)
    for _ in range(iters - 1):
        c = cols(rows(c))
    return c


def _kernel(l_ref, o_ref, *, eps: float, iters: int):
    i = pl.program_id(0)
    at = jnp.arange(H, dtype=jnp.int32)[:, None] * H + jnp.arange(H, dtype=jnp.int32)[None, :]  # [src, dst]
    o_ref[i, at] = normalise(l_ref[i, at], eps, iters)


@functools.partial(jax.jit, static_argnames=("eps", "iters", "interpret"))
def sinkhorn_rows(logits_N16: jax.Array, eps: float, iters: int, interpret: bool = False) -> jax.Array:
    """The kernel over N rows of 16 logits (src-major) -> the N combs, [N, 16] f32."""
    n = logits_N16.shape[0]
    params = None
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        logits_N16 = lax.optimization_barrier(logits_N16)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=1, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), iters=int(iters)),
        out_shape=jax.ShapeDtypeStruct((n, H * H), jnp.float32), grid=(n,), compiler_params=params,
        interpret=interpret, name="mhc_sinkhorn",
    )(logits_N16.astype(jnp.float32))
    return lax.optimization_barrier(out) if interpret else out


def applies(h: int) -> bool:
    """Whether `sinkhorn` can run the kernel (Pallas' Triton backend, or the interpreter, and H = 4)."""
    return h == H and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET)


def sinkhorn(logits_SD: jax.Array, hc_eps: float, iters: int, default):
    """Comb [..., H, H] of logits [..., H, H]: the kernel on CUDA (or interpreted), `default(logits)` elsewhere."""
    lead = logits_SD.shape[:-2]
    flat = logits_SD.reshape(-1, H * H)

    def kernel(x, interpret=False):
        return sinkhorn_rows(x, hc_eps, iters, interpret=interpret)

    def xla(x):
        return default(x.reshape(-1, H, H)).reshape(-1, H * H)

    if triton_matvec.INTERPRET:
        out = kernel(flat, interpret=True)
    else:
        out = lax.platform_dependent(flat, cuda=kernel, default=xla)
    return out.reshape(*lead, H, H)
