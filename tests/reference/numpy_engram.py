"""Engram half of the float64 numpy reference (MODEL.md §3): n-gram row ids, row decoding, and the gated add into the
4-copy stream at the entry of an Engram layer. Test oracle only; written from the spec, not from any engine code.

Readings of the spec, where it leaves room:
- Context of position p: t_k = token_map[tok[p-k]] for k = 0..max_ngram-1, and token_map[pad_id] for p-k < 0 (the
  pad is mapped like any other token). No image / dead tokens exist here, so "once one slot is blocked all older
  slots are blocked" reduces to the sequence start.
- Arithmetic is int64 with wraparound, made explicit with Python ints: every product t_k*m_k is reduced mod 2^64
  and read as a signed int64, the XOR is taken on those signed values (the same bits as an unsigned XOR), and the
  row is (h mod P) + offset with the NON-NEGATIVE residue of the signed h (Python's / numpy's / torch's int64 %).
  For the real parameters (m < (2^63-1)/vocab, t < vocab) no product overflows and h >= 0, so signed vs unsigned
  cannot differ; it only matters for synthetic multipliers of 2^62 and up, where this module's choice is the rule.
- Rolling hash: h = t0*m0, then for n = 2..max_ngram: h ^= t_{n-1}*m_{n-1}; the order-n hash is h after that step.
  Bucket j = (n-2)*n_heads + head (order-major, as cfg.engram.primes / offsets are stored).
- Row bytes (cfg.engram.row_bytes = head_dim + head_dim/32): the head_dim E4M3 values first, then one E8M0 scale
  byte per 32 values; value = e4m3 * 2^(scale_byte - 127) (E8M0 byte 255 is NaN). Rows of one token are
  concatenated in bucket order into E [T, n_buckets*head_dim].
- kv = E @ engram_wkv.T is [T, (hc+1)*D]: the first hc*D are the per-copy keys k_c (copy-major), the last D the
  shared value v. Gate per copy: dot = sum_d x_c*q_w[c]*k_w[c]*k_c * rsqrt(mean x_c^2 + eps) * rsqrt(mean k_c^2 +
  eps) / sqrt(D) with eps = rms_eps; g = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), i.e. sign(dot) except
  that dot == 0 counts as positive (the reference's copysign); x_c += g_c * v.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from jds41.config import EngramConfig

_MASK64 = (1 << 64) - 1


def wrap_int64(v: int) -> int:
    """Reduce a Python int mod 2^64 and read it as a signed (two's complement) int64."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def engram_row_ids(e: EngramConfig, layer: int, tokens, token_map) -> np.ndarray:
    """Row ids [T, n_buckets] (int64) of the Engram layer `layer` for every position of `tokens`."""
    li = e.layer_ids.index(layer)
    mult, primes, offsets = e.multipliers[li], e.primes[li], e.offsets[li]
    tmap = [int(t) for t in np.asarray(token_map).reshape(-1)]
    pad = tmap[e.pad_id]
    toks = [int(t) for t in tokens]
    out = np.zeros((len(toks), e.n_buckets), dtype=np.int64)
    for p in range(len(toks)):
        ctx = [tmap[toks[p - k]] if p - k >= 0 else pad for k in range(e.max_ngram)]
        h = wrap_int64(ctx[0] * mult[0])
        for n in range(2, e.max_ngram + 1):
            h = wrap_int64(h ^ wrap_int64(ctx[n - 1] * mult[n - 1]))
            for head in range(e.n_heads):
                j = (n - 2) * e.n_heads + head
                out[p, j] = h % primes[j] + offsets[j]
    return out


def decode_rows(table: np.ndarray, row_ids: np.ndarray, head_dim: int) -> np.ndarray:
    """uint8 table [rows, row_bytes] gathered at row_ids [...] -> float64 [..., head_dim]."""
    table = np.asarray(table)
    raw = (table.view(np.uint8) if table.dtype == np.int8 else table.astype(np.uint8, copy=False))[row_ids]
    vals = raw[..., :head_dim].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sbytes = raw[..., head_dim:head_dim + head_dim // 32].astype(np.float64)
    scales = np.where(sbytes == 255, np.nan, np.exp2(sbytes - 127.0))
    blocks = vals.reshape(vals.shape[:-1] + (head_dim // 32, 32)) * scales[..., None]
    return blocks.reshape(vals.shape)


def engram_apply(e: EngramConfig, layer: int, w: dict, h: np.ndarray, row_ids: np.ndarray, eps: float,
                 trace: dict | None = None) -> np.ndarray:
    """Gated Engram add into the stream h [T, hc, D] at the entry of `layer`; returns the new stream."""
    p = f"blk.{layer}."
    T, hc, D = h.shape
    rows = decode_rows(w[p + "engram_embd.weight"], row_ids, e.head_dim)  # [T, n_buckets, head_dim]
    E = rows.reshape(T, -1)
    kv = E @ w[p + "engram_wkv.weight"].T
    k = kv[:, :hc * D].reshape(T, hc, D)
    v = kv[:, hc * D:]
    qk = w[p + "engram_q.weight"] * w[p + "engram_k.weight"]  # [hc, D]: only their product matters
    dot = np.sum(h * qk[None] * k, axis=-1)
    dot = dot / np.sqrt(np.mean(h * h, axis=-1) + eps) / np.sqrt(np.mean(k * k, axis=-1) + eps) / math.sqrt(D)
    gate = 1.0 / (1.0 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot)))  # [T, hc]
    if trace is not None:
        trace[p + "engram_rows"] = row_ids
        trace[p + "engram_gate"] = gate
    return h + gate[..., None] * v[:, None, :]


def encode_rows(values: np.ndarray) -> np.ndarray:
    """Inverse helper for tests: float rows [N, head_dim] -> uint8 [N, row_bytes] (E8M0 scale = block max's power)."""
    N, hd = values.shape
    blocks = values.reshape(N, hd // 32, 32)
    amax = np.max(np.abs(blocks), axis=-1)
    # Scale so the block max lands within E4M3's range (max 448); exponent clipped to a valid E8M0 byte.
    exp = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0)), -127, 127).astype(np.int64)
    q = (blocks / np.exp2(exp)[..., None]).astype(ml_dtypes.float8_e4m3fn)
    out = np.zeros((N, hd + hd // 32), dtype=np.uint8)
    out[:, :hd] = q.reshape(N, hd).view(np.uint8)
    out[:, hd:] = (exp + 127).astype(np.uint8)
    return out
