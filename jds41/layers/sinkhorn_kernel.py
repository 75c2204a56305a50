"""mHC's Sinkhorn normalisation (layers/mhc.py `_sinkhorn`) as one Pallas (Triton) kernel per call on the GPU.

Why (experiments/README.md, "Where a decode token's time goes"): the comb matrix is 4 x 4, and its 20 rounds of
row and column normalisation are a chain in which every round reads every value of the round before. As the
reference's `fori_loop`, XLA:GPU ran every round as a host-launched loop iteration; unrolled, it cannot fuse such a
chain without recomputing it exponentially, so it cut it into about 20 kernels of ~1.3 us per sublayer: on the
V4-Flash 8-layer shape, 370 of the 857 kernels of a decode step. Here one program takes one row's 16 logits
into registers and runs the whole normalisation in scalar code, in the order `_sinkhorn` writes it (maxima and sums
left to right), so a sublayer's comb is one launch.

A second form (`_kernel_lanes`, JDS41_SINKHORN_FORM=lanes, opt-in until timed) holds the 16 values as one [4, 4]
tile, a lane each, so a round's sums are short reductions across lanes instead of one thread's serial chain.

`sinkhorn(logits_SD, hc_eps, iters)` takes logits [..., H, H] (any leading axes: decode's one row, a block's rows,
a vmapped batch); on CUDA it runs the kernel (one program per row: each row's arithmetic is the same whatever the
rows around it), elsewhere `default` (mhc's XLA spelling, the reference). The kernel's exp and division are
Triton's, so it agrees with the XLA spelling to f32 rounding, not bitwise; every comb on CUDA is this kernel, so
decode, verification and prefill rows stay exact against each other there. JDS41_TRITON=0 turns it off, and
JDS41_TRITON=interpret runs it on every platform in Pallas' interpreter (tests/test_sinkhorn_kernel.py).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

H = 4  # hyper-connection copies: the only count the validated configs allow


def _kernel(l_ref, o_ref, *, eps: float, iters: int):
    i = pl.program_id(0)
    eps, one = jnp.float32(eps), jnp.float32(1)
    lg = [[l_ref[i, s * H + d] for d in range(H)] for s in range(H)]  # [src][dst] scalars
    c = []
    for s in range(H):
        m = lg[s][0]
        for d in range(1, H):
            m = jnp.maximum(m, lg[s][d])
        e = [jnp.exp(lg[s][d] - m) for d in range(H)]
        total = e[0]
        for d in range(1, H):
            total = total + e[d]
        inv = one / total
        c.append([e[d] * inv + eps for d in range(H)])  # softmax over dst, + hc_eps

    # Each normalisation multiplies by the sum's reciprocal: 4 divisions a round instead of 16 (the divisions, a
    # ~10-instruction sequence each in one thread, bounded the kernel: 5.1 us a call on the H200)
    def cols(c):
        inv = []
        for d in range(H):
            total = c[0][d]
            for s in range(1, H):
                total = total + c[s][d]
            inv.append(one / (total + eps))
        return [[c[s][d] * inv[d] for d in range(H)] for s in range(H)]

    def rows(c):
        inv = []
        for s in range(H):
            total = c[s][0]
            for d in range(1, H):
                total = total + c[s][d]
            inv.append(one / (total + eps))
        return [[c[s][d] * inv[s] for d in range(H)] for s in range(H)]

    c = cols(c)
    for _ in range(iters - 1):
        c = cols(rows(c))
    for s in range(H):
        for d in range(H):
            o_ref[i, s * H + d] = c[s][d]


def _kernel_lanes(l_ref, o_ref, *, eps: float, iters: int):
    """`_kernel`'s normalisation with the 16 values as one [4, 4] tile, one lane each, instead of one thread's
    scalars: a round's four row (or column) sums are reductions across lanes rather than a serial chain of 12 adds,
    so the chain a program waits on is ~4x shorter. The sums' order is the reduction's, not left to right, so its
    bits differ from the scalar form's (both agree with mhc's XLA spelling to f32 rounding)."""
    i = pl.program_id(0)
    at = jnp.arange(H, dtype=jnp.int32)[:, None] * H + jnp.arange(H, dtype=jnp.int32)[None, :]  # [src, dst]
    eps, one = jnp.float32(eps), jnp.float32(1)
    lg = l_ref[i, at]
    e = jnp.exp(lg - jnp.max(lg, axis=1, keepdims=True))
    c = e * (one / jnp.sum(e, axis=1, keepdims=True)) + eps  # softmax over dst, + hc_eps
    cols = lambda c: c * (one / (jnp.sum(c, axis=0, keepdims=True) + eps))  # noqa: E731
    rows = lambda c: c * (one / (jnp.sum(c, axis=1, keepdims=True) + eps))  # noqa: E731
    c = cols(c)
    for _ in range(iters - 1):
        c = cols(rows(c))
    o_ref[i, at] = c


# JDS41_SINKHORN_FORM (read at import): "scalar" (`_kernel`, timed: 4.2 us a call on the H200) or "lanes"
# (`_kernel_lanes`, not yet timed: experiments/device_next.sh)
FORM = os.environ.get("JDS41_SINKHORN_FORM", "scalar")
_KERNELS = {"scalar": _kernel, "lanes": _kernel_lanes}


@functools.partial(jax.jit, static_argnames=("eps", "iters", "interpret", "form"))
def sinkhorn_rows(logits_N16: jax.Array, eps: float, iters: int, interpret: bool = False,
                  form: str | None = None) -> jax.Array:
    """The kernel over N rows of 16 logits (src-major) -> the N combs, [N, 16] f32; `form` (default FORM) picks
    the kernel."""
    n = logits_N16.shape[0]
    kernel = _KERNELS[form or FORM]
    params = None
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        logits_N16 = lax.optimization_barrier(logits_N16)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=1, num_stages=1)
    out = pl.pallas_call(
        functools.partial(kernel, eps=float(eps), iters=int(iters)),
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
