"""Valid GGUF tensor bytes from numpy: gguf-py's quantizers, random weights for synthetic models, adversarial blocks.

Owns:
- `quantize(data, qtype)`: gguf-py's quantizer (F32, F16, BF16, Q8_0, MXFP4), always returning raw uint8 rows
  `[..., row_bytes]` as they sit in a GGUF file.
- `random_quantized(rng, qtype, shape, scale)`: valid blocks of every supported type whose values come out roughly
  N(0, scale^2), for the synthetic model writer. gguf-py cannot quantize Q2_K, Q4_K or IQ2_XXS, so those are built
  from random block fields with small f16 scales chosen for that spread; the others quantize normal samples.
- `random_bits(rng, qtype, shape)`: uniformly random blocks whose f16 fields are forced finite: the adversarial
  input for bit-exactness tests of decoders and kernels (every bit pattern of every other field occurs).

Pure numpy (no jax import): the writer streams multi-GB tensors through these without a JAX runtime. Work is done
in row chunks of about `_CHUNK_VALUES` values, into a caller's array (e.g. an `np.memmap`) when `out` is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

_CHUNK_VALUES = 1 << 18  # gguf-py's MXFP4 quantizer holds 16 f32 temporaries per value: ~16 MiB per chunk

_GGUF_QUANTIZABLE = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4})

# Byte offsets of the f16 fields inside one block; `random_bits` keeps them finite.
_F16_FIELDS = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q2_K: (80, 82), T.IQ2_XXS: (0,), T.MXFP4: ()}


def _row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n_cols % bs:
        raise ValueError(f"{qtype.name} rows hold whole blocks of {bs} values; got a row of {n_cols}")
    return n_cols // bs * ts


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf-py's quantization of `data` (last axis = rows), as raw uint8 rows `[..., row_bytes]`."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _GGUF_QUANTIZABLE:
        raise NotImplementedError(f"gguf-py cannot quantize {qtype.name} (it can: "
                                  f"{', '.join(sorted(t.name for t in _GGUF_QUANTIZABLE))}); "
                                  "use random_quantized for synthetic weights of this type")
    data = np.asarray(data, dtype=np.float32)
    q = np.ascontiguousarray(gguf.quants.quantize(data, qtype))
    return q.view(np.uint8).reshape(*data.shape[:-1], _row_bytes(qtype, data.shape[-1]))


# ---------------------------------------------------------------------------------------------------------------
# field helpers


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """f32 values -> [..., 2] little-endian f16 bytes."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random f16 bit patterns over the whole finite range (subnormals and +-65504 included), as [n, 2] bytes."""
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    b = np.where((b & 0x7C00) == 0x7C00, b & ~np.uint16(0x4000), b).astype("<u2")  # exponent 31 -> 15
    return b.view(np.uint8).reshape(n, 2)


# ---------------------------------------------------------------------------------------------------------------
# random valid blocks, one generator per type: (rng, n_blocks, scale) -> uint8 [n_blocks, type_size]
#
# Each K/IQ generator draws the quant codes uniformly (every code byte is valid), picks per-sub-block scales in
# the upper half of their range, centres the codes with the block minimum where the format has one, and sets the
# f16 super-scale so the values' RMS is about `scale`. The spread is uniform-ish per sub-block rather than normal;
# that is all a synthetic model needs.


def _gen_q4_k(rng, n, scale):
    # x = d*sc*q - dmin*m, q uniform in 0..15 (variance 21.25). With dmin = 8d and m = round(sc*7.5/8) the minimum
    # cancels the mean of q; m stays within 6 bits.
    sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)
    m = np.rint(sc * (7.5 / 8)).astype(np.uint8)
    d = (scale / (math.sqrt(21.25) * 48.6)) * rng.uniform(0.8, 1.25, n)  # 48.6: RMS of 32..63
    d = d.astype(np.float16).astype(np.float32)
    scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=1).astype(np.uint8)
    qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(d * 8), scales, qs], axis=1)


def _gen_q2_k(rng, n, scale):
    # x = d*s*q - dmin*m, q uniform in 0..3 (variance 1.25); dmin = 2d and m = round(s*1.5/2) <= 11 centre it.
    s = rng.integers(8, 16, (n, 16), dtype=np.uint8)
    m = np.rint(s * 0.75).astype(np.uint8)
    d = (scale / (math.sqrt(1.25) * 11.7)) * rng.uniform(0.8, 1.25, n)  # 11.7: RMS of 8..15
    d = d.astype(np.float16).astype(np.float32)
    qs = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    return np.concatenate([s | (m << 4), qs, _f16_bytes(d), _f16_bytes(d * 2)], axis=1)


def _iq2xxs_grid_rms() -> float:
    iq = gguf.quants.IQ2_XXS
    iq.init_grid()
    return float(np.sqrt(np.mean(np.square(iq.grid))))


def _gen_iq2_xxs(rng, n, scale):
    # x = d*(0.5+s)*0.25 * grid * sign: grid entries and 7-bit sign indices are all valid, so draw them uniformly.
    s = rng.integers(4, 12, (n, 8), dtype=np.uint32)
    rms_s = math.sqrt(np.mean(np.square(np.arange(4, 12) + 0.5)))
    d = (scale / (0.25 * rms_s * _IQ2XXS_GRID_RMS)) * rng.uniform(0.8, 1.25, n)
    grid_idx = rng.integers(0, 256, (n, 8, 4), dtype=np.uint8)
    aux1 = (rng.integers(0, 1 << 28, (n, 8), dtype=np.uint32) | (s << 28)).astype("<u4")
    groups = np.concatenate([grid_idx, aux1.view(np.uint8).reshape(n, 8, 4)], axis=2).reshape(n, 64)
    return np.concatenate([_f16_bytes(d.astype(np.float32)), groups], axis=1)


_IQ2XXS_GRID_RMS = _iq2xxs_grid_rms()


def _quantizing(qtype: GGMLQuantizationType) -> Callable:
    bs = GGML_QUANT_SIZES[qtype][0]

    def gen(rng, n, scale):
        return quantize(rng.standard_normal((n, bs), dtype=np.float32) * np.float32(scale), qtype)

    return gen


_GENERATORS: dict[GGMLQuantizationType, Callable] = {
    **{t: _quantizing(t) for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4)},
    T.Q4_K: _gen_q4_k,
    T.Q2_K: _gen_q2_k,
    T.IQ2_XXS: _gen_iq2_xxs,
}


def _random_bits_blocks(rng, qtype, n):
    ts = GGML_QUANT_SIZES[qtype][1]
    if qtype in (T.F16, T.BF16, T.F32):
        # Keep every element finite: clear the exponent's top bit where the exponent is all ones.
        u, le, exp_mask, exp_top = {T.F16: (np.uint16, "<u2", 0x7C00, 0x4000),
                                    T.BF16: (np.uint16, "<u2", 0x7F80, 0x4000),
                                    T.F32: (np.uint32, "<u4", 0x7F800000, 0x40000000)}[qtype]
        bits = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
        bits = np.where((bits & u(exp_mask)) == exp_mask, bits & ~u(exp_top), bits).astype(le)
        return bits.view(np.uint8).reshape(n, ts)
    blocks = rng.integers(0, 256, (n, ts), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        blocks[:, off : off + 2] = _finite_f16_bits(rng, n)
    return blocks


# ---------------------------------------------------------------------------------------------------------------
# public generators


def _fill(rng, qtype, shape, out, make) -> np.ndarray:
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _GENERATORS:
        raise NotImplementedError(f"no generator for tensor type {qtype.name}")
    shape = tuple(int(s) for s in shape)
    n_cols, n_rows = shape[-1], math.prod(shape[:-1])
    rb = _row_bytes(qtype, n_cols)
    bs = GGML_QUANT_SIZES[qtype][0]
    if out is None:
        out = np.empty((*shape[:-1], rb), np.uint8)
    elif out.dtype != np.uint8 or out.shape != (*shape[:-1], rb):
        raise ValueError(f"out must be uint8 {(*shape[:-1], rb)}, got {out.dtype} {out.shape}")
    rows = out.reshape(n_rows, rb)  # a view: `out` must be contiguous, as np.empty and np.memmap are
    step = max(1, _CHUNK_VALUES // n_cols)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        rows[r0:r1] = make(rng, qtype, (r1 - r0) * n_cols // bs).reshape(r1 - r0, rb)
    return out


def random_quantized(rng: np.random.Generator, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                     scale: float = 1.0, *, out: np.ndarray | None = None) -> np.ndarray:
    """Valid raw rows `uint8[*shape[:-1], row_bytes]` of a random tensor of logical `shape`, values ~N(0, scale^2).

    `out`, if given, is filled and returned (an `np.memmap` streams the tensor to disk chunk by chunk). Calling
    this per row-chunk of a larger tensor is equally valid: blocks never span rows.
    """
    return _fill(rng, qtype, shape, out, lambda r, t, n: _GENERATORS[t](r, n, scale))


def random_bits(rng: np.random.Generator, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                *, out: np.ndarray | None = None) -> np.ndarray:
    """Uniformly random raw rows with every f16 field (and every F16/BF16/F32 element) finite.

    Not weights: values span the whole f16-scaled range (MXFP4's e8m0 byte is left random, so some values are
    +-inf exactly as ggml decodes them). This is what decoders and kernels are tested bit-exact on.
    """
    return _fill(rng, qtype, shape, out, _random_bits_blocks)
