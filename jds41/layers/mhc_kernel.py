"""A sublayer's input from the mHC stream in two Pallas (Triton) kernels on the GPU: mix, split, Sinkhorn, collapse
and the sublayer's RMS norm (layers/mhc.py's `hc_mix`, `hc_split`, `hc_collapse`, then norm.py's `rms_norm`).

Why (experiments/README.md, "Where a decode token's time goes", one_token in
results/profile_decode_seq24_v41_4L_h200.jsonl): XLA:GPU ran that chain as ten kernels per sublayer on the V4.1
shape (two reductions for the stream's RMS, two for the mix, two for the split, the Sinkhorn kernel, the collapse,
two for the norm), 18.7 us of a layer's ~295 us twice a layer, each kernel ~1-2 us of mostly launch and tail; the
bytes are ~1 MB of f16 `fn` and the 80 KB stream.

- `_partials`: grid (rows, C). Program c takes C-th of the flattened stream x [H*D] in steps of TILE values: the
  sum of x^2 and the 24 dots fn[m, chunk] . x[chunk], as [8]-row groups (M = 24 = (2 + H) * H).
- `_finish`: grid (rows,). The C partial sums added (one reduction per shape), mix = dots * rsqrt(sum / (H*D) +
  eps); pre, post and the comb's logits as in `hc_split`, the comb by `sinkhorn_kernel.comb_scalars` (the same
  scalar code as the Sinkhorn kernel); the collapse with the handed-over pre (V4.1's lag) or this one's, in D-chunks
  of at most 1024 values kept in registers; its RMS; times the norm weight.

Arithmetic: the reference normalises x before the dots (llama.cpp's order, mhc.py); here the dots of the raw
stream are scaled after (the same value, other rounding), and the sums run in the kernels' orders, so the kernels
agree with the XLA composition to f32 rounding, not bitwise (tests/test_mhc_kernel.py: interpreted on the CPU, and
compiled on the GPU). Every row's arithmetic is its own (one `_finish` program a row, `_partials`' programs by row)
and every sublayer input on CUDA is these kernels (model.sublayer_input serves decode, prefill, the layer-major
group and verification alike), so decode stays exact against itself there. `JDS41_MHC_KERNEL=0` (read at import;
for A/B benchmarks) keeps the XLA composition; so does `JDS41_TRITON=0`; `JDS41_TRITON=interpret` runs these
kernels on every platform in Pallas' interpreter.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.layers.sinkhorn_kernel import H, comb_scalars
from jds41.quant import triton_matvec

ENABLED = os.environ.get("JDS41_MHC_KERNEL", "1") != "0"
INTERPRET = triton_matvec.INTERPRET
TILE = 128  # stream values a `_partials` step reads (with 8 rows of fn at a time: [8, 128] f16)
PROGRAMS_MAX = 64  # `_partials` programs per row at most (a power of two: `_finish` adds their sums as one tile)
D_CHUNK_MAX = 1024  # collapse values `_finish` holds per chunk
M = (2 + H) * H  # 24 mixes: pre, post, the comb's 16 logits


def takes(hc: int, n_mix: int, d: int) -> bool:
    """Whether the kernels take this shape: H = 4, 24 mixes, H*D a multiple of TILE."""
    return hc == H and n_mix == M and (hc * d) % TILE == 0


def applies(hc: int, n_mix: int, d: int) -> bool:
    """Whether a sublayer input of this shape runs the kernels (on CUDA, or everywhere when interpreted)."""
    return (ENABLED and takes(hc, n_mix, d) and triton_matvec.ENABLED
            and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET))


def _pow2_dividing(n: int, most: int) -> int:
    b = 1
    while b * 2 <= most and n % (b * 2) == 0:
        b *= 2
    return b


def _partials(x_ref, fn_ref, dots_ref, ss_ref, *, steps: int):
    n, c = pl.program_id(0), pl.program_id(1)
    dots, ss = [None] * (M // 8), None
    for t in range(steps):
        at = (c * steps + t) * TILE
        x = x_ref[n, pl.ds(at, TILE)]
        sq = jnp.sum(x * x)
        ss = sq if ss is None else ss + sq
        for g in range(M // 8):
            part = jnp.sum(fn_ref[pl.ds(8 * g, 8), pl.ds(at, TILE)].astype(jnp.float32) * x[None, :], axis=1)
            dots[g] = part if dots[g] is None else dots[g] + part
    for g in range(M // 8):
        dots_ref[n, c, pl.ds(8 * g, 8)] = dots[g]
    ss_ref[n, c] = ss


def _element(v, j: int):
    """Element j of an [8] vector as a scalar: a sum of it and seven zeros, exact."""
    return jnp.sum(jnp.where(jnp.arange(8, dtype=jnp.int32) == j, v, jnp.float32(0)))


def _sigmoid(z):
    return jnp.float32(1) / (jnp.float32(1) + jnp.exp(-z))


def _finish(dots_ref, ss_ref, x_ref, prev_ref, scale_ref, base_ref, w_ref, h_ref, pre_ref, post_ref, comb_ref, *,
            programs: int, d: int, d_chunk: int, rms_eps: float, hc_eps: float, iters: int, lag: bool):
    n = pl.program_id(0)
    eps, hc_eps32 = jnp.float32(rms_eps), jnp.float32(hc_eps)
    r = lax.rsqrt(jnp.sum(ss_ref[n, pl.ds(0, programs)]) / jnp.float32(H * d) + eps)
    mix = []
    for g in range(M // 8):
        v = jnp.sum(dots_ref[n, pl.ds(0, programs), pl.ds(8 * g, 8)], axis=0) * r
        mix += [_element(v, j) for j in range(8)]
    s_pre, s_post, s_comb = scale_ref[0], scale_ref[1], scale_ref[2]
    pre = [_sigmoid(mix[i] * s_pre + base_ref[i]) + hc_eps32 for i in range(H)]
    post = [jnp.float32(2) * _sigmoid(mix[H + i] * s_post + base_ref[H + i]) for i in range(H)]
    at = [[2 * H + s * H + j for j in range(H)] for s in range(H)]
    comb = comb_scalars([[mix[a] * s_comb + base_ref[a] for a in row] for row in at], hc_eps, iters)
    for i in range(H):
        pre_ref[n, i] = pre[i]
        post_ref[n, i] = post[i]
        for j in range(H):
            comb_ref[n, i * H + j] = comb[i][j]
    p = [prev_ref[n, i] for i in range(H)] if lag else pre
    ys, ss = [], None
    for q in range(d // d_chunk):
        y = None
        for i in range(H):
            term = p[i] * x_ref[n, pl.ds(i * d + q * d_chunk, d_chunk)]
            y = term if y is None else y + term
        ys.append(y)
        sq = jnp.sum(y * y)
        ss = sq if ss is None else ss + sq
    r_y = lax.rsqrt(ss / jnp.float32(d) + eps)
    for q, y in enumerate(ys):
        h_ref[n, pl.ds(q * d_chunk, d_chunk)] = y * r_y * w_ref[pl.ds(q * d_chunk, d_chunk)]


@functools.partial(jax.jit, static_argnames=("rms_eps", "hc_eps", "iters", "lag", "interpret"))
def sublayer_input_rows(x_NHD, fn_MK, scale_3, base_M, prev_NH, norm_D, *, rms_eps: float, hc_eps: float,
                        iters: int, lag: bool, interpret: bool = False):
    """N rows of the stream x [N, H, D] -> (h [N, D] the sublayer's normed input, pre [N, H], post [N, H],
    comb [N, H, H]); `prev_NH` is the collapse's handed-over pre when `lag` (V4.1), unused otherwise (V4)."""
    N, hc, d = x_NHD.shape
    if not takes(hc, fn_MK.shape[0], d):
        raise ValueError(f"mhc_kernel takes H = {H}, {M} mixes and H*D a multiple of {TILE}; got {x_NHD.shape}")
    blocks = hc * d // TILE
    programs = _pow2_dividing(blocks, PROGRAMS_MAX)
    d_chunk = _pow2_dividing(d, D_CHUNK_MAX)
    f32 = jnp.float32
    x = x_NHD.reshape(N, hc * d).astype(f32)
    inputs = (x, fn_MK, scale_3.astype(f32), base_M.astype(f32), prev_NH.astype(f32), norm_D.astype(f32))
    params = None
    if interpret:  # interpreted, a kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        inputs = lax.optimization_barrier(inputs)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    x, fn, scale, base, prev, norm = inputs
    sds = jax.ShapeDtypeStruct
    dots, ss = pl.pallas_call(
        functools.partial(_partials, steps=blocks // programs), grid=(N, programs),
        out_shape=(sds((N, programs, M), f32), sds((N, programs), f32)), compiler_params=params,
        interpret=interpret, name="mhc_mix_partials")(x, fn)
    out = pl.pallas_call(
        functools.partial(_finish, programs=programs, d=d, d_chunk=d_chunk, rms_eps=float(rms_eps),
                          hc_eps=float(hc_eps), iters=int(iters), lag=bool(lag)),
        grid=(N,), out_shape=(sds((N, d), f32), sds((N, H), f32), sds((N, H), f32), sds((N, H * H), f32)),
        compiler_params=params, interpret=interpret, name="mhc_sublayer_input",
    )(dots, ss, x, prev, scale, base, norm)
    if interpret:
        out = lax.optimization_barrier(out)
    h, pre, post, comb = out
    return h, pre, post, comb.reshape(N, H, H)
