"""The GPU kernel of the "int8" numerics' two-bit products (quant/int8_act.py): integer dot products, four a dp4a.

`rows_matvec_int8(q_XI, d_XC, raw_EOR, idx_K, qtype, layout)` computes `int8_act.xla_int8_rows_matvec` with the grid,
tile rule, prefetch and row splits of quant/triton_matvec.py (`launch`); only each step's arithmetic differs. x
comes as int8 packed four to an int32 word and its block scales as f32; the weight's small integers are assembled
into words of four signed bytes and multiplied with x's words by PTX's `dp4a` (a four-way int8 dot product added
to an int32, one instruction). Pallas' interpreter has no inline assembly, so there (the CPU tests) the same dot
is four shifts and multiplies: integer sums are exact, so both give the same integers.

IQ2_XXS (either layout): an octet's 8 magnitudes (8, 25, 43) are two words of bytes from the grid table, and its
sign index (7 bits) names two words of byte masks (0xFF where negative) in a second table; (mags ^ mask) + (mask &
0x01010101) negates the masked bytes (no byte carries: a magnitude is at least 8, so its complement is at most
0xF7). Per octet: 4 lookups, 6 integer ops and 2 dp4a for 8 values, against a float multiply-add and a field
extraction per value in the f32 step. x is read in value order.

Q2_K (planar rows only): a sub-block's 16 codes are one word, code u of each byte at bits 2u, so (word >> 2u) &
0x03030303 holds four codes as bytes, and x is read crumb-major (`_crumb_major`: value 4t + u of a block at
64u + t) so those four values' x bytes are one word. The sums of x per sub-block (for the mins) are dp4a with
0x01010101.
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
from jds41.quant.blocks import IQ2XXS_PACKED_GRID
from jds41.quant.int8_act import BLOCK

# (qtype, layout) pairs this kernel reads: what an engine with the kernels holds (planar), and IQ2_XXS as in the file
KINDS = frozenset({(T.IQ2_XXS, "ggml"), (T.IQ2_XXS, "planar"), (T.Q2_K, "planar")})
_BYTE_ONES = np.int32(0x01010101)
# IQ2_XXS step: "table" (grid and sign masks as words from a 3 KB table, four lookups an octet) or "packed" (the
# grid's 2-bit codes from a 512-byte table and the sign bits from a 128-byte one, two lookups an octet, the bytes
# assembled by arithmetic). JDS41_INT8_IQ2 (read at import) for A/B benchmarks.
IQ2_STEP = os.environ.get("JDS41_INT8_IQ2", "packed")


def supported(qtype, stack_bytes: int, layout: str) -> bool:
    """Whether `rows_matvec_int8` takes this stack where the kernels run (else XLA computes the product)."""
    return tm.ENABLED and (tm.has_triton_backend() or tm.INTERPRET) and (qtype, layout) in KINDS \
        and stack_bytes <= tm.MAX_STACK_BYTES


def _sign_mask_table() -> np.ndarray:
    """uint32 [256]: words 2i and 2i + 1 hold sign index i's byte masks for values 0-3 and 4-7 (0xFF where the
    value is negative: bit k of i | parity(i) << 7, ggml's even-parity sign bits)."""
    i = np.arange(128, dtype=np.uint32)
    parity = np.array([bin(int(v)).count("1") & 1 for v in i], np.uint32)
    bits = ((i | (parity << 7))[:, None] >> np.arange(8, dtype=np.uint32)) & 1  # [128, 8]
    masks = (bits * np.uint32(0xFF)) << (8 * (np.arange(8, dtype=np.uint32) % 4))
    return masks.reshape(128, 2, 4).sum(axis=2, dtype=np.uint32).reshape(256)


def _grid_table() -> np.ndarray:
    """uint32 [512]: words 2g and 2g + 1 hold grid entry g's magnitudes (8, 25, 43) as bytes, values 0-3 and 4-7."""
    codes = (IQ2XXS_PACKED_GRID[:, None].astype(np.uint32) >> (2 * np.arange(8, dtype=np.uint32))) & 3
    mags = np.array([8, 25, 43], np.uint32)[codes].reshape(256, 2, 4)
    return (mags << (8 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32).reshape(512)


IQ2XXS_INT8_TABLE, _MASKS_AT = np.concatenate([_grid_table(), _sign_mask_table()]), 512
_I = np.arange(128, dtype=np.uint8)
IQ2XXS_SIGN_BYTES = _I | (np.array([bin(int(v)).count("1") & 1 for v in _I], np.uint8) << 7)  # i | parity << 7


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


def _code_bytes(p):
    """int32 words whose bits 2k, 2k + 1 (k = 0..3) hold 2-bit codes -> code k in byte k (shifted copies masked)."""
    a = (p | (p << 12)) & 0x000F000F  # codes 0, 1 at bits 0-3; codes 2, 3 at bits 16-19
    return (a | (a << 6)) & 0x03030303


def _magnitude_bytes(c):
    """Code bytes (0, 1, 2) -> magnitude bytes (8, 25, 43) = 8 + 17c + (c >> 1); no byte carries."""
    return c * 17 + 0x08080808 + ((c >> 1) & _BYTE_ONES)


def _byte_masks(nibble):
    """int32 nibbles -> words whose byte k is 0xFF where bit k is set: the product with 0x00204081 moves bit k to
    bit 8k (its four shifted copies do not overlap, so nothing carries)."""
    return ((nibble * 0x00204081) & _BYTE_ONES) * 0xFF


def _signed_words(mags, masks):
    """Words of magnitude bytes with the masked bytes negated (module docstring), as int32."""
    return lax.bitcast_convert_type((mags ^ masks) + (masks & np.uint32(0x01010101)), jnp.int32)


def _octets_table(idx, s7, xl, xh, tbl_ref, *, dp4a):
    """The octets' integer dot products from IQ2XXS_INT8_TABLE: signed magnitude words, one dp4a each."""
    sign_at = _MASKS_AT + 2 * s7
    lo = _signed_words(tbl_ref[2 * idx], tbl_ref[sign_at])  # values 0-3 of each octet
    hi = _signed_words(tbl_ref[2 * idx + 1], tbl_ref[sign_at + 1])  # values 4-7
    return dp4a(hi, xh, dp4a(lo, xl, jnp.zeros_like(lo)))


def _octets_packed(idx, s7, xl, xh, codes_ref, signs_ref, *, dp4a):
    """The octets' integer dot products from the packed grid (2-bit codes) and sign bytes: magnitude words m and
    negative-byte masks M by arithmetic, then dp4a(m, x) - 2 dp4a(m & M, x) (no byte is ever negated)."""
    p = codes_ref[idx].astype(jnp.int32)  # [BO, NB, 8, 4]: value k's code at bits 2k
    signs = signs_ref[s7].astype(jnp.int32)  # value k negative where bit k is set
    m_lo, m_hi = _magnitude_bytes(_code_bytes(p)), _magnitude_bytes(_code_bytes(p >> 8))
    whole = dp4a(m_hi, xh, dp4a(m_lo, xl, jnp.zeros_like(p)))
    neg = dp4a(m_hi & _byte_masks(signs >> 4), xh, dp4a(m_lo & _byte_masks(signs & 15), xl, jnp.zeros_like(p)))
    return whole - 2 * neg


def _dot_iq2_xxs_int8(loaded, x_ref, kx, b, d_ref, *tables, dp4a):
    """A block's 8 groups of 4 octets (`_dot_iq2_xxs` names the fields): per octet the integer dot product of its 8
    signed magnitudes with x's two words (value order: octet o = 4g + j is words 8g + 2j and 8g + 2j + 1), summed
    over the group's octets (exact), times 2s + 1; then per group f32 times x's block scale, summed over groups,
    times d / 8. `tables`: IQ2XXS_INT8_TABLE (IQ2_STEP "table") or the packed grid and sign bytes ("packed")."""
    idx_bytes, aux_bytes, d_bytes = loaded
    g, j = tm._ar(8, 2, 4), tm._ar(4, 3, 4)
    idx = idx_bytes.astype(jnp.int32)  # [BO, NB, 8, 4]
    aux = aux_bytes[0].astype(jnp.uint32)
    for byte in range(1, 4):
        aux = aux | (aux_bytes[byte].astype(jnp.uint32) << (8 * byte))  # [BO, NB, 8, 1]
    s7 = ((aux >> (7 * j).astype(jnp.uint32)) & 0x7F).astype(jnp.int32)  # [BO, NB, 8, 4]: octets' sign indices
    x_at = b[:, None, None] * 64 + g[0] * 8 + j[0] * 2  # [NB, 8, 4]: octet (g, j)'s first word
    xl, xh = x_ref[kx, x_at][None], x_ref[kx, x_at + 1][None]
    octets = (_octets_table if len(tables) == 1 else _octets_packed)(idx, s7, xl, xh, *tables, dp4a=dp4a)
    group_sums = jnp.sum(octets * ((aux >> 28).astype(jnp.int32) * 2 + 1), axis=3)  # [BO, NB, 8], times 2s + 1
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
    sc = sc_bytes.astype(jnp.int32)
    dx = d_ref[kx, b[:, None] * 8 + (s >> 1)][None]  # [1, NB, 16]: sub-block j reads its block of 32's scale
    scaled = jnp.sum(dx * ((sc & 15) * qx).astype(jnp.float32), axis=2)
    mins = jnp.sum(dx * ((sc >> 4) * xs).astype(jnp.float32), axis=2)
    return jnp.sum(tm._f16_value(d_bytes) * scaled - tm._f16_value(dmin_bytes) * mins, axis=1)


def _words(q_XI: jax.Array) -> jax.Array:
    """int8 [X, I] -> int32 [X, I / 4], four consecutive values a word (value 4w + k at byte k)."""
    X, n_in = q_XI.shape
    return lax.bitcast_convert_type(q_XI.reshape(X, n_in // 4, 4), jnp.int32)


@functools.partial(jax.jit, static_argnames=("qtype", "layout", "interpret", "tile"))
def rows_matvec_int8(q_XI: jax.Array, d_XC: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype,
                     layout: str = "planar", interpret: bool = False, tile: tuple[int, ...] | None = None) -> jax.Array:
    """`int8_act.xla_int8_rows_matvec` on the GPU: q int8 [1 or K, I], d f32 [1 or K, I / 32] (`round_int8`), raw
    rows [E, O, R] -> f32 [K, O]. `interpret` and `tile` as `triton_matvec.rows_matvec`."""
    E, n_out, R = raw_EOR.shape
    K, X, n_in = idx_K.shape[0], q_XI.shape[0], q_XI.shape[1]
    if (qtype, layout) not in KINDS:
        raise ValueError(f"rows_matvec_int8 does not take {qtype.name} rows in the {layout} layout")
    values, block, _ = tm.BLOCKS[qtype]
    if n_in % values or R != n_in // values * block or X not in (1, K) or d_XC.shape != (X, n_in // BLOCK):
        raise ValueError(f"rows_matvec_int8: rows of {R} bytes for {n_in} inputs, x with {X} rows and scales "
                         f"{d_XC.shape} for {K} indices")
    if E * n_out * R > tm.MAX_STACK_BYTES:
        raise ValueError(f"rows_matvec_int8: a stack of {E * n_out * R} bytes needs 64-bit offsets")
    bo, nb, warps, splits = tm.check_tile(qtype, n_out, n_in, tile or tm.default_tile(qtype, K, n_out, n_in))
    dp4a = _dp4a_plain if interpret else _dp4a_asm
    q_XI = jnp.asarray(q_XI, jnp.int8)
    if qtype == T.IQ2_XXS:
        load = functools.partial(tm._load_iq2_xxs, planar=layout == "planar", n_in=n_in)
        dot = functools.partial(_dot_iq2_xxs_int8, dp4a=dp4a)
        tables = (IQ2XXS_INT8_TABLE,) if IQ2_STEP == "table" else (IQ2XXS_PACKED_GRID, IQ2XXS_SIGN_BYTES)
        extra = (jnp.asarray(d_XC, jnp.float32), *(jnp.asarray(t) for t in tables))
    else:
        load = functools.partial(_load_q2_k_words, n_in=n_in)
        dot = functools.partial(_dot_q2_k_int8, dp4a=dp4a)
        extra = (jnp.asarray(d_XC, jnp.float32),)
        q_XI = tm._crumb_major(q_XI)
    return tm.launch(_words(q_XI), raw_EOR, idx_K, extra, load=load, dot=dot, prefetch=qtype in tm.PREFETCH,
                     tile=(bo, nb, warps, splits), steps=n_in // (nb * values * splits), interpret=interpret,
                     name=f"rows_matvec_int8_{qtype.name.lower()}_{layout}")
