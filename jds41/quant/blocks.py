"""GGML block decoders in JAX: raw GGUF row bytes -> f32, bit-exact with gguf-py's numpy dequantizer.

Owns the byte layout of every tensor type jds41 reads (F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS, MXFP4), the
public `dequantize`, and the size helpers `block_size`, `row_bytes`, `SUPPORTED_TYPES`.

Layout facts come from gguf-py's `gguf/quants.py` (itself a port of ggml-quants.c); the IQ2_XXS grid is imported
from the installed `gguf` package at import time rather than retyped. A GGUF row of `n_cols` values is
`n_cols / block_size` blocks of `type_size` bytes, so raw rows reshape to `[..., n_blocks, type_size]` for free and
every decoder below maps `uint8[..., type_size] -> f32[..., block_size]` with elementwise ops, slices, reshapes and
(IQ2_XXS only) one lookup in a 256-entry constant table, so XLA can fuse it into whatever consumes the values.

Why the results are bit-exact and order-independent: every product formed here is exact in f32 (an f16 scale has 11
significant bits, the integer factors at most 6+4 bits, so products fit in f32's 24), so the only rounding is the
final subtraction of the K-quants' minimum. Results therefore do not depend on FMA contraction or on XLA
reassociating a product. XLA:CPU flushes f32 denormals, which only MXFP4 can reach (scale exponents 0 and 1 give
2^-128 and 2^-127); MXFP4 is therefore assembled from integer bit fields instead of multiplied. tests/test_quant.py
passes bit-exact on XLA:CPU (jax 0.10.2) and on an H200 (jax 0.11.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gguf
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from jax import lax

T = GGMLQuantizationType

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q2_K, T.IQ2_XXS, T.MXFP4}
)
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.F32, T.F16, T.BF16})

# numpy dtype of each float type's elements, for holding them natively (bf16 from ml_dtypes, as jax uses).
NATIVE_DTYPES = {T.F32: np.dtype(np.float32), T.F16: np.dtype(np.float16), T.BF16: np.dtype(jnp.bfloat16)}


def check_qtype(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise NotImplementedError(f"tensor type {qtype.name} is not supported (supported: {names})")
    return qtype


def block_size(qtype: GGMLQuantizationType) -> int:
    """Values per block (1 for the float types)."""
    return GGML_QUANT_SIZES[check_qtype(qtype)][0]


def type_size(qtype: GGMLQuantizationType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[check_qtype(qtype)][1]


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes of one GGUF row of `n_cols` values; `n_cols` must be a whole number of blocks."""
    bs, ts = GGML_QUANT_SIZES[check_qtype(qtype)]
    if n_cols % bs:
        raise ValueError(f"{qtype.name} rows hold whole blocks of {bs} values; got a row of {n_cols}")
    return n_cols // bs * ts


def n_cols_of(qtype: GGMLQuantizationType, n_row_bytes: int) -> int:
    """Inverse of `row_bytes`."""
    bs, ts = GGML_QUANT_SIZES[check_qtype(qtype)]
    if n_row_bytes % ts:
        raise ValueError(f"{qtype.name} rows hold whole blocks of {ts} bytes; got a row of {n_row_bytes} bytes")
    return n_row_bytes // ts * bs


def byte_shape(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the raw uint8 rows that hold a tensor of logical (numpy-order) `shape`."""
    shape = tuple(int(s) for s in shape)
    return (*shape[:-1], row_bytes(qtype, shape[-1]))


# ---------------------------------------------------------------------------------------------------------------
# field readers


def _f16(b: jnp.ndarray) -> jnp.ndarray:
    """uint8[..., 2] little-endian half -> f32[...]; f16 subnormals become f32 normals, so no flushing."""
    return lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _split(b: jnp.ndarray, *sizes: int) -> list[jnp.ndarray]:
    """Consecutive byte fields of a block, by size."""
    out, at = [], 0
    for n in sizes:
        out.append(b[..., at : at + n])
        at += n
    assert at == b.shape[-1], (at, b.shape)
    return out


def _lead(b: jnp.ndarray, *shape: int) -> jnp.ndarray:
    """Reshape the last axis of `b` into `shape`, keeping the leading axes."""
    return b.reshape(*b.shape[:-1], *shape)


# ---------------------------------------------------------------------------------------------------------------
# float types: the row is the values


def _dec_f32(b):
    return lax.bitcast_convert_type(b, jnp.float32)[..., None]


def _dec_f16(b):
    return _f16(b)[..., None]


def _bf16_bits_to_f32(u16: jnp.ndarray) -> jnp.ndarray:
    # Integer shift, not a float convert: exact for every pattern, subnormals and NaN payloads included.
    return lax.bitcast_convert_type(u16.astype(jnp.uint32) << np.uint32(16), jnp.float32)


def _dec_bf16(b):
    return _bf16_bits_to_f32(lax.bitcast_convert_type(b, jnp.uint16))[..., None]


def native_to_f32(x: jnp.ndarray, qtype: GGMLQuantizationType) -> jnp.ndarray:
    """A float tensor held in its native dtype -> f32, with the same bits `dequantize` gives from raw bytes."""
    if qtype == T.BF16:
        return _bf16_bits_to_f32(lax.bitcast_convert_type(x, jnp.uint16))
    return x.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# Q8_0: f16 d, 32 x int8; x = d * q


def q8_0_values(d, qs):
    """Q8_0 values from a block's fields: d uint8[..., 2] (f16 bytes), qs uint8[..., 32] -> f32[..., 32]."""
    return lax.bitcast_convert_type(qs, jnp.int8).astype(jnp.float32) * _f16(d)[..., None]


def _dec_q8_0(b):
    return q8_0_values(*_split(b, 2, 32))


# ---------------------------------------------------------------------------------------------------------------
# Q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes of nibbles.
# Scale bytes: 0-3 hold sc[0:4] in their low 6 bits and sc[4:8]'s top 2 bits in bits 6-7; 4-7 the same for the
# mins; 8-11 hold sc[4:8]'s low nibble (low) and min[4:8]'s low nibble (high). Nibbles: 32-byte chunk j holds
# sub-block 2j in its low nibbles and 2j+1 in its high ones. x = (d*sc) * q - (dmin*min).

_NIBBLE_SHIFT = np.array([0, 4], np.uint8).reshape(2, 1)


def _dec_q4_k(b):
    d, dmin, scales, qs = _split(b, 2, 2, 12, 128)
    lo, mid, hi = (scales[..., 4 * i : 4 * i + 4] for i in range(3))
    sc = jnp.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    dl = _f16(d)[..., None] * sc.astype(jnp.float32)  # [..., 8]
    ml = _f16(dmin)[..., None] * mn.astype(jnp.float32)
    q = (_lead(qs, 4, 1, 32) >> _NIBBLE_SHIFT) & 0x0F  # [..., 4, 2, 32]: chunk, nibble, byte
    q = _lead(q.reshape(*q.shape[:-3], 256), 8, 32).astype(jnp.float32)
    return (dl[..., None] * q - ml[..., None]).reshape(*b.shape[:-1], 256)


# ---------------------------------------------------------------------------------------------------------------
# Q2_K: 16 bytes of (4-bit scale | 4-bit min << 4) for 16 sub-blocks of 16, 64 bytes of 2-bit quants, f16 d, f16
# dmin. Quant bytes: 32-byte chunk c holds values c*128 + s*32 + l at bits 2s of byte l. x = (d*sc)*q - dmin*min.

_CRUMB_SHIFT = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)


def q2_k_values(scales, codes, d, dmin):
    """Q2_K values from a block's fields: scales uint8[..., 16] (scale | min << 4), codes uint8[..., 256] (each
    0..3, in value order), d and dmin uint8[..., 2] (f16 bytes) -> f32[..., 256]."""
    dl = _f16(d)[..., None] * (scales & 0x0F).astype(jnp.float32)  # [..., 16]
    ml = _f16(dmin)[..., None] * (scales >> 4).astype(jnp.float32)
    q = _lead(codes, 16, 16).astype(jnp.float32)
    return (dl[..., None] * q - ml[..., None]).reshape(*codes.shape[:-1], 256)


def _dec_q2_k(b):
    scales, qs, d, dmin = _split(b, 16, 64, 2, 2)
    q = (_lead(qs, 2, 1, 32) >> _CRUMB_SHIFT) & 0x03  # [..., 2, 4, 32]: chunk, shift, byte
    return q2_k_values(scales, q.reshape(*q.shape[:-3], 256), d, dmin)


# ---------------------------------------------------------------------------------------------------------------
# IQ2_XXS: f16 d, then 8 groups of 32 values, each two little-endian uint32: the first is 4 grid indices (one per
# byte, each naming 8 magnitudes from a 256-entry grid), the second 4 x 7-bit sign indices and a 4-bit scale s in
# bits 28-31. A 7-bit sign index i expands to 8 sign bits i | parity(i) << 7 (gguf-py's `ksigns` table: an even
# number of minus signs). x = d * (0.5 + s) * 0.25 * grid * sign.
#
# Grid magnitudes are 8, 25 or 43, so an entry packs into 16 bits (2 per value), and the one gather looks up 16
# bits per 8 values instead of 8 f32s; the magnitudes then come from elementwise arithmetic on the 2-bit codes.


def _iq2xxs_packed_grid() -> np.ndarray:
    iq = gguf.quants.IQ2_XXS
    iq.init_grid()
    grid = np.asarray(iq.grid).reshape(256, 8)
    codes = np.searchsorted(np.array([8.0, 25.0, 43.0]), grid)
    assert np.array_equal(np.array([8.0, 25.0, 43.0])[codes], grid), "IQ2_XXS grid values changed in gguf-py"
    return (codes.astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)


IQ2XXS_PACKED_GRID = _iq2xxs_packed_grid()  # also the Triton kernel's lookup table
_SIGN_SHIFT = np.array([0, 7, 14, 21], np.uint32)
_BIT_SHIFT = np.arange(8, dtype=np.uint32)
_CODE_SHIFT = 2 * np.arange(8, dtype=np.uint16)


def _iq2_xxs_fields(qs):
    """A block's 64 group bytes -> (scale nibbles s uint32[..., 8], magnitudes int32[..., 8, 4, 8] (8, 25, 43),
    negative bool[..., 8, 4, 8]): group, slot, value."""
    groups = _lead(qs, 8, 2, 4)  # [..., 8, 2, 4]: group, word, byte
    aux1 = lax.bitcast_convert_type(groups[..., 1, :], jnp.uint32)  # [..., 8]
    packed = jnp.take(jnp.asarray(IQ2XXS_PACKED_GRID), groups[..., 0, :].astype(jnp.int32))  # [..., 8, 4]
    code = ((packed[..., None] >> _CODE_SHIFT) & 3).astype(jnp.int32)  # [..., 8, 4, 8]
    s7 = (aux1[..., None] >> _SIGN_SHIFT) & np.uint32(0x7F)  # [..., 8, 4]
    signs = s7 | ((lax.population_count(s7) & np.uint32(1)) << np.uint32(7))
    neg = ((signs[..., None] >> _BIT_SHIFT) & np.uint32(1)) != 0  # [..., 8, 4, 8]
    return aux1 >> np.uint32(28), 8 + 17 * code + (code >> 1), neg  # codes 0, 1, 2 -> 8, 25, 43


def iq2_xxs_values(d, qs):
    """IQ2_XXS values from a block's fields: d uint8[..., 2] (f16 bytes), qs uint8[..., 64] -> f32[..., 256]."""
    s, grid, neg = _iq2_xxs_fields(qs)
    db = _f16(d)[..., None] * (np.float32(0.5) + s.astype(jnp.float32)) * np.float32(0.25)
    x = db[..., None, None] * grid.astype(jnp.float32)
    return jnp.where(neg, -x, x).reshape(*qs.shape[:-1], 256)


def iq2_xxs_integers(qs):
    """A block's 64 group bytes -> (signed grid values int32[..., 8, 32] (+-8, 25, 43), group scales 2s + 1
    int32[..., 8]): value = d * (2s + 1) / 8 * signed grid value, the integers of `iq2_xxs_values`."""
    s, grid, neg = _iq2_xxs_fields(qs)
    signed = jnp.where(neg, -grid, grid)
    return signed.reshape(*signed.shape[:-2], 32), (2 * s + 1).astype(jnp.int32)


def _dec_iq2_xxs(b):
    return iq2_xxs_values(*_split(b, 2, 64))


# ---------------------------------------------------------------------------------------------------------------
# MXFP4: one e8m0 byte e, then 16 bytes of e2m1 nibbles (values 0-15 low nibbles, 16-31 high nibbles). ggml keeps
# the e2m1 values doubled ({0,1,2,3,4,6,8,12}, bit 3 the sign) and halves the scale: x = kv * 2^(e - 128).
# Built from bit fields because e < 2 makes the scale (and some results) f32 subnormals, which XLA:CPU flushes to
# zero in any multiply; numpy does not, and gguf-py's answer is the contract. No lookup table (elementwise ops fuse
# everywhere, gathers not always): the 8 magnitudes are arithmetic on the 3-bit code m,
# kv = m + max(m - 4, 0) + 2 * max(m - 6, 0).


def mxfp4_integers(nibbles):
    """ggml's doubled e2m1 integers (kvalues_mxfp4) of int32 nibbles: 0, 1, 2, 3, 4, 6, 8, 12 by the 3 magnitude
    bits, negated by bit 3 (-0 is 0), in arithmetic (a Pallas kernel captures no constant table)."""
    m = nibbles & 7
    mag = m + jnp.maximum(m - 4, 0) + 2 * jnp.maximum(m - 6, 0)
    return jnp.where((nibbles & 8) != 0, -mag, mag)


def mxfp4_half_scale(e):
    """e8m0 bytes -> 2^(e - 128) as f32: the block scale halved, as ggml halves it for its doubled e2m1 integers
    (the kernels' and the int8 product's factor), subnormals included (e < 2), assembled from bits so nothing
    flushes."""
    e = jnp.asarray(e).astype(jnp.int32)
    bits = jnp.where(e >= 2, (e - 1) << 23, jnp.left_shift(jnp.int32(1), 21 + e))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _dec_mxfp4(b):
    return mxfp4_values(*_split(b, 1, 16))


def mxfp4_values(e, qs):
    """MXFP4 values from a block's fields: e uint8[..., 1] (e8m0), qs uint8[..., 16] (nibbles) -> f32[..., 32]."""
    e = e.astype(jnp.int32)  # [..., 1]
    nib = (qs[..., None, :] >> _NIBBLE_SHIFT) & 0x0F  # [..., 2, 16]: a broadcast shift fuses; a concatenate did not
    nib = nib.reshape(*nib.shape[:-2], 32).astype(jnp.int32)
    m = nib & 7
    mag = m + jnp.maximum(m - 4, 0) + 2 * jnp.maximum(m - 6, 0)
    mag_bits = lax.bitcast_convert_type(mag.astype(jnp.float32), jnp.int32)  # exponent field 127 + floor(log2 kv)
    field = (mag_bits >> 23) + e - 128  # the result's biased exponent, if it is a normal number
    normal = mag_bits + (e - 128) * (1 << 23)
    # below the normal range the value is mag * 2^(e+21) units of 2^-149, which is its own bit pattern
    subnormal = mag << (jnp.minimum(e, 1) + 21)
    bits = jnp.where(field >= 255, np.int32(0x7F800000), jnp.where(field >= 1, normal, subnormal))
    bits = bits.astype(jnp.uint32) | ((nib >> 3).astype(jnp.uint32) << np.uint32(31))
    bits = jnp.where(m == 0, np.uint32(0), bits)  # ggml's -0 entry decodes to +0
    return lax.bitcast_convert_type(bits, jnp.float32)


_DECODERS: dict[GGMLQuantizationType, Callable[[jnp.ndarray], jnp.ndarray]] = {
    T.F32: _dec_f32,
    T.F16: _dec_f16,
    T.BF16: _dec_bf16,
    T.Q8_0: _dec_q8_0,
    T.Q4_K: _dec_q4_k,
    T.Q2_K: _dec_q2_k,
    T.IQ2_XXS: _dec_iq2_xxs,
    T.MXFP4: _dec_mxfp4,
}


def dequantize_rows(raw: jnp.ndarray, qtype: GGMLQuantizationType) -> jnp.ndarray:
    """uint8[..., row_bytes] GGUF rows -> f32[..., n_cols]. Traceable; fuses into its consumer."""
    qtype = check_qtype(qtype)
    if raw.dtype != jnp.uint8:
        raise TypeError(f"{qtype.name} rows must be uint8 bytes, got {raw.dtype}")
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = _lead(raw, n_cols_of(qtype, raw.shape[-1]) // bs, ts)
    out = _DECODERS[qtype](blocks)
    return out.reshape(*raw.shape[:-1], out.shape[-2] * bs)


def dequantize(raw, qtype: GGMLQuantizationType, shape: tuple[int, ...] | None = None) -> jnp.ndarray:
    """Raw GGUF tensor bytes -> f32 of logical `shape` (numpy order), bit-exact with `gguf.quants.dequantize`.

    `raw` is uint8 rows `[..., row_bytes]` as they sit in the file (or any array of those bytes when `shape` is
    given: it is reshaped, a free view for contiguous bytes). Float types may also come in their native dtype.
    Usable under `jax.jit`; `qtype` and `shape` must then be static.
    """
    qtype = check_qtype(qtype)
    raw = jnp.asarray(raw)
    if qtype in FLOAT_TYPES and raw.dtype == NATIVE_DTYPES[qtype]:
        out = native_to_f32(raw, qtype)
        return out if shape is None else out.reshape(shape)
    if shape is not None:
        want = byte_shape(qtype, shape)
        if raw.size != math.prod(want):
            raise ValueError(f"{qtype.name} tensor of shape {tuple(shape)} needs {math.prod(want)} bytes, "
                             f"got {raw.size}")
        raw = raw.reshape(want)
    return dequantize_rows(raw, qtype)
