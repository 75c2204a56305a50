"""Attention of one token over its keys (attention.attend) as one Pallas (Triton) launch on the GPU, each program
over every key with a running softmax (opt-in with JDS41_ATTN_KERNEL=1).

Why (results/profile_decode_ffn45b_v4_8L_h100.jsonl, `one_token`): XLA:GPU runs `attend` for one token, with the
head norm and RoPE around it, as ~9 kernels of 1-4 us a layer (~18 us on an H100: the head norm, q's RoPE, the
scores' product, the softmax, the weighted sum, the output's RoPE) for ~10-40 M multiply-adds (64 heads, 512-wide
latents, 136-640 keys). A first form (thirty-eighth and thirty-ninth sessions) split the keys over programs as
flash-decoding does, partials and then a combining launch: with its products on the tensor cores ("tf32x3") it
took as long as XLA's kernels, ~15 us a layer in its two launches, and gave no decode gain
(results/bench_decode_attn_dot39_v41_4L_h100.jsonl). Here one launch does it all, in programs of BH heads and BV
output columns (grid: head blocks x column blocks; V4's 64 heads at (16, 128): 16 programs), each over every key
in chunks of BN (keys are few and the programs read them from L2). The window's keys are read where they lie in
the ring (`ring`, `window`: the rows of positions pos - window + 1 .. pos, oldest first, each valid where its slot
holds that position, as attention.window_rows gives them, without XLA's gather), then the keys past them (the
compressed rows, gathered by the caller):
- the scores of a chunk, s = q.k * scale (masked keys -inf), the products BK latent columns a step;
- a running softmax whose maximum starts at the head's sink logit and whose denominator starts at its exp(0) = 1
  (the sink sits in the denominator only): top = max(m, max s), alpha = exp(m - top), p = exp(s - top),
  d = d alpha + sum p, acc = acc alpha + p @ keys[:, the program's columns];
- out = acc / d. A program whose columns hold RoPE columns also sums p @ keys at each column's pair partner, to
  turn its output back.
That is `attend`'s softmax reassociated: it agrees with the XLA spelling to f32 rounding, not bitwise (as the
Sinkhorn kernel does), and on CUDA every path's attention is this kernel when it is on, so decode, verification
and prefill rows stay exact against each other (a row's programs do not depend on the rows around it: a vmapped
call adds a grid axis). Products are f32 (Triton's "ieee" dot, as XLA's HIGHEST is f32, never TF32) unless
JDS41_ATTN_DOT=tf32x3 (`DOTS`). Elsewhere `default` (the XLA spelling, the reference) runs; JDS41_TRITON=interpret
runs the kernel in Pallas' interpreter on every platform (tests/test_attention_kernel.py).

The query comes as W_qb gives it and the output leaves as W_oa takes it: compiled, the kernel also does what XLA ran
as kernels of its own around it (RoPE of q, of the output, V4's head norm). It turns q's RoPE columns once, before
the keys, and V4's per-head RMS norm (no weight) becomes a factor on each head's scores (the rotation and the dot
are linear in q). In Pallas' interpreter XLA does those steps around the kernel, as `attend_xla` does
(`turn_inside` runs them inside, for the value tests): interpreted, the kernel is XLA:CPU code, which computed
a cos + b sin with an FMA for some elements of a one-row program and without one in the vmapped program
(differences of one f32 ulp, with optimization barriers around the products too; cos, sin and the products alone
were equal), and the engine's CPU tests need a row to equal itself in a block. Compiled, the contraction is a
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

# JDS41_ATTN_KERNEL=1 (read at import) runs attention through the kernel on CUDA; off by default: on an H100 its
# GPU tests passed but alone it took 3-4x XLA's time and V4-Flash's 8-layer decode ran 474.3 against 591.9 tok/s
# (results/bench_attention_one46_h100.jsonl, bench_decode_attn_one46_v4_8L_h100.jsonl): each program's serial
# loop over the key chunks, in a grid of 16-32 programs, is latency
ENABLED = os.environ.get("JDS41_ATTN_KERNEL", "0") == "1"
BH = 16  # heads a program: Triton's dot needs 16 rows (fewer heads are padded)
BN = 32  # keys a chunk
BK = 128  # latent columns a step of the scores (bounds the registers a chunk's keys take)
BV = 128  # output columns a program (the scores are computed again by each of a head block's kdim / BV programs)
WARPS = 4


def parse_tile(text: str) -> tuple[int, int, int, int, int]:
    """A tile spelled BH:BN:BK:BV:warps (JDS41_ATTN_TILE): five positive integers (`attend_kernels` refuses, by
    name, a tile whose parts do not fit the shape)."""
    parts = text.split(":")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"attention tile {text!r}: want BH:BN:BK:BV:warps, five positive integers")
    return tuple(int(p) for p in parts)


# (BH, BN, BK, BV, warps): the tile every path's attention takes; JDS41_ATTN_TILE (read at import) sets another, for
# A/B runs; `attend_kernels(tile=...)` takes others (experiments/bench_attention.py). In the two-launch form
# narrower latent steps (BK 16 and 32) were slower on an H100 (results/bench_attention38_h100.jsonl)
TILE = parse_tile(os.environ["JDS41_ATTN_TILE"]) if os.environ.get("JDS41_ATTN_TILE") else (BH, BN, BK, BV, WARPS)

# How the products run. "ieee": f32 on the CUDA cores (XLA's HIGHEST is f32, never TF32). An H100's ncu of that
# form in the two-launch kernels (results/ncu_attention39_h100.txt: 20 programs of 128 threads, 32 registers, 6%
# occupancy, 130 us) shows a few warps stepping FMA loops: latency, not bandwidth nor spills. "tf32x3": the tensor
# cores, each f32 operand split into a TF32 head and a TF32 remainder, three products summed (near-f32 rounding,
# not bit-equal to "ieee"). On an H100 it ran the two-launch kernels 8x faster than "ieee"
# (results/bench_attention39_h100.jsonl), so it is the kernel's default; JDS41_ATTN_DOT (read at import) picks the
# form, for A/B runs. XLA:CPU has no such dot algorithm, so Pallas' interpreter computes "ieee" whatever is asked
# (the GPU test checks both forms).
DOTS = {"ieee": lax.Precision.HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def parse_dot(text: str) -> str:
    if text not in DOTS:
        raise ValueError(f"attention dot {text!r}: want one of {', '.join(DOTS)}")
    return text


DOT = parse_dot(os.environ.get("JDS41_ATTN_DOT", "tf32x3"))


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


def _attend_program(q_ref, ring_ref, ring_pos_ref, k_ref, valid_ref, sink_ref, pos_ref, freqs_ref, o_ref, *,
                    heads: int, window: int, n: int, kdim: int, scale: float, norm_eps: float | None, turn: bool,
                    bh: int, bn: int, bk: int, bv: int, dot: str):
    """One program: heads hb * bh .. + bh, output columns vb * bv .. + bv, over the window's rows of the ring
    (`window` of them, oldest first, as attention.window_rows orders them) and then the n keys of k_ref (see the
    module docstring)."""
    hb, vb = pl.program_id(0), pl.program_id(1)
    h_at = hb * bh + jnp.arange(bh, dtype=jnp.int32)
    q_rows = jnp.minimum(h_at, heads - 1)  # padding heads read the last head; their results are dropped
    first_rope = kdim - 2 * freqs_ref.shape[0]
    steps = _steps(kdim, bk)
    factor = np.float32(scale)
    if turn and norm_eps is not None:  # rms_norm(q) times each head's scores: a factor a head
        squares = jnp.zeros((bh,), jnp.float32)
        for _, cols in steps:
            raw = q_ref[q_rows[:, None], cols[None, :]]
            squares = squares + jnp.sum(raw * raw, axis=1)
        factor = lax.rsqrt(squares / np.float32(kdim) + np.float32(norm_eps))[:, None] * factor
    # q's steps that hold RoPE columns, turned once (the others are loaded as they are, chunk by chunk)
    turned = {last: _turn(q_ref[q_rows[:, None], cols[None, :]], q_ref[q_rows[:, None], (cols ^ 1)[None, :]], cols,
                          pos_ref, freqs_ref, kdim=kdim, inverse=False)
              for last, cols in steps if turn and last >= first_rope}
    v_cols = vb * bv + jnp.arange(bv, dtype=jnp.int32)
    sink = sink_ref[q_rows]
    ring_rows = ring_ref.shape[0]

    def run(partner: bool):
        def chunk(keys_ref, rows, live, carry):  # keys at rows `rows` of `keys_ref`, masked where not `live`
            m, denom, acc, acc_partner = carry
            s = jnp.zeros((bh, bn), jnp.float32)
            for last, cols in steps:
                qb = turned[last] if last in turned else q_ref[q_rows[:, None], cols[None, :]]
                s = s + _dot(qb, keys_ref[rows[:, None], cols[None, :]], 1, dot)
            s = jnp.where(live[None, :], s * factor, -jnp.inf)
            top = jnp.maximum(m, jnp.max(s, axis=1))  # finite: m starts at the sink
            alpha = jnp.exp(m - top)
            p = jnp.exp(s - top[:, None])
            acc = acc * alpha[:, None] + _dot(p, keys_ref[rows[:, None], v_cols[None, :]], 0, dot)
            if partner:
                acc_partner = acc_partner * alpha[:, None] + _dot(
                    p, keys_ref[rows[:, None], (v_cols ^ 1)[None, :]], 0, dot)
            return top, denom * alpha + jnp.sum(p, axis=1), acc, acc_partner

        def window_chunk(c, carry):  # window_rows' rows: position pos - window + 1 + i at slot position mod ring
            i = c * bn + jnp.arange(bn, dtype=jnp.int32)
            want = pos_ref[0] - window + 1 + i
            slot = jnp.where(i < window, lax.rem(want + ring_rows, ring_rows), 0)  # want > -ring_rows in the window
            live = (i < window) & (want >= 0) & (ring_pos_ref[slot] == want)
            return chunk(ring_ref, slot, live, carry)

        def extra_chunk(c, carry):
            n_at = c * bn + jnp.arange(bn, dtype=jnp.int32)
            rows = jnp.minimum(n_at, n - 1)  # keys past the end read the last key and are masked
            return chunk(k_ref, rows, (n_at < n) & (valid_ref[rows] != 0), carry)

        zero = jnp.zeros((bh, bv), jnp.float32)
        # the sink's logit starts the running maximum, its exp(0) = 1 the denominator: it sits there only
        carry = (sink, jnp.ones((bh,), jnp.float32), zero, zero)
        carry = lax.fori_loop(0, -(-window // bn), window_chunk, carry)
        _, denom, acc, acc_partner = lax.fori_loop(0, -(-n // bn), extra_chunk, carry)
        if partner:
            acc = _turn(acc, acc_partner, v_cols, pos_ref, freqs_ref, kdim=kdim, inverse=True)
        o_ref[h_at[:, None], v_cols[None, :]] = acc / denom[:, None]

    first_block = first_rope // bv if turn else kdim // bv  # the first column block that holds RoPE columns

    @pl.when(vb < first_block)
    def _():
        run(False)

    @pl.when(vb >= first_block)
    def _():
        run(True)


@functools.partial(jax.jit, static_argnames=("scale", "norm_eps", "interpret", "turn_inside", "tile", "dot",
                                             "window"))
def attend_kernels(q_HK: jax.Array, keys_NK: jax.Array | None, valid_N: jax.Array | None, sink_H: jax.Array,
                   pos: jax.Array, freqs: jax.Array, scale: float, norm_eps: float | None = None,
                   interpret: bool = False, turn_inside: bool | None = None,
                   tile: tuple[int, int, int, int, int] = TILE, dot: str = DOT, ring: dict | None = None,
                   window: int = 0) -> jax.Array:
    """`attention.attend_xla` by the kernel: q [H, K] as W_qb gives it (RMS-normalised a head first where
    `norm_eps` is given, V4), turned by RoPE at `pos` (int32 scalar) with `freqs` [R/2]; keys [N, K], valid [N]
    (None: none), sinks [H] -> the output [H, K] f32 turned back; `interpret` runs it in Pallas' interpreter (any
    platform). `ring` (attention.py's window ring, {"kv", "pos"}) and `window`: the window's rows of the ring come
    first, read where they lie (the keys of `attention.window_rows` in its order, with no gather of XLA's), then
    `keys_NK`. `turn_inside` (default: compiled, not interpreted) has the kernel normalise and turn q and turn the
    output back; otherwise XLA does, as `attend_xla` (see the module docstring for why the interpreter does not).
    `tile`: (heads, keys, latent columns a step of the scores, output columns a program, warps), powers of two
    (Triton's dot wants at least 16 heads and 16 keys); `dot`: how the products run (DOTS; interpreted, "ieee")."""
    heads, kdim = q_HK.shape
    dot = "ieee" if interpret else parse_dot(dot)
    if keys_NK is None:  # no keys past the window: one masked row stands in (its loop takes no step)
        keys_NK, valid_N, n = jnp.zeros((1, kdim), jnp.float32), jnp.zeros((1,), jnp.int32), 0
    else:
        n = keys_NK.shape[0]
    if ring is None:
        ring, window = {"kv": jnp.zeros((1, kdim), jnp.float32), "pos": jnp.full((1,), -1, jnp.int32)}, 0
    elif not 0 < window <= ring["kv"].shape[0]:
        raise ValueError(f"attend_kernels: a window of {window} rows in a ring of {ring['kv'].shape[0]}")
    bh, bn, bk, bv, warps = tile
    bk, bv = min(bk, kdim), min(bv, kdim)
    if kdim % bk or kdim % bv:
        raise ValueError(f"attend_kernels: steps of {bk} or blocks of {bv} columns do not divide {kdim}")
    hp = -(-heads // bh) * bh
    if not 0 < 2 * freqs.shape[0] <= kdim:
        raise ValueError(f"attend_kernels: {2 * freqs.shape[0]} RoPE columns of a {kdim}-wide latent")
    turn = not interpret if turn_inside is None else turn_inside
    q_HK = jnp.asarray(q_HK, jnp.float32)
    if not turn:
        q_HK = apply_rope(q_HK if norm_eps is None else rms_norm(q_HK, None, norm_eps), pos, freqs)
    params = None
    args = (q_HK, jnp.asarray(ring["kv"], jnp.float32), jnp.asarray(ring["pos"], jnp.int32),
            jnp.asarray(keys_NK, jnp.float32), jnp.asarray(valid_N, jnp.int32), jnp.asarray(sink_H, jnp.float32),
            jnp.reshape(jnp.asarray(pos, jnp.int32), (1,)), jnp.asarray(freqs, jnp.float32))
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding
        args = lax.optimization_barrier(args)
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_attend_program, heads=heads, window=window, n=n, kdim=kdim, scale=float(scale),
                          norm_eps=norm_eps, turn=turn, bh=bh, bn=bn, bk=bk, bv=bv, dot=dot),
        out_shape=jax.ShapeDtypeStruct((hp, kdim), jnp.float32),
        grid=(hp // bh, kdim // bv), compiler_params=params, interpret=interpret, name="attend_one_pass",
    )(*args)
    out = out[:heads]
    if interpret:
        out = lax.optimization_barrier(out)
    return out if turn else apply_rope(out, pos, freqs, inverse=True)


def applies(kdim: int) -> bool:
    """Whether `attend` can run the kernels: switched on, Pallas' Triton backend (or the interpreter), and a latent
    width Triton's blocks take (a power of two of at least 16)."""
    return ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET) \
        and kdim >= 16 and kdim & (kdim - 1) == 0


def attend(q_HK: jax.Array, ring: dict | None, keys_NK: jax.Array | None, valid_N: jax.Array | None,
           sink_H: jax.Array, pos: jax.Array, freqs: jax.Array, scale: float, norm_eps: float | None, window: int,
           default):
    """`attend_kernels` on CUDA (or interpreted), `default(q, ring, keys, valid, pos)` elsewhere (`ring` None: no
    window rows; `keys_NK` None: no keys past them)."""
    def kernel(q, ring, keys, valid, p, interpret=False):
        return attend_kernels(q, keys, valid, sink_H, p, freqs, scale, norm_eps, interpret=interpret, ring=ring,
                              window=window)

    if triton_matvec.INTERPRET:
        return kernel(q_HK, ring, keys_NK, valid_N, pos, interpret=True)
    return lax.platform_dependent(q_HK, ring, keys_NK, valid_N, pos, cuda=kernel, default=default)
