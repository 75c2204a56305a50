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
the rows around it: a vmapped call adds a grid axis). Products are f32 (Triton's "ieee" dot, as XLA's HIGHEST is
f32, never TF32) unless JDS41_ATTN_DOT=tf32x3 (`DOTS`). Elsewhere `default` (the XLA spelling, the reference) runs;
JDS41_TRITON=interpret runs the kernels in Pallas' interpreter on every platform (tests/test_attention_kernel.py).

The query comes as W_qb gives it and the output leaves as W_oa takes it: compiled, the kernels also do what XLA ran
as kernels of their own around them (RoPE of q, of the output, V4's head norm; ~5 us a V4.1 layer). `_partials`
turns q's RoPE columns (the last 2 len(freqs)) as it loads them, and V4's per-head RMS norm (no weight) becomes a
factor on each head's scores (the rotation and the dot are linear in q); `_combine` turns the output's RoPE columns
back, in the column blocks that hold them. In Pallas' interpreter XLA does those steps around the kernels, as
`attend_xla` does (`turn_inside` runs them inside, for the value tests): interpreted, the kernels are XLA:CPU code,
which computed a cos + b sin with an FMA for some elements of a one-row program and without one in the vmapped
program (differences of one f32 ulp, with optimization barriers around the products too; cos, sin and the products
alone were equal), and the engine's CPU tests need a row to equal itself in a block. Compiled, the contraction is a
property of the kernel's code, the same for every row; the GPU test checks a row against a vmapped block.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jds41.layers.norm import rms_norm
from jds41.layers.rope import apply_rope
from jds41.quant import triton_matvec

# JDS41_ATTN_KERNEL=1 (read at import) runs attention through these kernels on CUDA; off by default until the
# compiled kernels have passed their GPU test and been timed (experiments/device_next.sh round)
ENABLED = os.environ.get("JDS41_ATTN_KERNEL", "0") == "1"
BH = 16  # heads a program: Triton's dot needs 16 rows (fewer heads are padded)
BN = 32  # keys a chunk
BK = 128  # latent columns a step of the products (bounds the registers a chunk's keys take)
CH = 4  # heads a program of the combination (no product there: more, smaller programs read the partials faster)
WARPS = 4


def parse_tile(text: str) -> tuple[int, int, int, int, int]:
    """A tile spelled BH:BN:BK:CH:warps (JDS41_ATTN_TILE): five positive integers (`attend_kernels` refuses, by
    name, a tile whose parts do not fit the shape)."""
    parts = text.split(":")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"attention tile {text!r}: want BH:BN:BK:CH:warps, five positive integers")
    return tuple(int(p) for p in parts)


# (BH, BN, BK, CH, warps): the tile every path's attention takes; JDS41_ATTN_TILE (read at import) sets another, for
# A/B runs; `attend_kernels(tile=...)` takes others (experiments/bench_attention.py). Narrower latent steps (BK 16
# and 32, against register spills in Triton's f32 dots) were slower on an H100 (results/bench_attention38_h100.jsonl)
TILE = parse_tile(os.environ["JDS41_ATTN_TILE"]) if os.environ.get("JDS41_ATTN_TILE") else (BH, BN, BK, CH, WARPS)

# How the partials' products run. "ieee": f32 on the CUDA cores (XLA's HIGHEST is f32, never TF32). An H100's ncu
# of that form (results/ncu_attention39_h100.txt: 20 programs of 128 threads, 32 registers, 6% occupancy, 130 us)
# shows a few warps stepping FMA loops: latency, not bandwidth nor spills. "tf32x3": the tensor cores, each f32
# operand split into a TF32 head and a TF32 remainder, three products summed (near-f32 rounding, not bit-equal to
# "ieee"). JDS41_ATTN_DOT (read at import) picks it, for A/B runs: on an H100 it ran 8x faster than "ieee", level
# with XLA alone, and gave no decode gain (results/bench_decode_attn_dot39_v41_4L_h100.jsonl). XLA:CPU has no such
# dot algorithm, so Pallas' interpreter computes "ieee" whatever is asked (the GPU test checks "tf32x3").
DOTS = {"ieee": lax.Precision.HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def parse_dot(text: str) -> str:
    if text not in DOTS:
        raise ValueError(f"attention dot {text!r}: want one of {', '.join(DOTS)}")
    return text


DOT = parse_dot(os.environ.get("JDS41_ATTN_DOT", "ieee"))


def _steps(kdim: int, bk: int) -> list[tuple[int, jax.Array]]:
    """(last column, the columns [bk]) of each product step."""
    return [(k0 + bk - 1, k0 + jnp.arange(bk, dtype=jnp.int32)) for k0 in range(0, kdim, bk)]


def _dot(a: jax.Array, b: jax.Array, b_axis: int, dot: str) -> jax.Array:
    """a [M, X] times b contracted over its axis `b_axis` (X), f32 out, as `dot` (a key of DOTS) computes it."""
    return lax.dot_general(a, b, (((1,), (b_axis,)), ((), ())), precision=DOTS[dot],
                           preferred_element_type=jnp.float32)


def _turn(vals, partner, cols, pos_ref, freqs_ref, *, kdim: int, inverse: bool):
    """vals [R, C] at columns `cols` with those among the last 2 len(freqs) turned as apply_rope turns them: pair
    k = (2k, 2k + 1) of those columns by the angle pos * freqs[k] (one f32 product), backwards when `inverse`;
    `partner` holds each column's pair partner (column ^ 1)."""
    first = kdim - 2 * freqs_ref.shape[0]  # the first RoPE column (even: kdim is a power of two)
    angle = pos_ref[0].astype(jnp.float32) * freqs_ref[jnp.maximum(cols - first, 0) // 2]
    sin = jnp.sin(angle)
    # (a, b) -> (a cos - b sin, a sin + b cos): the partner's sine is minus for an even column, plus for an odd one
    signed = jnp.where(((cols & 1) == 1) != inverse, sin, -sin)
    return jnp.where((cols >= first)[None, :], vals * jnp.cos(angle)[None, :] + partner * signed[None, :], vals)


def _partials(q_ref, k_ref, valid_ref, pos_ref, freqs_ref, m_ref, l_ref, acc_ref, *, heads: int, n: int, kdim: int,
              scale: float, norm_eps: float | None, turn: bool, bh: int, bn: int, bk: int, dot: str):
    hb, c = pl.program_id(0), pl.program_id(1)
    h_at = hb * bh + jnp.arange(bh, dtype=jnp.int32)
    q_rows = jnp.minimum(h_at, heads - 1)  # padding heads read the last head; their results are dropped
    n_at = c * bn + jnp.arange(bn, dtype=jnp.int32)
    k_rows = jnp.minimum(n_at, n - 1)  # keys past the end read the last key and are masked
    first_rope = kdim - 2 * freqs_ref.shape[0]
    s = jnp.zeros((bh, bn), jnp.float32)
    squares = jnp.zeros((bh,), jnp.float32)
    for last, cols in _steps(kdim, bk):
        raw = q_ref[q_rows[:, None], cols[None, :]]
        qb = raw
        if turn and last >= first_rope:  # a step with RoPE columns
            qb = _turn(raw, q_ref[q_rows[:, None], (cols ^ 1)[None, :]], cols, pos_ref, freqs_ref, kdim=kdim,
                       inverse=False)
        if turn and norm_eps is not None:  # the head's sum of squares, of q unturned as rms_norm takes it
            squares = squares + jnp.sum(raw * raw, axis=1)
        kb = k_ref[k_rows[:, None], cols[None, :]]
        s = s + _dot(qb, kb, 1, dot)
    if turn and norm_eps is not None:  # rms_norm(q) times each head's scores: a factor a head
        s = s * lax.rsqrt(squares / np.float32(kdim) + np.float32(norm_eps))[:, None]
    live_key = (n_at < n) & (valid_ref[k_rows] != 0)
    s = jnp.where(live_key[None, :], s * np.float32(scale), -jnp.inf)
    m = jnp.max(s, axis=1)
    any_key = m > -jnp.inf
    p = jnp.where(any_key[:, None], jnp.exp(s - jnp.where(any_key, m, 0)[:, None]), 0)
    m_ref[c, h_at] = m
    l_ref[c, h_at] = jnp.sum(p, axis=1)
    for _, cols in _steps(kdim, bk):
        kb = k_ref[k_rows[:, None], cols[None, :]]
        acc_ref[c, h_at[:, None], cols[None, :]] = _dot(p, kb, 0, dot)


def _combine(m_ref, l_ref, acc_ref, sink_ref, pos_ref, freqs_ref, o_ref, *, heads: int, chunks: int, bk: int,
             kdim: int, turn: bool, ch: int):
    hb, j = pl.program_id(0), pl.program_id(1)
    h_at = hb * ch + jnp.arange(ch, dtype=jnp.int32)
    cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
    sink = sink_ref[jnp.minimum(h_at, heads - 1)]
    top = lax.fori_loop(0, chunks, lambda c, t: jnp.maximum(t, m_ref[c, h_at]), sink)

    def weight(c):  # a chunk's share, exp(m_c - top); 0 for a chunk whose keys are all masked
        m = m_ref[c, h_at]
        return jnp.where(m > -jnp.inf, jnp.exp(m - top), 0)

    def weighted(at):  # sum over the chunks of their shares times their weighted sums, at columns `at`
        return lax.fori_loop(0, chunks, lambda c, o: o + weight(c)[:, None] * acc_ref[c, h_at[:, None], at[None, :]],
                             jnp.zeros((ch, bk), jnp.float32))

    denom = lax.fori_loop(0, chunks, lambda c, d: d + weight(c) * l_ref[c, h_at], jnp.exp(sink - top))
    o = weighted(cols)
    # the first column block that holds RoPE columns (none turned here when not `turn`)
    first_block = (kdim - 2 * freqs_ref.shape[0]) // bk if turn else kdim // bk

    @pl.when(j < first_block)
    def _():
        o_ref[h_at[:, None], cols[None, :]] = o / denom[:, None]

    @pl.when(j >= first_block)
    def _():
        turned = _turn(o, weighted(cols ^ 1), cols, pos_ref, freqs_ref, kdim=kdim, inverse=True)
        o_ref[h_at[:, None], cols[None, :]] = turned / denom[:, None]


@functools.partial(jax.jit, static_argnames=("scale", "norm_eps", "interpret", "turn_inside", "tile", "dot"))
def attend_kernels(q_HK: jax.Array, keys_NK: jax.Array, valid_N: jax.Array, sink_H: jax.Array, pos: jax.Array,
                   freqs: jax.Array, scale: float, norm_eps: float | None = None, interpret: bool = False,
                   turn_inside: bool | None = None, tile: tuple[int, int, int, int, int] = TILE,
                   dot: str = DOT) -> jax.Array:
    """`attention.attend_xla` by the two kernels: q [H, K] as W_qb gives it (RMS-normalised a head first where
    `norm_eps` is given, V4), turned by RoPE at `pos` (int32 scalar) with `freqs` [R/2]; keys [N, K], valid [N],
    sinks [H] -> the output [H, K] f32 turned back; `interpret` runs them in Pallas' interpreter (any platform).
    `turn_inside` (default: compiled, not interpreted) has the kernels normalise and turn q and turn the output
    back; otherwise XLA does, as `attend_xla` (see the module docstring for why the interpreter does not). `tile`:
    (heads, keys, latent columns) a program of the partials, heads a program of the combination, warps (powers of
    two; Triton's dot wants at least 16 heads); `dot`: how the products run (DOTS; interpreted, always "ieee")."""
    heads, kdim = q_HK.shape
    dot = "ieee" if interpret else parse_dot(dot)
    n = keys_NK.shape[0]
    bh, bn, bk, ch, warps = tile
    bk = min(bk, kdim)
    hp = -(-heads // bh) * bh
    if hp % ch:
        raise ValueError(f"attend_kernels: {ch} heads a combining program do not divide {hp} padded heads")
    chunks = -(-n // bn)
    if not 0 < 2 * freqs.shape[0] <= kdim:
        raise ValueError(f"attend_kernels: {2 * freqs.shape[0]} RoPE columns of a {kdim}-wide latent")
    turn = not interpret if turn_inside is None else turn_inside
    q_HK = jnp.asarray(q_HK, jnp.float32)
    if not turn:
        q_HK = apply_rope(q_HK if norm_eps is None else rms_norm(q_HK, None, norm_eps), pos, freqs)
    params = None
    args = (q_HK, jnp.asarray(keys_NK, jnp.float32), jnp.asarray(valid_N, jnp.int32),
            jnp.reshape(jnp.asarray(pos, jnp.int32), (1,)), jnp.asarray(freqs, jnp.float32))
    if interpret:  # interpreted, the kernels are XLA:CPU code inlined into their caller: keep their rounding
        args = lax.optimization_barrier(args)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=warps, num_stages=1)
    m, sums, acc = pl.pallas_call(
        functools.partial(_partials, heads=heads, n=n, kdim=kdim, scale=float(scale), norm_eps=norm_eps, turn=turn,
                          bh=bh, bn=bn, bk=bk, dot=dot),
        out_shape=(jax.ShapeDtypeStruct((chunks, hp), jnp.float32), jax.ShapeDtypeStruct((chunks, hp), jnp.float32),
                   jax.ShapeDtypeStruct((chunks, hp, kdim), jnp.float32)),
        grid=(hp // bh, chunks), compiler_params=params, interpret=interpret, name="attend_partials",
    )(*args)
    out = pl.pallas_call(
        functools.partial(_combine, heads=heads, chunks=chunks, bk=bk, kdim=kdim, turn=turn, ch=ch),
        out_shape=jax.ShapeDtypeStruct((hp, kdim), jnp.float32),
        grid=(hp // ch, kdim // bk), compiler_params=params, interpret=interpret, name="attend_combine",
    )(m, sums, acc, jnp.asarray(sink_H, jnp.float32), args[3], args[4])
    out = out[:heads]
    if interpret:
        out = lax.optimization_barrier(out)
    return out if turn else apply_rope(out, pos, freqs, inverse=True)


def applies(kdim: int) -> bool:
    """Whether `attend` can run the kernels: switched on, Pallas' Triton backend (or the interpreter), and a latent
    width Triton's blocks take (a power of two of at least 16)."""
    return ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET) \
        and kdim >= 16 and kdim & (kdim - 1) == 0


def attend(q_HK: jax.Array, keys_NK: jax.Array, valid_N: jax.Array, sink_H: jax.Array, pos: jax.Array,
           freqs: jax.Array, scale: float, norm_eps: float | None, default):
    """`attend_kernels` on CUDA (or interpreted), `default(q, keys, valid, pos)` elsewhere."""
    def kernel(q, keys, valid, p, interpret=False):
        return attend_kernels(q, keys, valid, sink_H, p, freqs, scale, norm_eps, interpret=interpret)

    if triton_matvec.INTERPRET:
        return kernel(q_HK, keys_NK, valid_N, pos, interpret=True)
    return lax.platform_dependent(q_HK, keys_NK, valid_N, pos, cuda=kernel, default=default)
