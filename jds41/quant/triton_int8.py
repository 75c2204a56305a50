"""The GPU kernel of the "int8" numerics' two-bit products (quant/int8_act.py): integer dot products, four a dp4a.

`rows_matvec_int8(q_XI, d_XC, raw_EOR, idx_K, qtype, layout)` computes `int8_act.xla_int8_rows_matvec` with the grid,
tile rule, prefetch and row splits of quant/triton_matvec.py (`launch`); only each step's arithmetic differs. x
comes as int8 packed four to an int32 word and its block scales as f32; the weight's small integers are assembled
into words of four signed bytes and multiplied with x's words by PTX's `dp4a` (a four-way int8 dot product added
to an int32, one instruction). Pallas' interpreter has no inline assembly, so there (the CPU tests) the same dot
is four shifts and multiplies: integer sums are exact, so both give the same integers.

IQ2_XXS (either layout): per octet, its grid index names the 16-bit word of its 8 two-bit codes in blocks.py's
packed grid (a 512-byte table) and its sign index its sign byte (ggml's even-parity bit 7, a 128-byte table). The
codes and sign bits are spread to one selector nibble a value (code + 4 where negative), and PTX's byte permute
(prmt, one instruction a word) picks each value's signed byte from the eight bytes 8, 25, 43, -, -8, -25, -43, -
held in two registers; the octet's sum is two dp4a of those words with x's (x read in value order). Why small
tables: a gather from a table of L 128-byte lines costs a warp up to L L1 wavefronts. The first form looked up
magnitude and mask words in a 3 KB table (four lookups an octet, ~44 wavefronts a warp's octet against ~5 here);
ncu put it at 92% of L1 throughput, and it ran no faster than the f32 kernel though it executed 2.3x fewer
instructions. The next built magnitudes and sign masks by shifts and masks (~40 integer ops an octet, dp4a(m, x) -
2 dp4a(m & M, x)); ncu put it at 76% of issue slots and 70% of L1 (results/profiles/ncu_iq2_xxs_int8_35_h100.txt).
The byte permutes (~20 ops) took V4.1's 4-layer int8 decode from 716.0, 722.1, 719.3 tok/s to 742.1, 722.7, 729.1
on an H100, the same predictions; a 1 KB grid table already in nibbles saved the spreading and gained no more
(737.5, 729.8; results/bench_decode_iq2_forms35_v41_4L_h100.jsonl, experiments/README.md).

Q2_K (planar rows only): a sub-block's 16 codes are one word, code u of each byte at bits 2u, so (word >> 2u) &
0x03030303 holds four codes as bytes, and x is read crumb-major (`_crumb_major`: value 4t + u of a block at
64u + t) so those four values' x bytes are one word. The sums of x per sub-block (for the mins) are dp4a with
0x01010101. Two forms (JDS41_INT8_Q2_K_FORM, read at import, for the A/B): "words", the default, assembles each
word from four byte loads (three shifts and three ors); "packs" takes the f32 kernel's load, whose last axis is a
sub-block's four bytes, and hands each thread's pack of four to inline assembly as one register
(`_Q2_K_PACK_ASM`: four shift-and-mask and dp4a), x as int8 values. Both hand the same integer sums to the same
float steps (`_q2_k_sums`). On an H100 the packs took V4.1's W_down co-launch from 29.76 to 28.41 us a layer with
the same predictions (results/profile_decode_q2k_packs42_v41_4L_h100.jsonl), but in Pallas' interpreter a
co-launched packs program no longer gives its own launch's bits (XLA:CPU contracts its float steps into fused
multiply-adds differently inside the co-launch's branch), so the CPU tests could not check the engine's
equalities with it, and it stays a switch.

MXFP4 (either layout; V4-Flash's experts, since the forty-first session): one piece of inline assembly a pack of four
quant bytes picks each value's doubled e2m1 integer from tables held in registers by byte permutes and dots the low
and high nibbles' values with x's words by two dp4a (`_MXFP4_PACK_ASM`; x in file order). Not yet run on a GPU.

Q8_0 (planar rows; rounded only with JDS41_INT8_Q8_0=1, quant/int8_act.py): a block's 32 weight bytes are already
int8, so the step is dp4a over them, in one of two forms (JDS41_INT8_Q8_0_FORM, read at import, for the A/B):
"packs" loads the bytes as the f32 kernel does and hands dp4a each thread's packs of four through inline assembly
with pack=4 (Triton gives such assembly four int8 elements as one register), x as int8 values; "words" assembles
each word from its four bytes and dots it with x's words. Neither has run on a GPU yet (experiments/device_next.sh).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax

from jds41.quant import triton_matvec as tm
from jds41.quant.blocks import IQ2XXS_PACKED_GRID, mxfp4_half_scale, mxfp4_integers
from jds41.quant.int8_act import BLOCK

# (qtype, layout) pairs this kernel reads: what an engine with the kernels holds (planar), and IQ2_XXS as in the file
KINDS = frozenset({(T.IQ2_XXS, "ggml"), (T.IQ2_XXS, "planar"), (T.Q2_K, "planar"), (T.Q8_0, "planar"),
                   (T.MXFP4, "ggml"), (T.MXFP4, "planar")})
# Q8_0's step: "packs" (dp4a over a thread's packs of four loaded bytes) or "words" (bytes assembled into words
# first); read at import, for A/B measurements
_Q8_0_FORM = os.environ.get("JDS41_INT8_Q8_0_FORM", "packs")
# Q2_K's step: "words" (each sub-block's word assembled from its four loaded bytes) or "packs" (the f32 kernel's
# load, a thread's pack of four bytes handed to inline assembly as one register); read at import, for the A/B
_Q2_K_FORM = os.environ.get("JDS41_INT8_Q2_K_FORM", "words")
_BYTE_ONES = np.int32(0x01010101)
# prmt's eight source bytes (first word bytes 0-3, second 4-7): the grid magnitudes 8, 25, 43 at bytes 0-2 and their
# negatives at bytes 4-6, so selector nibble code + 4 * negative picks a value's signed byte
_SIGNED_MAGNITUDES = (np.int32(0x002B1908), np.int32(0x00D5E7F8))


def supported(qtype, stack_bytes: int, layout: str) -> bool:
    """Whether `rows_matvec_int8` takes this stack where the kernels run (else XLA computes the product)."""
    return tm.ENABLED and (tm.has_triton_backend() or tm.INTERPRET) and (qtype, layout) in KINDS \
        and stack_bytes <= tm.MAX_STACK_BYTES




def _dp4a_asm(a, b, c):
    """sum_k a.byte[k] * b.byte[k] + c (signed bytes, int32) by PTX's dp4a, elementwise over broadcast shapes."""
    from jax.experimental.pallas import triton as plgpu

    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    args = [jnp.broadcast_to(v, shape) for v in (a, b, c)]
    [out] = plgpu.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=args, constraints="=r,r,r,r",
                                         pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])
    return out


def _dp4a_plain(a, b, c):
    """`_dp4a_asm` as shifts and multiplies (Pallas' interpreter has no inline assembly): the same integers."""
    acc = c
    for k in range(4):
        up = np.int32(24 - 8 * k)
        acc = acc + ((a << up) >> 24) * ((b << up) >> 24)  # arithmetic shifts sign-extend byte k
    return acc


def _dp4a_packs_asm(a, b):
    """int8 a, b (one shape) -> int32: per pack of four elements a thread holds, dp4a of the pack's bytes in its
    first element and 0 in the other three. Triton hands inline assembly with pack=4 four int8 elements as one
    32-bit register, so the weight's loaded bytes are dotted as they sit, with no assembly into words. Which four
    elements form a pack is Triton's register layout; a and b share it, so pairs stay pairs, and the caller sums
    whole blocks (a thread's 4 consecutive elements of a 32-value block: the GPU test checks it against XLA)."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(
        "{ mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; dp4a.s32.s32 $0, $4, $5, $1; }", args=[a, b],
        constraints="=r,=r,=r,=r,r,r", pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return out


def _dp4a_packs_plain(a, b):
    """`_dp4a_packs_asm` summed over any whole blocks: the products themselves (the interpreter's spelling)."""
    return a.astype(jnp.int32) * b.astype(jnp.int32)


# MXFP4's step, in one piece of assembly a pack of four quant bytes (`_mxfp4_packs_asm`): the 8 nibbles of the
# packed word c are selectors. Magnitude nibbles (c & 0x7777...) pick each value's byte of ggml's doubled e2m1
# integers from a positive and a negative table (prmt over two registers each), a third prmt keeps the negative
# byte where the nibble's bit 3 is set (selector i + 4 * sign: bit 3 shifted to bit 2 over 0x3210), and two more
# sort the bytes into the four low-nibble values (values j of the block) and the four high-nibble ones (j + 16),
# each dotted with its x word by dp4a: 16 instructions for 8 values, no table in memory and no x permutation.
_MXFP4_TABLES = "mov.b32 p0, 0x03020100; mov.b32 p1, 0x0C080604; mov.b32 n0, 0xFDFEFF00; mov.b32 n1, 0xF4F8FAFC;"
_MXFP4_HALF = "prmt.b32 pa, p0, p1, m; prmt.b32 na, n0, n1, m; prmt.b32 {r}, pa, na, s;"
_MXFP4_PACK_ASM = (
    "{ .reg .b32 p0, p1, n0, n1, m, s, pa, na, r0, r1, lo, hi; " + _MXFP4_TABLES
    + " and.b32 m, $4, 0x77777777; shr.u32 s, $4, 1; and.b32 s, s, 0x44444444; or.b32 s, s, 0x32103210; "
    + _MXFP4_HALF.format(r="r0") + " shr.u32 m, m, 16; shr.u32 s, s, 16; " + _MXFP4_HALF.format(r="r1")
    + " prmt.b32 lo, r0, r1, 0x6420; prmt.b32 hi, r0, r1, 0x7531;"
    + " dp4a.s32.s32 $0, lo, $5, 0; dp4a.s32.s32 $0, hi, $6, $0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")


def _mxfp4_packs_asm(q, x_lo, x_hi):
    """uint8 quant bytes q and int8 x_lo, x_hi (one shape) -> int32: per pack of four elements a thread holds, the
    integer dot product of the pack's 8 MXFP4 values (low nibbles with x_lo, high with x_hi) in its first element
    and 0 in the other three (the pairing as in `_dp4a_packs_asm`)."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(_MXFP4_PACK_ASM, args=[q, x_lo, x_hi], constraints="=r,=r,=r,=r,r,r,r",
                                         pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.int32)])
    return out


def _mxfp4_packs_plain(q, x_lo, x_hi):
    """`_mxfp4_packs_asm` summed over any whole packs: each element's two products (the interpreter's spelling)."""
    q = q.astype(jnp.int32)
    return mxfp4_integers(q & 15) * x_lo.astype(jnp.int32) + mxfp4_integers(q >> 4) * x_hi.astype(jnp.int32)


# Q2_K's step in one piece of assembly a pack of four code bytes (one planar sub-block's word): for each code position
# u, (word >> 2u) & 0x03030303 holds the four values' codes as bytes, dotted with x's word of those values by dp4a
_Q2_K_PACK_ASM = (
    "{ .reg .b32 c, a; and.b32 c, $4, 0x03030303; dp4a.s32.s32 a, c, $5, 0; "
    + "".join(f"shr.u32 c, $4, {2 * u}; and.b32 c, c, 0x03030303; dp4a.s32.s32 a, c, ${5 + u}, a; " for u in (1, 2, 3))
    + "mov.b32 $0, a; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")


def _q2_k_packs_asm(codes, x0, x1, x2, x3):
    """uint8 code bytes and int8 x_u (one shape; x_u the x of each byte's code u) -> int32: per pack of four
    elements a thread holds, sum_u sum_k code_u(byte k) * x_u[k] in its first element and 0 in the other three.
    Unlike Q8_0's and MXFP4's packs, a pack must be one sub-block's four bytes (its sum takes one scale): the
    caller's last axis is those four, and the GPU test checks Triton's packs follow it."""
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(_Q2_K_PACK_ASM, args=[codes, x0, x1, x2, x3],
                                         constraints="=r,=r,=r,=r,r,r,r,r,r", pack=4,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.int32)])
    return out


def _q2_k_packs_plain(codes, x0, x1, x2, x3):
    """`_q2_k_packs_asm` summed over whole packs: each element's four products (the interpreter's spelling)."""
    codes = codes.astype(jnp.int32)
    return sum(((codes >> (2 * u)) & 3) * x.astype(jnp.int32) for u, x in enumerate((x0, x1, x2, x3)))


def _prmt_asm(a, b, c):
    """PTX's prmt.b32 (default mode), elementwise: byte i of the result is byte c[4i + 2 : 4i] of the eight bytes
    {a, b} (a's bytes 0-3, b's 4-7), or that byte's sign bit replicated where c's bit 4i + 3 is set. One
    instruction picks four bytes from a table held in two registers."""
    from jax.experimental.pallas import triton as plgpu

    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    args = [jnp.broadcast_to(v, shape) for v in (a, b, c)]
    [out] = plgpu.elementwise_inline_asm("prmt.b32 $0, $1, $2, $3;", args=args, constraints="=r,r,r,r", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])
    return out


def _prmt_plain(a, b, c):
    """`_prmt_asm` as shifts and selects (Pallas' interpreter has no inline assembly): the same words."""
    out = jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape, c.shape), jnp.int32)
    for i in range(4):
        sel = (c >> (4 * i)) & 7
        byte = lax.shift_right_logical(jnp.where(sel >= 4, b, a), (sel & 3) * 8) & 0xFF
        byte = jnp.where(((c >> (4 * i + 3)) & 1) != 0, jnp.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out = out | (byte << (8 * i))
    return out


def _nibble_codes(p):
    """Words whose bits 2k, 2k + 1 (k = 0..7) hold 2-bit codes -> code k at bits 4k, 4k + 1 (prmt's selectors)."""
    t = (p | (p << 8)) & 0x00FF00FF  # codes 0-3 at bits 0-7, codes 4-7 at bits 16-23
    t = (t | (t << 4)) & 0x0F0F0F0F  # two codes a byte
    return (t | (t << 2)) & 0x33333333


def _nibble_signs(s):
    """Sign bytes (bit k: value k negative) -> bit k at bit 4k + 2: the selector's half of prmt's table."""
    t = (s | (s << 12)) & 0x000F000F  # bits 0-3 stay, 4-7 move to 16-19
    t = (t | (t << 6)) & 0x03030303  # two bits a byte
    return ((t | (t << 3)) & 0x11111111) << 2


def _octets(idx, s7, xl, xh, codes_ref, signs_ref, *, dp4a, prmt):
    """The octets' integer dot products from the packed grid (2-bit codes) and sign bytes (looked up in signs_ref):
    each value's selector nibble is its code plus 4 where negative, prmt picks its signed byte from
    `_SIGNED_MAGNITUDES`, and the octet is two dp4a of those ready signed words. (Computing the sign byte from the
    index's parity by one population count, in place of the table's gather, gained nothing on an H100: 46.96
    against 45.61 us a gate/up co-launch, forty-second session.)"""
    p = codes_ref[idx].astype(jnp.int32)  # [BO, NB, 8, 4]: value k's code at bits 2k
    sign_bytes = signs_ref[s7].astype(jnp.int32)
    sel = _nibble_codes(p) | _nibble_signs(sign_bytes)
    lo, hi = (jnp.full(p.shape, v, jnp.int32) for v in _SIGNED_MAGNITUDES)
    # sel's top nibble is at most 6, so the arithmetic shift brings values 4-7's selectors down as they are
    return dp4a(prmt(lo, hi, sel >> 16), xh, dp4a(prmt(lo, hi, sel), xl, jnp.zeros_like(p)))


def _dot_iq2_xxs_int8(loaded, x_ref, kx, b, d_ref, codes_ref, signs_ref, *, octets):
    """A block's 8 groups of 4 octets (`_dot_iq2_xxs` names the fields): per octet the integer dot product of its 8
    signed magnitudes with x's two words (value order: octet o = 4g + j is words 8g + 2j and 8g + 2j + 1), summed
    over the group's octets (exact), times 2s + 1; then per group f32 times x's block scale, summed over groups,
    times d / 8."""
    idx_bytes, aux_bytes, d_bytes = loaded
    g, j = tm._ar(8, 2, 4), tm._ar(4, 3, 4)
    idx = idx_bytes.astype(jnp.int32)  # [BO, NB, 8, 4]
    aux = aux_bytes[0].astype(jnp.uint32)
    for byte in range(1, 4):
        aux = aux | (aux_bytes[byte].astype(jnp.uint32) << (8 * byte))  # [BO, NB, 8, 1]
    s7 = ((aux >> (7 * j).astype(jnp.uint32)) & 0x7F).astype(jnp.int32)  # [BO, NB, 8, 4]: octets' sign indices
    x_at = b[:, None, None] * 64 + g[0] * 8 + j[0] * 2  # [NB, 8, 4]: octet (g, j)'s first word
    xl, xh = x_ref[kx, x_at][None], x_ref[kx, x_at + 1][None]
    sums = octets(idx, s7, xl, xh, codes_ref, signs_ref)
    group_sums = jnp.sum(sums * ((aux >> 28).astype(jnp.int32) * 2 + 1), axis=3)  # [BO, NB, 8], times 2s + 1
    dx = d_ref[kx, b[:, None] * 8 + g[0, :, :, 0]][None]  # [1, NB, 8]
    per_block = jnp.sum(dx * group_sums.astype(jnp.float32), axis=2)  # [BO, NB]
    return jnp.sum(tm._f16_value(d_bytes) * per_block * np.float32(0.125), axis=1)


def _load_q2_k_words(w_ref, rows, b, *, n_in: int):
    """Planar Q2_K: a step's code words [BO, NB, 16] (one a sub-block, assembled from its 4 bytes), scale|min bytes
    [BO, NB, 16], d and dmin bytes."""
    r3, s = rows[:, None, None], tm._ar(16, 2, 3)
    at = b[None, :, None] * 64 + s * 4
    words = w_ref[r3, at].astype(jnp.uint32)
    for byte in range(1, 4):
        words = words | (w_ref[r3, at + byte].astype(jnp.uint32) << (8 * byte))
    fields_at = tm.quant_bytes(T.Q2_K, n_in) + b * 20
    sc = w_ref[r3, (fields_at[:, None] + tm._ar(16, 1, 2))[None]]
    d_at = (fields_at + 16)[None, :]
    return words, sc, tm._f16_bytes(w_ref, rows[:, None], d_at), tm._f16_bytes(w_ref, rows[:, None], d_at + 2)


def _dot_q2_k_int8(loaded, x_ref, kx, b, d_ref, *, dp4a):
    """Per sub-block j: sum code * q and sum q as dp4a over its 4 code positions u (x crumb-major: word 16u + j of
    the block), then d * sum_j dx_j * f32(sc_j * sum code q) - dmin * sum_j dx_j * f32(m_j * sum q)."""
    words, sc_bytes, d_bytes, dmin_bytes = loaded
    s = tm._ar(16, 1, 2)  # [1, 16]
    x_at = b[:, None] * 64 + s  # [NB, 16]
    qx = xs = None
    for u in range(4):
        xw = x_ref[kx, x_at + 16 * u][None]  # [1, NB, 16]
        codes = lax.bitcast_convert_type((words >> np.uint32(2 * u)) & np.uint32(0x03030303), jnp.int32)
        qx = dp4a(codes, xw, jnp.zeros_like(codes) if qx is None else qx)
        xs = dp4a(jnp.full_like(xw, _BYTE_ONES), xw, jnp.zeros_like(xw) if xs is None else xs)
    return _q2_k_sums(qx, xs, sc_bytes, d_bytes, dmin_bytes, d_ref, kx, b)


def _q2_k_sums(qx, xs, sc_bytes, d_bytes, dmin_bytes, d_ref, kx, b):
    """A step's [BO] sums from its per-sub-block integer sums of code * q [BO, NB, 16] and of q [1, NB, 16] (both
    Q2_K forms, so both give the same bits)."""
    sc = sc_bytes.astype(jnp.int32)
    dx = d_ref[kx, b[:, None] * 8 + (tm._ar(16, 1, 2) >> 1)][None]  # [1, NB, 16]: sub-block j, its block of 32's
    scaled = jnp.sum(dx * ((sc & 15) * qx).astype(jnp.float32), axis=2)
    mins = jnp.sum(dx * ((sc >> 4) * xs).astype(jnp.float32), axis=2)
    return jnp.sum(tm._f16_value(d_bytes) * scaled - tm._f16_value(dmin_bytes) * mins, axis=1)


def _dot_q2_k_packs(loaded, x_ref, kx, b, d_ref, *, q2_k_packs):
    """The f32 kernel's planar Q2_K load (codes [BO, NB, 16, 4]: sub-block j's word as its 4 bytes), each word's
    16 codes with its x by `_q2_k_packs_asm`, x as int8 values crumb-major (code u of byte t of a block at
    64u + t)."""
    codes, sc_bytes, d_bytes, dmin_bytes = loaded
    x_at = b[:, None, None] * 256 + tm._ar(16, 1, 3) * 4 + tm._ar(4, 2, 3)  # [NB, 16, 4]: byte 4j + t's code 0
    xs_u = [x_ref[kx, x_at + 64 * u][None] for u in range(4)]  # [1, NB, 16, 4] int8 each
    qx = jnp.sum(q2_k_packs(codes, *(jnp.broadcast_to(x, codes.shape) for x in xs_u)), axis=3)
    xs = jnp.sum(sum(x.astype(jnp.int32) for x in xs_u), axis=3)  # [1, NB, 16]
    return _q2_k_sums(qx, xs, sc_bytes, d_bytes, dmin_bytes, d_ref, kx, b)


def _load_q8_0_words(w_ref, rows, b, *, n_in: int):
    """Planar Q8_0: a step's quants as words [BO, NB, 8] (a word's byte k: value 4w + k), f16 scale bytes."""
    at = b[None, :, None, None] * 32 + tm._ar(8, 2, 4) * 4 + tm._ar(4, 3, 4)
    quants = w_ref[rows[:, None, None, None], at].astype(jnp.uint32) << (tm._ar(4, 3, 4) * 8).astype(jnp.uint32)
    words = lax.bitcast_convert_type(jnp.sum(quants, axis=3), jnp.int32)  # the shifted bytes do not overlap
    return words, tm._f16_bytes(w_ref, rows[:, None], (n_in + 2 * b)[None, :])


def _q8_0_block_sums(isum, scale_bytes, d_ref, kx, b):
    """d_b * (dx_b * f32(block's integer sum)), summed over the step's blocks."""
    dx = d_ref[kx, b][None]  # [1, NB]
    return jnp.sum(tm._f16_value(scale_bytes) * (dx * isum.astype(jnp.float32)), axis=1)


def _dot_q8_0_packs(loaded, x_ref, kx, b, d_ref, *, dp4a_packs):
    """A block's 32 int8 weights with x's 32 int8 values by packs of four (`_dp4a_packs_asm`), x as bytes."""
    quants, scale_bytes = loaded
    xq = x_ref[kx, b[:, None] * 32 + tm._ar(32, 1, 2)][None]  # [1, NB, 32] int8
    isum = jnp.sum(dp4a_packs(lax.bitcast_convert_type(quants, jnp.int8), jnp.broadcast_to(xq, quants.shape)), axis=2)
    return _q8_0_block_sums(isum, scale_bytes, d_ref, kx, b)


def _dot_q8_0_words(loaded, x_ref, kx, b, d_ref, *, dp4a):
    """A block's 8 weight words with x's 8 words, one dp4a each, x as words."""
    words, scale_bytes = loaded
    xw = x_ref[kx, b[:, None] * 8 + tm._ar(8, 1, 2)][None]  # [1, NB, 8]
    isum = jnp.sum(dp4a(words, xw, jnp.zeros_like(words)), axis=2)
    return _q8_0_block_sums(isum, scale_bytes, d_ref, kx, b)


def _dot_mxfp4_packs(loaded, x_ref, kx, b, d_ref, *, mxfp4_packs):
    """A block's 16 quant bytes (value j low nibble, j + 16 high) with x's 32 int8 values by packs of four
    (`_mxfp4_packs_asm`), then 2^(e - 128) * (dx * f32(integer sum)) per block, as int8_act's MXFP4 product."""
    quants, e = loaded  # [BO, NB, 16] uint8, [BO, NB] e8m0
    at = b[:, None] * 32 + tm._ar(16, 1, 2)
    x_lo, x_hi = (jnp.broadcast_to(x_ref[kx, at + half][None], quants.shape) for half in (0, 16))
    isum = jnp.sum(mxfp4_packs(quants, x_lo, x_hi), axis=2)
    dx = d_ref[kx, b][None]  # [1, NB]
    return jnp.sum(mxfp4_half_scale(e) * (dx * isum.astype(jnp.float32)), axis=1)


def _words(q_XI: jax.Array) -> jax.Array:
    """int8 [X, I] -> int32 [X, I / 4], four consecutive values a word (value 4w + k at byte k)."""
    X, n_in = q_XI.shape
    return lax.bitcast_convert_type(q_XI.reshape(X, n_in // 4, 4), jnp.int32)


def int8_job(q_XI: jax.Array, d_XC: jax.Array, raw_EOR, idx_K: jax.Array, qtype, layout: str = "planar",
             interpret: bool = False, tile: tuple[int, ...] | None = None, q_crumb_major: bool = False) -> tm.Job:
    """The `triton_matvec.Job` of `rows_matvec_int8` (its arguments; `interpret` picks the dot's plain integer
    spelling, which the interpreter runs, over the inline assembly), for `triton_matvec.launch` or
    quant/co_launch.py."""
    K, X, n_in = idx_K.shape[0], q_XI.shape[0], q_XI.shape[1]
    bo, nb, warps, splits = tm.checked_tile("rows_matvec_int8", KINDS, qtype, layout, raw_EOR, K, X, n_in, tile)
    if d_XC.shape != (X, n_in // BLOCK):
        raise ValueError(f"rows_matvec_int8: scales {d_XC.shape} for x with {X} rows of {n_in}")
    values = tm.BLOCKS[qtype][0]
    dp4a = _dp4a_plain if interpret else _dp4a_asm
    q_XI = jnp.asarray(q_XI, jnp.int8)
    x_in = None  # x as the step reads it: words of four values unless set
    if qtype == T.IQ2_XXS:
        load = functools.partial(tm._load_iq2_xxs, planar=layout == "planar", n_in=n_in)
        octets = functools.partial(_octets, dp4a=dp4a, prmt=_prmt_plain if interpret else _prmt_asm)
        dot = functools.partial(_dot_iq2_xxs_int8, octets=octets)
        extra = tuple(jnp.asarray(a) for a in (d_XC.astype(np.float32), IQ2XXS_PACKED_GRID, tm.IQ2XXS_SIGN_BYTES))
    elif qtype == T.MXFP4:
        load = functools.partial(tm._load_mxfp4, planar=layout == "planar", n_in=n_in)  # the f32 kernel's load
        dot = functools.partial(_dot_mxfp4_packs, mxfp4_packs=_mxfp4_packs_plain if interpret else _mxfp4_packs_asm)
        extra, x_in = (jnp.asarray(d_XC, jnp.float32),), q_XI
    elif qtype == T.Q8_0 and _Q8_0_FORM == "packs":
        load = functools.partial(tm._load_q8_0, n_in=n_in)  # the f32 kernel's load: bytes [BO, NB, 32], scales
        dot = functools.partial(_dot_q8_0_packs, dp4a_packs=_dp4a_packs_plain if interpret else _dp4a_packs_asm)
        extra, x_in = (jnp.asarray(d_XC, jnp.float32),), q_XI
    elif qtype == T.Q8_0:
        load = functools.partial(_load_q8_0_words, n_in=n_in)
        dot = functools.partial(_dot_q8_0_words, dp4a=dp4a)
        extra = (jnp.asarray(d_XC, jnp.float32),)
    else:
        q_XI = q_XI if q_crumb_major else tm._crumb_major(q_XI)
        extra = (jnp.asarray(d_XC, jnp.float32),)
        if _Q2_K_FORM == "packs":
            load = functools.partial(tm._load_q2_k_planar, n_in=n_in)  # the f32 kernel's load
            dot = functools.partial(_dot_q2_k_packs, q2_k_packs=_q2_k_packs_plain if interpret else _q2_k_packs_asm)
            x_in = q_XI
        else:
            load = functools.partial(_load_q2_k_words, n_in=n_in)
            dot = functools.partial(_dot_q2_k_int8, dp4a=dp4a)
    return tm.make_job(_words(q_XI) if x_in is None else x_in, raw_EOR, idx_K, extra, load=load, dot=dot,
                       prefetch=qtype in tm.PREFETCH, tile=(bo, nb, warps, splits),
                       steps=n_in // (nb * values * splits), name=f"rows_matvec_int8_{qtype.name.lower()}_{layout}")


@functools.partial(jax.jit, static_argnames=("qtype", "layout", "interpret", "tile", "q_crumb_major"))
def rows_matvec_int8(q_XI: jax.Array, d_XC: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype,
                     layout: str = "planar", interpret: bool = False, tile: tuple[int, ...] | None = None,
                     q_crumb_major: bool = False) -> jax.Array:
    """`int8_act.xla_int8_rows_matvec` on the GPU: q int8 [1 or K, I], d f32 [1 or K, I / 32] (`round_int8`), raw
    rows [E, O, R] -> f32 [K, O]. `interpret` and `tile` as `triton_matvec.rows_matvec`. `q_crumb_major`: Q2_K's q
    comes already in the order its step reads (`triton_matvec._crumb_major`, as quant/int8_round_kernel.py writes
    it), not in value order. `raw_EOR` may be a tuple of stacks of one shape: one launch (`triton_matvec.launch`)."""
    return tm.launch(int8_job(q_XI, d_XC, raw_EOR, idx_K, qtype, layout, interpret, tile, q_crumb_major), interpret)
