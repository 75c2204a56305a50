"""Where the Engram tables live, by profile: row sources for the host-side Engram read of every step.

Engram rows depend on token ids alone, so the host reads them before the step that uses them (MODEL.md §3). The
profile's `engram_tables` decides the source:
- "ssd": `SsdRowSource` reads each distinct row straight from the GGUF with O_DIRECT (the aligned span holding
  the row: a 264-byte V4.1 row costs one 4 KiB page, or two when it straddles a boundary) on a thread pool,
  behind a direct-mapped row cache. This is how ds4 serves the 189 GiB V4.1 tables: never through the page cache.
  A prompt asks for many rows at once (V4.1: 2 layers x 24 rows per token, 196,608 for 4,096 tokens), so the
  missing rows are planned as reads in numpy (rows whose pages touch share one read, `SsdRowSource._spans`) and
  go to the pool SPANS_PER_TASK reads at a time, each task reading into one aligned buffer with one descriptor
  lookup and one counter update (`DirectFiles.read_many`) and copying its rows out in one gather. One future and
  one allocation per row made the 4K prompt's Engram read take about 8 s on the H200; runs of 64 rows with four
  lock rounds and a copy per row still left a 2.7 s gap between the h200 profile's wide prefill (4.1 s) and
  all-host's (1.4 s, tables in host memory; results/bench_prefill_matrix_v41_4L_h200.jsonl), where the SSD needs
  about 0.4 s for its 0.8 GB at 1.9 GB/s, which points at host time per row rather than the SSD. 32 threads
  keep that many reads in flight: single 4 KiB O_DIRECT reads are latency-bound, so the queue depth is what sets
  their rate.
- "host" / "hbm": the tables are copied into host memory once (`InMemoryRowSource`) and rows are gathered there.
  ("hbm" keeps them on the host too for now: a device-side gather is the fused step's concern, issue #5.)
All sources answer the `RowSource` protocol of jds41.layers.engram_rows, deduplicate each call's row ids, and count
rows asked for and rows read.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from jds41.config import EngramConfig
from jds41.layers.engram_rows import MmapRowSource
from jds41.tiers.ssd import ALIGN, DirectFiles, ExpertReadError, ReadFault, aligned_empty

SPANS_PER_TASK = 64  # reads one pool task makes in turn, into one buffer (module docstring)
SPAN_BYTES = 1 << 20  # the longest single read of touching rows
TASK_BYTES = 4 << 20  # the most buffer one task reads into (32 threads: 128 MiB in flight at most)
KEY_ROW_BITS = 40  # a cache key is (table slot << 40) | row: V4.1's tables have fewer than 2^40 rows


class SsdRowSource:
    """O_DIRECT row reads behind a direct-mapped cache of `cache_rows` rows (shared by all Engram layers)."""

    def __init__(self, model, ecfg: EngramConfig, *, cache_rows: int = 65536, threads: int = 32,
                 direct: bool = True, read_fn=None):
        self.row_bytes = ecfg.row_bytes
        self.tables = []  # per Engram layer: (shard path, absolute offset of row 0, rows)
        for layer in ecfg.layer_ids:
            info = model.tensors[f"blk.{layer}.engram_embd.weight"]
            self.tables.append((info.shard, info.offset, info.shape[0]))
        self.files = DirectFiles(direct=direct, read_fn=read_fn)
        self.reads_files = read_fn is None  # reads go to the files themselves (an injected read_fn is a test's)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jds41-engram")
        # Direct-mapped: each (table, row) has one place, so a whole call's lookups and fills are a few numpy ops
        # under the lock. The LRU it replaced walked ~10^5 rows per prompt piece in Python (about 0.45 s per
        # 100,000 rows on the 2-core VM), all of it on the read's critical path.
        self.cache_keys = np.full(max(1, cache_rows), -1, np.int64)
        self.cache_data = np.zeros((max(1, cache_rows), self.row_bytes), np.uint8)
        self.lock = threading.Lock()
        self.rows_requested = self.rows_read = self.cache_hits = 0

    def _spans(self, slot: int, rows: np.ndarray) -> list[tuple[int, int, int, int]]:
        """The reads that fetch sorted distinct `rows` of table `slot`: (first row index, end row index, aligned
        file offset, bytes to read). Rows whose aligned page spans touch or overlap share one read, up to
        SPAN_BYTES; an isolated row costs its one or two pages, as before."""
        _, base, _ = self.tables[slot]
        rb = self.row_bytes
        start = base + rows.astype(np.int64) * rb
        lo = start - start % ALIGN
        hi = -(-(start + rb) // ALIGN) * ALIGN
        firsts = np.flatnonzero(np.r_[True, lo[1:] > hi[:-1]]).tolist() + [rows.size]
        spans = []
        for a, end in zip(firsts[:-1], firsts[1:], strict=True):
            while a < end:  # a run of touching rows, cut where it would outgrow SPAN_BYTES
                b = end if hi[end - 1] - lo[a] <= SPAN_BYTES else \
                    a + 1 + int(np.searchsorted(hi[a + 1:end], lo[a] + SPAN_BYTES, side="right"))
                spans.append((a, b, int(lo[a]), int(hi[b - 1] - lo[a])))
                a = b
        return spans

    def _read_spans(self, slot: int, spans: list, rows: np.ndarray, out: np.ndarray) -> None:
        """Read `spans` (of `_spans`, consecutive) into one aligned buffer and copy their rows into `out`, which
        holds the rows from spans[0]'s first on."""
        path, base, _ = self.tables[slot]
        rb = self.row_bytes
        # Per-span work in numpy: a 4K V4.1 piece makes ~6*10^4 reads, and a few numpy calls per read in Python
        # held the GIL that the 32 readers share for about a second in all (cProfile, 2-core VM).
        a, b, lo, n = (np.asarray(c, np.int64) for c in zip(*spans, strict=True))
        at = np.cumsum(n) - n  # where each read lands in buf; every n is a multiple of ALIGN, so views stay aligned
        need = base + (rows[b - 1].astype(np.int64) + 1) * rb - lo  # bytes up to the end of each read's last row
        buf = aligned_empty(int(n.sum()))
        view = memoryview(buf)
        jobs = [(o, view[s:s + k], r) for o, s, k, r in zip(lo.tolist(), at.tolist(), n.tolist(), need.tolist())]
        try:
            self.files.read_many(path, jobs)
        except ReadFault as e:
            row = int(rows[spans[getattr(e, "job", 0)][0]])
            raise ExpertReadError(path, -1, row, f"Engram table {slot}: {e.reason}") from None
        starts = np.repeat(at + base - lo, b - a) + rows[a[0]:b[-1]].astype(np.int64) * rb  # each row in buf
        out[:] = np.lib.stride_tricks.sliding_window_view(buf, rb)[starts]

    def read_rows(self, layer_slot: int, row_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(row_ids, dtype=np.int64)
        rows = self.tables[layer_slot][2]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise IndexError(f"Engram layer slot {layer_slot}: row outside [0, {rows})")
        uniq, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        keys = (np.int64(layer_slot) << KEY_ROW_BITS) | uniq
        where = _cache_index(keys, self.cache_keys.size)
        with self.lock:
            hit = self.cache_keys[where] == keys
            out = np.empty((uniq.size, self.row_bytes), np.uint8)
            out[hit] = self.cache_data[where[hit]]
            self.rows_requested += ids.size
            self.cache_hits += int(hit.sum())
        miss = np.flatnonzero(~hit)
        if miss.size:
            want = uniq[miss]
            fresh = np.empty((miss.size, self.row_bytes), np.uint8)
            spans = self._spans(layer_slot, want)
            tasks, size = [[]], 0
            for span in spans:  # at most SPANS_PER_TASK reads and TASK_BYTES of buffer (or one span) per task
                if tasks[-1] and (len(tasks[-1]) == SPANS_PER_TASK or size + span[3] > TASK_BYTES):
                    tasks.append([])
                    size = 0
                tasks[-1].append(span)
                size += span[3]
            for f in [self.pool.submit(self._read_spans, layer_slot, t, want, fresh[t[0][0]:t[-1][1]])
                      for t in tasks]:
                f.result()  # re-raises a failed read (ExpertReadError naming the file and row)
            out[miss] = fresh
            with self.lock:
                self.rows_read += miss.size
                # rows of this call that share a place: the first keeps it (any choice is a correct cache)
                places, first = np.unique(where[miss], return_index=True)
                self.cache_keys[places] = keys[miss[first]]
                self.cache_data[places] = fresh[first]
        return out[inverse].reshape((*ids.shape, self.row_bytes))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _cache_index(keys: np.ndarray, size: int) -> np.ndarray:
    """The cache place of each key: a multiplicative (Fibonacci) hash, so rows of one table that differ in their
    low bits or by a stride still spread over the places."""
    mixed = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return ((mixed >> np.uint64(24)) % np.uint64(size)).astype(np.int64)


def InMemoryRowSource(model, ecfg: EngramConfig) -> MmapRowSource:  # noqa: N802  (a constructor by role)
    """The tables copied into host memory once (profile "host"/"hbm"), gathered there."""
    return MmapRowSource([np.array(model.raw(f"blk.{layer}.engram_embd.weight")) for layer in ecfg.layer_ids],
                         ecfg.row_bytes)


def row_source_for(model, ecfg: EngramConfig, where: str):
    """The row source a profile's `engram_tables` asks for."""
    if where == "ssd":
        return SsdRowSource(model, ecfg)
    if where in ("host", "hbm"):
        return InMemoryRowSource(model, ecfg)
    raise ValueError(f"engram_tables must be ssd, host or hbm, got {where!r}")
