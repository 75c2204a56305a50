"""A sublayer's input (model.sublayer_input) as Pallas (Triton) launches on the GPU: V4.1's, under the mHC lag, in
two; V4's, unlagged, in three.

Why (experiments/README.md, thirty-fourth session): XLA runs a sublayer's input from its stream x [H, D] (the
stream's RMS, the mix fn @ x, the split, the Sinkhorn kernel, the collapse, the norm) as eleven kernels of 1-3.3 us,
~17 us a sublayer and ~35 us of a plain layer's ~230. Two fused Triton forms lost before (twenty-fourth session):
their second kernel read the stream or the partial sums in one program (9-12 us), and their first looped over
`fn` in steps. Under V4.1's lag the collapse needs only the pre handed over by the previous sublayer, so here every
read of the stream or of `fn` (1 MB of f16) is spread over D / cols programs, and the one-program part reads ~8 KB:

1. `_partials` (grid rows x D / cols, cols = gcd(D, 128): 40 programs at V4.1's D = 5120): a program takes `cols`
   columns of every copy: y = sum_i pre_prev_i x_i (the collapse, in the reference's order) and the columns' shares
   of fn @ x (24 values), of sum x^2 and of sum y^2.
2. `_normed_or_split` (grid rows x (D / cols + 1), one warp a program): programs 0 .. D / cols - 1 write h = y *
   rsqrt(mean(y^2) + eps) * norm over their columns, mean(y^2) from the y^2 shares; the last program at the same
   time sums every share in program order, forms mix = (fn @ x) * rsqrt(mean(x^2) + eps) (the reference
   normalises x first: the same value to f32 rounding) and splits it (sigmoid, 2 sigmoid, Sinkhorn by
   sinkhorn_kernel.normalise), its reductions all in its one warp.

V4 (no lag: the collapse takes this sublayer's own pre, so it waits for the mix; XLA ran its input as ~9 kernels,
~15.6 us a sublayer on an H100, results/profile_decode_v4_int8_42_8L_h100.jsonl) takes three launches with the same
spread reads: `_mix_partials` (the shares of fn @ x and of sum x^2), `_split_collapse` (every program sums the
~4 KB of shares and forms pre, by the same code, so the same bits; programs 0 .. P - 1 collapse their columns and
write their share of sum y^2, program P splits the rest of the mix and runs Sinkhorn) and `_normed` (h's columns).
On by default on CUDA since the forty-third session: V4-Flash 8 layers int8 on an H100 decoded at 549.1 against
520.9 and 525.3 tok/s with XLA's spelling, and its profile took 460.5 launches and 1,855.0 us of kernels a token against
556.5 and 1,954.2 (results/bench_decode_mhc_v4_43_8L_h100.jsonl, profile_decode_mhc_v4_43_8L_h100.jsonl).
JDS41_MHC_KERNEL_V4=0 keeps XLA's spelling for V4 (JDS41_MHC_KERNEL=0 for both).

Each row's arithmetic does not depend on the rows around it (a program reads one row), so decode, verification and
prefill rows agree exactly on CUDA, as with every kernel here; against the XLA spelling (the reference, every other
platform) they agree to f32 rounding. On by default since the thirty-sixth session (an H100, experiments/README.md):
as three launches (the split a launch of its own) V4.1's 4-layer decode took 746.9 and 745.5 tok/s against 737.8
and 719.5 with XLA's, the 40-layer fit 0.218 ms a layer against 0.231; the split folded into the normed launch then
gave 753.7 against 737.1 tok/s (four rounds each). Folding the four copies' products before reducing (three
reductions a partials program, not nine) was swept alone in the thirty-seventh session: 11.59 against 11.67 us a
sublayer at 128 columns, 11.09 against 11.43 at 64, ~0.3% of a token at most, so it was not kept.
JDS41_MHC_KERNEL=0 (read at import) takes XLA's spelling. JDS41_TRITON=interpret runs it in Pallas' interpreter
on every platform (tests/test_mhc_input_kernel.py).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.layers import sinkhorn_kernel
from jds41.quant import int8_round_kernel, triton_matvec
from jds41.quant.int8_act import BLOCK, round_int8

H = sinkhorn_kernel.H
MOST_COLS = 128  # stream columns of every copy a `_partials` program takes, at most (a power of two)
PAD = 32  # a program's shares: the mix's (2 + H) H = 24 rows, sum x^2 at slot MIX, sum y^2 at MIX + 1, zeros after
MIX = (2 + H) * H
ENABLED = os.environ.get("JDS41_MHC_KERNEL", "1") != "0"
# V4's unlagged three launches: on unless JDS41_MHC_KERNEL_V4=0 (timed on an H100 in the forty-third session)
ENABLED_V4 = os.environ.get("JDS41_MHC_KERNEL_V4", "1") != "0"
# decode's FFN input rounded to int8 blocks by the launch that writes it (`round_h`, model.rounds_ffn_input): on
# unless JDS41_MHC_ROUND=0 (forty-fifth session; the same bits either way, one rounding launch a routed FFN fewer)
ROUND_FFN_INPUT = os.environ.get("JDS41_MHC_ROUND", "1") != "0"


def _ar(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _mix_shares(x, fn_ref, at, slot, *, d: int):
    """A program's shares of fn @ x (slots 0 .. MIX - 1; rows past the mix read its last row again and are dropped
    by the caller) and of sum x^2, copy by copy: fn's columns i D + c meet x[i, c]."""
    fn_row = jnp.minimum(slot, MIX - 1)[:, None]
    dots = squares = None
    for i in range(H):
        dot = jnp.sum(fn_ref[fn_row, i * d + at[None, :]].astype(jnp.float32) * x[i][None, :], axis=1)
        square = jnp.sum(x[i] * x[i])
        dots, squares = (dot, square) if dots is None else (dots + dot, squares + square)
    return dots, squares


def _collapse(x, pre):
    """y = sum_i pre[i] x_i in hc_collapse's order (`pre` a sequence of H scalars)."""
    y = pre[0] * x[0]
    for i in range(1, H):
        y = y + pre[i] * x[i]
    return y


def _partials(x_ref, fn_ref, pre_ref, y_ref, part_ref, *, d: int, cols: int):
    n, p = pl.program_id(0), pl.program_id(1)
    at, slot = p * cols + _ar(cols), _ar(PAD)
    x = [x_ref[n, i, at] for i in range(H)]  # [cols] each
    y = _collapse(x, [pre_ref[n, i] for i in range(H)])
    dots, squares = _mix_shares(x, fn_ref, at, slot, d=d)
    zero = jnp.float32(0)
    y_ref[n, at] = y
    part_ref[n, p, slot] = jnp.where(slot < MIX, dots, jnp.where(slot == MIX, squares,
                                                                 jnp.where(slot == MIX + 1, jnp.sum(y * y), zero)))


def _mix_partials(x_ref, fn_ref, part_ref, *, d: int, cols: int):
    """V4's first launch (no lag, so no collapse yet): a program's shares of fn @ x and of sum x^2."""
    n, p = pl.program_id(0), pl.program_id(1)
    at, slot = p * cols + _ar(cols), _ar(PAD)
    dots, squares = _mix_shares([x_ref[n, i, at] for i in range(H)], fn_ref, at, slot, d=d)
    part_ref[n, p, slot] = jnp.where(slot < MIX, dots, jnp.where(slot == MIX, squares, jnp.float32(0)))


def _row_mix(n, part_ref, *, d: int, programs: int, rms_eps: float):
    """Row n's shares summed in program order -> `mix(at)`: the mix's values at int32 slots `at` (any shape)."""
    zero, slot = jnp.float32(0), _ar(PAD)
    at = _ar(_pow2(programs))
    shares = part_ref[n, jnp.minimum(at, programs - 1)[:, None], slot[None, :]]  # [P', PAD]
    sums = jnp.sum(jnp.where((at < programs)[:, None], shares, zero), axis=0)  # [PAD]

    def pick(at_):  # sums at the int32 slots `at_`, by masked sums over the slots
        return jnp.sum(jnp.where(at_[..., None] == slot, sums, zero), axis=-1)

    mix_scale = lax.rsqrt(pick(jnp.int32(MIX)) / jnp.float32(H * d) + jnp.float32(rms_eps))
    return lambda at_: pick(at_) * mix_scale


def _sigmoid(z):
    one = jnp.float32(1)
    return one / (one + jnp.exp(-z))


def _pre(mix, scale_ref, base_ref, hc_eps: float):
    h_at = _ar(H)
    return _sigmoid(mix(h_at) * scale_ref[0] + base_ref[h_at]) + jnp.float32(hc_eps)


def _split_row(n, mix, pre, scale_ref, base_ref, pre_ref, post_ref, comb_ref, *, hc_eps: float, iters: int):
    """Row n's split of its mix (`_row_mix`) and Sinkhorn: pre (formed from that mix by `_pre`), post, comb."""
    h_at, src_dst = _ar(H), _ar(H)[:, None] * H + _ar(H)[None, :]
    pre_ref[n, h_at] = pre
    post_ref[n, h_at] = 2 * _sigmoid(mix(H + h_at) * scale_ref[1] + base_ref[H + h_at])
    logits = mix(2 * H + src_dst) * scale_ref[2] + base_ref[2 * H + src_dst]
    comb_ref[n, src_dst] = sinkhorn_kernel.normalise(logits, hc_eps, iters)


def _write_normed(n, p, part_ref, y_ref, norm_ref, h_ref, rounded=None, *, d: int, cols: int, programs: int,
                  rms_eps: float):
    """h's columns of program p: y * rsqrt(mean(y^2) + eps) * norm, mean(y^2) from the y^2 shares (slot MIX + 1).
    `rounded` (q_ref, d_ref, div, rint): also h's int8 blocks, as int8_round_kernel rounds them (the same code, so
    the same bits as rounding the written h), for the int8 products of the FFN's routed experts."""
    ps = _ar(_pow2(programs))
    y_squares = jnp.where(ps < programs, part_ref[n, jnp.minimum(ps, programs - 1), MIX + 1], jnp.float32(0))
    rms = lax.rsqrt(jnp.sum(y_squares) / jnp.float32(d) + jnp.float32(rms_eps))
    if rounded is None:
        at = p * cols + _ar(cols)
        h_ref[n, at] = y_ref[n, at] * rms * norm_ref[at]
        return
    q_ref, d_ref, div, rint = rounded
    nb = cols // BLOCK
    at = int8_round_kernel.block_positions(p * nb, nb)  # [nb, 32]: the same columns as blocks of 32
    h = y_ref[n, at] * rms * norm_ref[at]
    h_ref[n, at] = h
    q, scale = int8_round_kernel.round_blocks(h, div=div, rint=rint)
    q_ref[n, at] = q
    d_ref[n, p * nb + _ar(nb)] = scale


def _normed_or_split(part_ref, y_ref, norm_ref, scale_ref, base_ref, h_ref, pre_ref, post_ref, comb_ref, *q_d_refs,
                     d: int, cols: int, programs: int, rms_eps: float, hc_eps: float, iters: int, rounding=None):
    """The second launch: programs 0 .. P - 1 write h's columns (y's RMS from the y^2 shares; with `rounding`,
    (div, rint), h's int8 blocks too), program P splits the mix (`_split_row`) at the same time."""
    n, p = pl.program_id(0), pl.program_id(1)
    rounded = None if rounding is None else (*q_d_refs, *rounding)

    @pl.when(p == programs)
    def split_program():
        mix = _row_mix(n, part_ref, d=d, programs=programs, rms_eps=rms_eps)
        _split_row(n, mix, _pre(mix, scale_ref, base_ref, hc_eps), scale_ref, base_ref, pre_ref, post_ref, comb_ref,
                   hc_eps=hc_eps, iters=iters)

    @pl.when(p < programs)
    def normed_program():
        _write_normed(n, p, part_ref, y_ref, norm_ref, h_ref, rounded, d=d, cols=cols, programs=programs,
                      rms_eps=rms_eps)


def _split_collapse(part_ref, x_ref, scale_ref, base_ref, y_ref, ysq_ref, pre_ref, post_ref, comb_ref, *, d: int,
                    cols: int, programs: int, rms_eps: float, hc_eps: float, iters: int):
    """V4's second launch: every program forms pre from the summed shares (the same code, so the same bits, in
    each); programs 0 .. P - 1 collapse their columns with it and write their share of sum y^2 (slot MIX + 1, as
    `_partials`), program P writes pre and splits the rest of the mix at the same time."""
    n, p = pl.program_id(0), pl.program_id(1)
    mix = _row_mix(n, part_ref, d=d, programs=programs, rms_eps=rms_eps)
    pre = _pre(mix, scale_ref, base_ref, hc_eps)

    @pl.when(p == programs)
    def split_program():
        _split_row(n, mix, pre, scale_ref, base_ref, pre_ref, post_ref, comb_ref, hc_eps=hc_eps, iters=iters)

    @pl.when(p < programs)
    def collapse_program():
        at, slot, zero = p * cols + _ar(cols), _ar(PAD), jnp.float32(0)
        pre_i = [jnp.sum(jnp.where(_ar(H) == i, pre, zero)) for i in range(H)]
        y = _collapse([x_ref[n, i, at] for i in range(H)], pre_i)
        y_ref[n, at] = y
        ysq_ref[n, p, slot] = jnp.where(slot == MIX + 1, jnp.sum(y * y), zero)


def _normed(part_ref, y_ref, norm_ref, h_ref, *q_d_refs, d: int, cols: int, programs: int, rms_eps: float,
            rounding=None):
    """V4's third launch: h's columns (and with `rounding` their int8 blocks)."""
    rounded = None if rounding is None else (*q_d_refs, *rounding)
    _write_normed(pl.program_id(0), pl.program_id(1), part_ref, y_ref, norm_ref, h_ref, rounded, d=d, cols=cols,
                  programs=programs, rms_eps=rms_eps)


@functools.partial(jax.jit, static_argnames=("rms_eps", "hc_eps", "iters", "interpret", "most_cols",
                                             "partial_warps", "round_h"))
def sublayer_input_rows(x_NHD, pre_prev_NH, fn_MK, scale_3, base_M, norm_D, *, rms_eps: float, hc_eps: float,
                        iters: int, interpret: bool = False, most_cols: int = MOST_COLS, partial_warps: int = 4,
                        round_h: bool = False):
    """(h [N, D], pre [N, H], post [N, H], comb [N, H, H]) of N rows' streams x [N, H, D]: under the lag (V4.1)
    collapsed with `pre_prev_NH` [N, H] in two launches; with `pre_prev_NH` None (V4) with each row's own pre, in
    three (the mix's shares; the split and the collapse; the norm). `most_cols` (a power of two) and
    `partial_warps` (a first-launch program's warps) are the layout experiments/bench_mhc_input.py sweeps; 128 and
    4 were the fastest on an H100 (V4.1). `round_h` (a program's columns whole blocks of 32: `rounds`) adds
    (q int8 [N, D], d f32 [N, D / 32]) = int8_act.round_int8(h), written by the launch that writes h."""
    if most_cols < 16 or most_cols & (most_cols - 1) or partial_warps not in (1, 2, 4, 8):
        raise ValueError(f"mhc_input_kernel: {most_cols} columns and {partial_warps} warps a program; columns a "
                         "power of two of at least 16, warps 1, 2, 4 or 8")
    N, _, d = x_NHD.shape
    cols = math.gcd(d, most_cols)
    programs = d // cols
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    lagged = pre_prev_NH is not None
    x_NHD, scale_3, base_M, norm_D = map(f32, (x_NHD, scale_3, base_M, norm_D))
    pre_prev_NH = f32(pre_prev_NH) if lagged else None
    params = lambda warps: None  # noqa: E731
    if interpret:  # interpreted, a kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        x_NHD, pre_prev_NH = lax.optimization_barrier((x_NHD, pre_prev_NH))
    else:
        from jax.experimental.pallas import triton as plgpu

        params = lambda warps: plgpu.CompilerParams(num_warps=warps, num_stages=1)  # noqa: E731
    row = lambda *shape: jax.ShapeDtypeStruct((N, *shape), jnp.float32)  # noqa: E731
    call = functools.partial(pl.pallas_call, interpret=interpret)
    if round_h and cols % BLOCK:
        raise ValueError(f"mhc_input_kernel: {cols} columns a program are not whole blocks of {BLOCK} to round")
    rounding = int8_round_kernel.asm_or_plain(interpret) if round_h else None
    q_d = (jax.ShapeDtypeStruct((N, d), jnp.int8), row(d // BLOCK)) if round_h else ()
    consts = dict(d=d, cols=cols, programs=programs, rms_eps=float(rms_eps))
    split = dict(hc_eps=float(hc_eps), iters=int(iters))
    if lagged:
        y, parts = call(functools.partial(_partials, d=d, cols=cols), grid=(N, programs),
                        compiler_params=params(partial_warps), out_shape=(row(d), row(programs, PAD)),
                        name="mhc_input_partials")(x_NHD, fn_MK, pre_prev_NH)
        h, pre, post, comb, *q_d = call(  # one warp a program: the split's Sinkhorn keeps every reduction in its warp
            functools.partial(_normed_or_split, **consts, **split, rounding=rounding), grid=(N, programs + 1),
            compiler_params=params(1), out_shape=(row(d), row(H), row(H), row(H * H), *q_d),
            name="mhc_input_normed_split")(parts, y, norm_D, scale_3, base_M)
    else:
        parts = call(functools.partial(_mix_partials, d=d, cols=cols), grid=(N, programs),
                     compiler_params=params(partial_warps), out_shape=row(programs, PAD),
                     name="mhc_input_mix_partials")(x_NHD, fn_MK)
        y, y_parts, pre, post, comb = call(
            functools.partial(_split_collapse, **consts, **split), grid=(N, programs + 1),
            compiler_params=params(1), out_shape=(row(d), row(programs, PAD), row(H), row(H), row(H * H)),
            name="mhc_input_split_collapse")(parts, x_NHD, scale_3, base_M)
        h, *q_d = call(functools.partial(_normed, **consts, rounding=rounding), grid=(N, programs),
                       compiler_params=params(1),
                       out_shape=(row(d), *q_d), name="mhc_input_normed")(y_parts, y, norm_D)
    out = (h, pre, post, comb.reshape(N, H, H), *q_d)
    return lax.optimization_barrier(out) if interpret else out


def applies(hc: int, d: int, mix_width: int, lagged: bool = True) -> bool:
    """Whether `sublayer_input` runs the kernels: switched on (`ENABLED`, and `ENABLED_V4` where not `lagged`),
    Pallas' Triton backend or the interpreter, H = 4 copies, D with a power-of-two factor of at least 16 (a
    program's columns), a (2 + H) H mix."""
    return (ENABLED and (lagged or ENABLED_V4) and hc == H and math.gcd(d, MOST_COLS) >= 16 and mix_width == MIX
            and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET))


def rounds(d: int) -> bool:
    """Whether the launch writing h can round it to int8 blocks too (`round_h`): a program's columns whole blocks."""
    return math.gcd(d, MOST_COLS) % BLOCK == 0


def sublayer_input(x_HD, pre_prev_H, fn_MK, scale_3, base_M, norm_D, *, rms_eps: float, hc_eps: float, iters: int,
                   default, round_h: bool = False):
    """One row's (h, pre, post, comb) (leading axes allowed): the kernels on CUDA (or interpreted), else
    `default(x_HD, pre_prev_H)`, the XLA spelling. `pre_prev_H` None: no lag (V4), each row's own pre collapses.
    `round_h` (where `rounds`) adds h's int8 blocks (q, d) = int8_act.round_int8(h), written by h's own launch on
    CUDA and by XLA elsewhere (where nothing but a kernel's product reads them, so XLA drops them)."""
    lead, (hc, d) = x_HD.shape[:-2], x_HD.shape[-2:]
    x_NHD = x_HD.reshape(-1, hc, d)
    pre_NH = None if pre_prev_H is None else jnp.reshape(pre_prev_H, (-1, hc))
    run = functools.partial(sublayer_input_rows, fn_MK=fn_MK, scale_3=scale_3, base_M=base_M, norm_D=norm_D,
                            rms_eps=rms_eps, hc_eps=hc_eps, iters=iters, round_h=round_h)

    def xla(x_HD, pre_prev_H):
        out = default(x_HD, pre_prev_H)
        return (*out, *round_int8(out[0])) if round_h else out

    if triton_matvec.INTERPRET:
        out = run(x_NHD, pre_NH, interpret=True)
    elif pre_NH is None:
        out = lax.platform_dependent(x_NHD, cuda=lambda x: run(x, None), default=jax.vmap(lambda r: xla(r, None)))
    else:
        out = lax.platform_dependent(x_NHD, pre_NH, cuda=run, default=jax.vmap(xla))
    h, pre, post, comb = out[:4]
    shaped = (h.reshape(*lead, d), pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc))
    return (*shaped, out[4].reshape(*lead, d), out[5].reshape(*lead, d // BLOCK)) if round_h else shaped
