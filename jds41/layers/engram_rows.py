"""Engram on the host (MODEL.md §3): which table rows a token needs, and where their bytes come from. No jax.

Rows depend on token ids alone, so this runs on the CPU ahead of the graph (and for DSpark drafts before
verification); the graph only receives the gathered bytes (`jds41.layers.engram.engram_combine`).

Hash (steps 2-5 of MODEL.md §3), per Engram layer l and position p, with compressed ids t_k = map(tok_{p-k}):
  h_1 = t_0 * m_0;   h_n = h_{n-1} XOR (t_{n-1} * m_{n-1})  for n = 2..max_ngram
  row(n, k) = (h_n mod P[n][k]) + offset[n][k]         for head k = 0..n_heads-1
Reading of steps 4-5: the order-n buckets use h_n, the PREFIX hash over t_0..t_{n-1} (the newest n tokens), not
the final h_{max_ngram}; buckets are order-major (n = 2..max_ngram, then head), the order of `primes`/`offsets`
and of the concatenated embedding. Slots before the sequence start become map(pad_id); a blocked token (a
"dead" token such as an image span, passed here as a negative id) blocks its slot and every older slot, which
also become map(pad_id).

Signed or unsigned: the multipliers are odd int64 drawn below (2^63 - 1) // compressed_vocab, so for every
compressed id t < compressed_vocab each product t * m_k is < 2^63, the XOR of such values is < 2^63, and the
reference's int64 arithmetic with a floor modulo, uint64 arithmetic and exact Python integers all agree. The
hash here is computed in numpy uint64 (products wrap mod 2^64) with an unsigned modulo, so it is defined for any
parameters; the residue is non-negative. Were a file's multipliers larger than that bound, the unsigned reading
is the one implemented (a signed int64 floor modulo would differ for hashes >= 2^63).

Row bytes ("e4m3_e8m0_32"): head_dim E4M3 codes, then head_dim / 32 E8M0 scales (264 B for V4.1);
value j = e4m3(code j) * 2^(scale[j // 32] - 127).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import ml_dtypes
import numpy as np

from jds41.config import EngramConfig

BLOCKED = -1  # a token id below 0 marks a dead token: it and every older slot hash as map(pad_id)


class EngramHasher:
    """Row ids of every Engram layer for token positions, from the file's hash parameters and token map."""

    def __init__(self, ecfg: EngramConfig, token_map: np.ndarray):
        self.ecfg = ecfg
        self.token_map = np.asarray(token_map).astype(np.uint64)
        if self.token_map.ndim != 1 or not len(self.token_map):
            raise ValueError("token_map must be a non-empty 1-D array (token id -> compressed id)")
        if not 0 <= ecfg.pad_id < len(self.token_map):
            raise ValueError(f"pad_id {ecfg.pad_id} outside the token map ({len(self.token_map)} entries)")
        self.pad_cid = self.token_map[ecfg.pad_id]
        self.n = ecfg.max_ngram
        self.mult = np.asarray(ecfg.multipliers, dtype=np.uint64)  # [L, n]
        self.primes = np.asarray(ecfg.primes, dtype=np.uint64)  # [L, NB]
        self.offsets = np.asarray(ecfg.offsets, dtype=np.int64)  # [L, NB]
        if self.mult.shape != (len(ecfg.layer_ids), self.n) or self.primes.shape != (len(ecfg.layer_ids),
                                                                                      ecfg.n_buckets):
            raise ValueError("Engram hash parameters do not match layer_ids / max_ngram / n_heads")

    def context(self, tokens: np.ndarray) -> np.ndarray:
        """[T] token ids (negative = blocked) -> [T, max_ngram] compressed ids, slot k = k tokens back.

        Slots before the first token and slots at or behind a blocked token hold map(pad_id).
        """
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tok.shape}")
        if np.any(tok >= len(self.token_map)):
            raise ValueError(f"token id {int(tok.max())} outside the token map ({len(self.token_map)} entries)")
        T = len(tok)
        ctx = np.full((T, self.n), self.pad_cid, dtype=np.uint64)
        live = np.zeros((T, self.n), dtype=bool)
        for k in range(self.n):
            if k >= T:
                break
            src = tok[:T - k]
            ok = src >= 0
            if k:
                ok &= live[k:, k - 1]  # slot k is live only if slot k-1 of the same position is
            ctx[k:, k] = np.where(ok, self.token_map[np.maximum(src, 0)], self.pad_cid)
            live[k:, k] = ok
        return ctx

    def hash_context(self, ctx: np.ndarray) -> np.ndarray:
        """[T, max_ngram] compressed ids -> int64 [T, n_layers, n_buckets] table rows."""
        ctx = np.asarray(ctx, dtype=np.uint64)
        heads = self.ecfg.n_heads
        prods = ctx[:, None, :] * self.mult[None, :, :]  # [T, L, n], wraps mod 2^64
        out = np.empty((ctx.shape[0], self.mult.shape[0], self.ecfg.n_buckets), dtype=np.int64)
        h = prods[:, :, 0]
        for order in range(2, self.n + 1):
            h = h ^ prods[:, :, order - 1]  # h_order: prefix hash over the newest `order` tokens
            sl = slice((order - 2) * heads, (order - 1) * heads)
            res = h[:, :, None] % self.primes[None, :, sl]
            out[:, :, sl] = res.astype(np.int64) + self.offsets[None, :, sl]
        return out

    def row_ids_seq(self, tokens: Sequence[int] | np.ndarray, start_history: Sequence[int] | np.ndarray = ()
                    ) -> np.ndarray:
        """Rows for each of `tokens` [T] given the tokens before them: int64 [T, n_layers, n_buckets].

        `start_history` is the (possibly empty) sequence preceding tokens[0]; only its last max_ngram - 1 entries
        matter. Empty history = tokens[0] starts the sequence.
        """
        hist = np.asarray(start_history, dtype=np.int64).reshape(-1)[max(0, len(start_history) - (self.n - 1)):]
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        ctx = self.context(np.concatenate([hist, tok]))[len(hist):]
        return self.hash_context(ctx)

    def row_ids(self, context_token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows of the NEWEST position given its history (oldest first, newest last): int64 [n_layers, n_buckets]."""
        ctx = np.asarray(context_token_ids, dtype=np.int64).reshape(-1)
        if not len(ctx):
            raise ValueError("row_ids needs at least the newest token")
        return self.row_ids_seq(ctx[-1:], ctx[:-1])[0]


# ---- row bytes --------------------------------------------------------------------------------------------------


def dequant_rows_np(rows_u8: np.ndarray, head_dim: int) -> np.ndarray:
    """Host reference decode of "e4m3_e8m0_32" rows: uint8 [..., row_bytes] -> float32 [..., head_dim]."""
    rows = np.asarray(rows_u8).view(np.uint8)
    codes = rows[..., :head_dim].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = rows[..., head_dim:head_dim + head_dim // 32].astype(np.int32)
    mult = np.ldexp(np.float32(1.0), np.minimum(scales, 254) - 127).astype(np.float32)
    mult[scales == 255] = np.nan  # E8M0 0xFF is NaN
    return (codes.reshape((*codes.shape[:-1], head_dim // 32, 32)) * mult[..., None]).reshape(codes.shape)


class RowSource(Protocol):
    """Where Engram row bytes come from (GGUF mmap here; SSD / pinned-host tiers implement the same call)."""

    row_bytes: int

    def read_rows(self, layer_slot: int, row_ids: np.ndarray) -> np.ndarray:
        """uint8 [*row_ids.shape, row_bytes] for Engram layer `layer_slot` (index into EngramConfig.layer_ids)."""
        ...


class MmapRowSource:
    """Rows gathered from zero-copy 2-D byte views of the tables, e.g. numpy memmaps of `blk.L.engram_embd.weight`.

    `tables[slot]` is any 2-D uint8 / int8 array-like [rows, row_bytes] (np.memmap, the checkpoint reader's raw
    view, a plain array); it is viewed as uint8 without copying. Each call deduplicates its row ids and reads each
    distinct row once, in ascending order (page-cache friendly); `rows_requested` / `rows_read` count both, under a
    lock: a session's read-ahead thread and the scheduler's thread may read at the same time.
    """

    def __init__(self, tables: Sequence, row_bytes: int | None = None):
        self.tables = []
        for i, t in enumerate(tables):
            a = np.asarray(t)
            if a.ndim != 2 or a.dtype.itemsize != 1 or a.dtype.kind not in "ui":
                raise ValueError(f"Engram table {i}: expected a 2-D uint8/int8 array, got {a.dtype} {a.shape}")
            self.tables.append(a.view(np.uint8))
        widths = {t.shape[1] for t in self.tables}
        if row_bytes is not None:
            widths.add(row_bytes)
        if len(widths) != 1:
            raise ValueError(f"Engram tables disagree on the row width: {sorted(widths)}")
        self.row_bytes = widths.pop()
        self.rows_requested = 0
        self.rows_read = 0
        self._count_lock = threading.Lock()

    @classmethod
    def from_model(cls, model, ecfg: EngramConfig) -> MmapRowSource:
        """From an object with `raw(tensor_name)` returning a tensor's bytes as a 2-D view (the checkpoint reader)."""
        return cls([model.raw(f"blk.{layer}.engram_embd.weight") for layer in ecfg.layer_ids], ecfg.row_bytes)

    @classmethod
    def from_file(cls, path: str, data_offsets: Sequence[int], ecfg: EngramConfig) -> MmapRowSource:
        """Memmap each table straight from a file, given the byte offset of each Engram layer's table."""
        return cls([np.memmap(path, dtype=np.uint8, mode="r", offset=int(off), shape=(rows, ecfg.row_bytes))
                    for off, rows in zip(data_offsets, ecfg.rows, strict=True)], ecfg.row_bytes)

    def read_rows(self, layer_slot: int, row_ids: np.ndarray) -> np.ndarray:
        table = self.tables[layer_slot]
        ids = np.asarray(row_ids, dtype=np.int64)
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= table.shape[0]):
            bad = flat[(flat < 0) | (flat >= table.shape[0])][0]
            raise IndexError(f"Engram layer slot {layer_slot}: row {int(bad)} outside [0, {table.shape[0]})")
        uniq, inverse = np.unique(flat, return_inverse=True)
        with self._count_lock:
            self.rows_requested += flat.size
            self.rows_read += uniq.size
        data = table[uniq]  # one copy of each distinct row
        return data[inverse].reshape((*ids.shape, self.row_bytes))


def read_step_rows(source: RowSource, row_ids: np.ndarray) -> np.ndarray:
    """All rows of a step: int64 [..., n_layers, n_buckets] -> uint8 [..., n_layers, n_buckets, row_bytes].

    One `read_rows` call per Engram layer covering every position of the step, so duplicates across positions
    (repeated n-grams, pad contexts) are read once.
    """
    ids = np.asarray(row_ids)
    out = np.empty((*ids.shape, source.row_bytes), dtype=np.uint8)
    for slot in range(ids.shape[-2]):
        out[..., slot, :, :] = source.read_rows(slot, ids[..., slot, :])
    return out
