"""A sublayer's input from the mHC stream in two Pallas (Triton) kernels on the GPU: mix, split, Sinkhorn, collapse
and the sublayer's RMS norm (layers/mhc.py's `hc_mix`, `hc_split`, `hc_collapse`, then norm.py's `rms_norm`).

Why (experiments/README.md, "Where a decode token's time goes", one_token in
results/profile_decode_seq24_v41_4L_h200.jsonl): XLA:GPU ran that chain as ten kernels per sublayer on the V4.1
shape (two reductions for the stream's RMS, two for the mix, two for the split, the Sinkhorn kernel, the collapse,
two for the norm), 18.7 us of a layer's ~295 us twice a layer, each kernel ~1-2 us of mostly launch and tail; the
bytes are ~1 MB of f16 `fn` and the 80 KB stream.

- `_dots`: grid (rows, 25). Program m < 24 takes fn[m] . x over the flattened stream x [H*D] (f16 fn read as
  is), program 24 takes x . x; each sums its products elementwise over chunks of at most 1024 values and reduces
  once. (A first form split the stream over 32 programs, each reducing every step's [8, 128] products across its
  warps and a second kernel adding the partials: 8.3 + 12.3 us a sublayer against XLA's 18.7, decode -3%,
  results/profile_decode_mhc24a_v41_4L_h200.jsonl.)
- `_finish`: grid (rows,). With V4.1's lag the collapse takes the handed-over pre, so it runs first: the sum over
  copies in D-chunks kept in registers, its RMS (squares summed elementwise, one reduction), times the norm
  weight. Then mix = dots * rsqrt(x . x / (H*D) + eps); pre, post and the comb's logits as in `hc_split`; the comb
  by `sinkhorn_kernel.comb_scalars` with reciprocals (the divisions of the scalar rounds were most of the
  Sinkhorn kernel's 5.7 us); V4 collapses with this pre after.

Arithmetic: the reference normalises x before the dots (llama.cpp's order, mhc.py); here the dots of the raw
stream are scaled after (the same value, other rounding), and the sums run in the kernels' orders, so the kernels
agree with the XLA composition to f32 rounding, not bitwise (tests/test_mhc_kernel.py: interpreted on the CPU, and
compiled on the GPU). Every row's arithmetic is its own (one `_finish` program a row, `_dots`' programs by row)
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
CHUNK_MAX = 1024  # values a program holds per step: of the flattened stream in `_dots`, of the collapse in `_finish`
M = (2 + H) * H  # 24 mixes: pre, post, the comb's 16 logits


def takes(hc: int, n_mix: int, d: int) -> bool:
    """Whether the kernels take this shape: H = 4, 24 mixes, D a multiple of 32."""
    return hc == H and n_mix == M and d % 32 == 0


def applies(hc: int, n_mix: int, d: int) -> bool:
    """Whether a sublayer input of this shape runs the kernels (on CUDA, or everywhere when interpreted)."""
    return (ENABLED and takes(hc, n_mix, d) and triton_matvec.ENABLED
            and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET))


def _pow2_dividing(n: int, most: int) -> int:
    b = 1
    while b * 2 <= most and n % (b * 2) == 0:
        b *= 2
    return b


def _dots(x_ref, fn_ref, o_ref, *, k: int, chunk: int):
    """Program m < M: fn[m] . x over the flattened stream; program M: x . x. Products are summed elementwise over
    the chunks and reduced once (one cross-thread reduction a program)."""
    n, m = pl.program_id(0), pl.program_id(1)
    row = jnp.minimum(m, M - 1)
    acc = None
    for t in range(k // chunk):
        x = x_ref[n, pl.ds(t * chunk, chunk)]
        term = jnp.where(m < M, fn_ref[row, pl.ds(t * chunk, chunk)].astype(jnp.float32), x) * x
        acc = term if acc is None else acc + term
    o_ref[n, m] = jnp.sum(acc)


def _sigmoid(z):
    return jnp.float32(1) / (jnp.float32(1) + jnp.exp(-z))


def _collapse_norm(x_ref, w_ref, h_ref, n, p: list, *, d: int, chunk: int, eps):
    """h = RMS-normed sum_i p_i x_i (in copy order) times the norm weight, D in chunks held in registers."""
    ys, sq = [], None
    for q in range(d // chunk):
        y = None
        for i in range(H):
            term = p[i] * x_ref[n, pl.ds(i * d + q * chunk, chunk)]
            y = term if y is None else y + term
        ys.append(y)
        sq = y * y if sq is None else sq + y * y
    r = lax.rsqrt(jnp.sum(sq) / jnp.float32(d) + eps)
    for q, y in enumerate(ys):
        h_ref[n, pl.ds(q * chunk, chunk)] = y * r * w_ref[pl.ds(q * chunk, chunk)]


def _finish(dots_ref, x_ref, prev_ref, scale_ref, base_ref, w_ref, h_ref, pre_ref, post_ref, comb_ref, *, d: int,
            chunk: int, rms_eps: float, hc_eps: float, iters: int, lag: bool):
    n = pl.program_id(0)
    eps = jnp.float32(rms_eps)
    if lag:  # the collapse takes the handed-over pre: it need not wait for this sublayer's mixes
        _collapse_norm(x_ref, w_ref, h_ref, n, [prev_ref[n, i] for i in range(H)], d=d, chunk=chunk, eps=eps)
    r = lax.rsqrt(dots_ref[n, M] / jnp.float32(H * d) + eps)
    mix = [dots_ref[n, j] * r for j in range(M)]
    s_pre, s_post, s_comb = scale_ref[0], scale_ref[1], scale_ref[2]
    pre = [_sigmoid(mix[i] * s_pre + base_ref[i]) + jnp.float32(hc_eps) for i in range(H)]
    post = [jnp.float32(2) * _sigmoid(mix[H + i] * s_post + base_ref[H + i]) for i in range(H)]
    at = [[2 * H + s * H + j for j in range(H)] for s in range(H)]
    comb = comb_scalars([[mix[a] * s_comb + base_ref[a] for a in row] for row in at], hc_eps, iters,
                        reciprocal=True)
    for i in range(H):
        pre_ref[n, i] = pre[i]
        post_ref[n, i] = post[i]
        for j in range(H):
            comb_ref[n, i * H + j] = comb[i][j]
    if not lag:
        _collapse_norm(x_ref, w_ref, h_ref, n, pre, d=d, chunk=chunk, eps=eps)


@functools.partial(jax.jit, static_argnames=("rms_eps", "hc_eps", "iters", "lag", "interpret"))
def sublayer_input_rows(x_NHD, fn_MK, scale_3, base_M, prev_NH, norm_D, *, rms_eps: float, hc_eps: float,
                        iters: int, lag: bool, interpret: bool = False):
    """N rows of the stream x [N, H, D] -> (h [N, D] the sublayer's normed input, pre [N, H], post [N, H],
    comb [N, H, H]); `prev_NH` is the collapse's handed-over pre when `lag` (V4.1), unused otherwise (V4)."""
    N, hc, d = x_NHD.shape
    if not takes(hc, fn_MK.shape[0], d):
        raise ValueError(f"mhc_kernel takes H = {H}, {M} mixes and D a multiple of 32; got {x_NHD.shape}")
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
    dots = pl.pallas_call(
        functools.partial(_dots, k=hc * d, chunk=_pow2_dividing(hc * d, CHUNK_MAX)), grid=(N, M + 1),
        out_shape=sds((N, M + 1), f32), compiler_params=params, interpret=interpret, name="mhc_mix_dots")(x, fn)
    out = pl.pallas_call(
        functools.partial(_finish, d=d, chunk=_pow2_dividing(d, CHUNK_MAX), rms_eps=float(rms_eps),
                          hc_eps=float(hc_eps), iters=int(iters), lag=bool(lag)),
        grid=(N,), out_shape=(sds((N, d), f32), sds((N, H), f32), sds((N, H), f32), sds((N, H * H), f32)),
        compiler_params=params, interpret=interpret, name="mhc_sublayer_input",
    )(dots, x, prev, scale, base, norm)
    if interpret:
        out = lax.optimization_barrier(out)
    h, pre, post, comb = out
    return h, pre, post, comb.reshape(N, H, H)
