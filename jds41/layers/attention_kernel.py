"""Attention of one token over its keys (attention.attend) as two Pallas (Triton) launches on the GPU, split over
the keys as flash-decoding does (opt-in with JDS41_ATTN_KERNEL=1: it has not yet run on a GPU).

Why (results/profile_decode_optins_v41_4L_h200.jsonl, `one_token`): XLA:GPU runs `attend` for one token as seven
kernels a layer (the scores' product, the mask, the maximum, the exponentials' sum, the division, the weighted
sum, a reduction after it), 17.7 us, for V4.1's ~40 M multiply-adds (64 heads, 512-wide latents, ~640 keys),
which the H200 does in about a microsecond. One program per head block would be too few programs for that work,
so the keys are cut into chunks of BN:
- `_partials` (grid: head blocks x key chunks): a chunk's scores s = q.k * scale (masked keys -inf), their maximum
  m, p = exp(s - m), l = sum p and acc = p @ keys, per head;
- `_combine` (grid: blocks of CH heads x blocks of BK latent columns): top = max(max_c m_c, sink), w_c = exp(m_c - top),
  out = sum_c w_c acc_c / (sum_c w_c l_c + exp(sink - top)).
That is `attend`'s softmax with the sink in the denominator only, reassociated: it agrees with the XLA spelling to
f32 rounding, not bitwise (as the Sinkhorn kernel does), and on CUDA every path's attention is this kernel when it
is on, so decode, verification and prefill rows stay exact against each other (a row's programs do not depend on
the rows around it: a vmapped call adds a grid axis). Products are f32 (`precision=HIGHEST`: Triton's "ieee"
dot, as XLA's HIGHEST is f32, never TF32). Elsewhere `default` (the XLA spelling, the reference) runs;
JDS41_TRITON=interpret runs the kernels in Pallas' interpreter on every platform (tests/test_attention_kernel.py).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

# JDS41_ATTN_KERNEL=1 (read at import) runs attention through these kernels on CUDA; off by default until the
# compiled kernels have passed their GPU test and been timed (experiments/device_next.sh round)
ENABLED = os.environ.get("JDS41_ATTN_KERNEL", "0") == "1"
BH = 16  # heads a program: Triton's dot needs 16 rows (fewer heads are padded)
BN = 32  # keys a chunk
BK = 128  # latent columns a step of the products (bounds the registers a chunk's keys take)
CH = 4  # heads a program of the combination (no product there: more, smaller programs read the partials faster)
HIGHEST = lax.Precision.HIGHEST


def _steps(kdim: int) -> list[jax.Array]:
    """The latent columns of each product step, [BK'] each."""
    bk = min(BK, kdim)
    return [k0 + jnp.arange(bk, dtype=jnp.int32) for k0 in range(0, kdim, bk)]


def _dot(a: jax.Array, b: jax.Array, b_axis: int) -> jax.Array:
    """a [M, X] times b contracted over its axis `b_axis` (X), in f32 ("ieee" in Triton: never TF32)."""
    return lax.dot_general(a, b, (((1,), (b_axis,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def _partials(q_ref, k_ref, valid_ref, m_ref, l_ref, acc_ref, *, heads: int, n: int, kdim: int, scale: float):
    hb, c = pl.program_id(0), pl.program_id(1)
    h_at = hb * BH + jnp.arange(BH, dtype=jnp.int32)
    q_rows = jnp.minimum(h_at, heads - 1)  # padding heads read the last head; their results are dropped
    n_at = c * BN + jnp.arange(BN, dtype=jnp.int32)
    k_rows = jnp.minimum(n_at, n - 1)  # keys past the end read the last key and are masked
    s = jnp.zeros((BH, BN), jnp.float32)
    for cols in _steps(kdim):
        qb = q_ref[q_rows[:, None], cols[None, :]]
        kb = k_ref[k_rows[:, None], cols[None, :]]
        s = s + _dot(qb, kb, 1)
    live_key = (n_at < n) & (valid_ref[k_rows] != 0)
    s = jnp.where(live_key[None, :], s * np.float32(scale), -jnp.inf)
    m = jnp.max(s, axis=1)
    any_key = m > -jnp.inf
    p = jnp.where(any_key[:, None], jnp.exp(s - jnp.where(any_key, m, 0)[:, None]), 0)
    m_ref[c, h_at] = m
    l_ref[c, h_at] = jnp.sum(p, axis=1)
    for cols in _steps(kdim):
        kb = k_ref[k_rows[:, None], cols[None, :]]
        acc_ref[c, h_at[:, None], cols[None, :]] = _dot(p, kb, 0)


def _combine(m_ref, l_ref, acc_ref, sink_ref, o_ref, *, heads: int, chunks: int, bk: int):
    hb, j = pl.program_id(0), pl.program_id(1)
    h_at = hb * CH + jnp.arange(CH, dtype=jnp.int32)
    cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
    sink = sink_ref[jnp.minimum(h_at, heads - 1)]
    top = lax.fori_loop(0, chunks, lambda c, t: jnp.maximum(t, m_ref[c, h_at]), sink)

    def weight(c):  # a chunk's share, exp(m_c - top); 0 for a chunk whose keys are all masked
        m = m_ref[c, h_at]
        return jnp.where(m > -jnp.inf, jnp.exp(m - top), 0)

    denom = lax.fori_loop(0, chunks, lambda c, d: d + weight(c) * l_ref[c, h_at], jnp.exp(sink - top))
    o = lax.fori_loop(0, chunks, lambda c, o: o + weight(c)[:, None] * acc_ref[c, h_at[:, None], cols[None, :]],
                      jnp.zeros((CH, bk), jnp.float32))
    o_ref[h_at[:, None], cols[None, :]] = o / denom[:, None]


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def attend_kernels(q_HK: jax.Array, keys_NK: jax.Array, valid_N: jax.Array, sink_H: jax.Array, scale: float,
                   interpret: bool = False) -> jax.Array:
    """`attend` of one query block [H, K] over keys [N, K] (valid [N]) with sinks [H] -> [H, K] f32, by the two
    kernels; `interpret` runs them in Pallas' interpreter (any platform)."""
    heads, kdim = q_HK.shape
    n = keys_NK.shape[0]
    hp = -(-heads // BH) * BH
    chunks = -(-n // BN)
    params = None
    args = (jnp.asarray(q_HK, jnp.float32), jnp.asarray(keys_NK, jnp.float32), jnp.asarray(valid_N, jnp.int32))
    if interpret:  # interpreted, the kernels are XLA:CPU code inlined into their caller: keep their rounding
        args = lax.optimization_barrier(args)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    m, sums, acc = pl.pallas_call(
        functools.partial(_partials, heads=heads, n=n, kdim=kdim, scale=float(scale)),
        out_shape=(jax.ShapeDtypeStruct((chunks, hp), jnp.float32), jax.ShapeDtypeStruct((chunks, hp), jnp.float32),
                   jax.ShapeDtypeStruct((chunks, hp, kdim), jnp.float32)),
        grid=(hp // BH, chunks), compiler_params=params, interpret=interpret, name="attend_partials",
    )(*args)
    bk = min(BK, kdim)
    out = pl.pallas_call(
        functools.partial(_combine, heads=heads, chunks=chunks, bk=bk),
        out_shape=jax.ShapeDtypeStruct((hp, kdim), jnp.float32),
        grid=(hp // CH, kdim // bk), compiler_params=params, interpret=interpret, name="attend_combine",
    )(m, sums, acc, jnp.asarray(sink_H, jnp.float32))
    out = out[:heads]
    return lax.optimization_barrier(out) if interpret else out


def applies(kdim: int) -> bool:
    """Whether `attend` can run the kernels: switched on, Pallas' Triton backend (or the interpreter), and a latent
    width Triton's blocks take (a power of two of at least 16)."""
    return ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET) \
        and kdim >= 16 and kdim & (kdim - 1) == 0


def attend(q_HK: jax.Array, keys_NK: jax.Array, valid_N: jax.Array, sink_H: jax.Array, scale: float, default):
    """[H, K] attention output: the kernels on CUDA (or interpreted), `default(q, keys, valid)` elsewhere."""
    def kernel(q, keys, valid, interpret=False):
        return attend_kernels(q, keys, valid, sink_H, scale, interpret=interpret)

    if triton_matvec.INTERPRET:
        return kernel(q_HK, keys_NK, valid_N, interpret=True)
    return lax.platform_dependent(q_HK, keys_NK, valid_N, cuda=kernel, default=default)
