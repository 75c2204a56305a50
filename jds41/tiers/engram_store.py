"""Where the Engram tables live, by profile: row sources for the host-side Engram read of every step.

Engram rows depend on token ids alone, so the host reads them before the step that uses them (MODEL.md §3). The
profile's `engram_tables` decides the source:
- "ssd": `SsdRowSource` reads each distinct row straight from the GGUF with O_DIRECT (the aligned span holding
  the row: a 264-byte V4.1 row costs one 4 KiB page, or two when it straddles a boundary) on a thread pool,
  behind an LRU row cache. This is how ds4 serves the 189 GiB V4.1 tables: never through the page cache.
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

import collections
import concurrent.futures
import threading

import numpy as np

from jds41.config import EngramConfig
from jds41.layers.engram_rows import MmapRowSource
from jds41.tiers.ssd import ALIGN, DirectFiles, ExpertReadError, ReadFault, aligned_empty

SPANS_PER_TASK = 64  # reads one pool task makes in turn, into one buffer (module docstring)
SPAN_BYTES = 1 << 20  # the longest single read of touching rows
TASK_BYTES = 4 << 20  # the most buffer one task reads into (32 threads: 128 MiB in flight at most)


class SsdRowSource:
    """O_DIRECT row reads with an LRU cache of `cache_rows` rows (shared by all Engram layers)."""

    def __init__(self, model, ecfg: EngramConfig, *, cache_rows: int = 65536, threads: int = 32,
                 direct: bool = True, read_fn=None):
        self.row_bytes = ecfg.row_bytes
        self.tables = []  # per Engram layer: (shard path, absolute offset of row 0, rows)
        for layer in ecfg.layer_ids:
            info = model.tensors[f"blk.{layer}.engram_embd.weight"]
            self.tables.append((info.shard, info.offset, info.shape[0]))
        self.files = DirectFiles(direct=direct, read_fn=read_fn)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jds41-engram")
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.cache_rows = cache_rows
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
        buf = aligned_empty(sum(n for *_, n in spans))
        jobs, at = [], 0
        for _, b, lo, n in spans:
            jobs.append((lo, memoryview(buf[at:at + n]), int(base + (int(rows[b - 1]) + 1) * rb - lo)))
            at += n  # every n is a multiple of ALIGN, so every view starts aligned
        try:
            self.files.read_many(path, jobs)
        except ReadFault as e:
            row = int(rows[spans[getattr(e, "job", 0)][0]])
            raise ExpertReadError(path, -1, row, f"Engram table {slot}: {e.reason}") from None
        first, at = spans[0][0], 0
        offsets = np.empty(spans[-1][1] - first, np.int64)  # where each row starts in buf
        for a, b, lo, n in spans:
            offsets[a - first:b - first] = at + base + rows[a:b].astype(np.int64) * rb - lo
            at += n
        out[:] = buf[offsets[:, None] + np.arange(rb)]

    def read_rows(self, layer_slot: int, row_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(row_ids, dtype=np.int64)
        rows = self.tables[layer_slot][2]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise IndexError(f"Engram layer slot {layer_slot}: row outside [0, {rows})")
        uniq, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        out = np.empty((uniq.size, self.row_bytes), np.uint8)
        missing = []
        with self.lock:
            self.rows_requested += ids.size
            for i, r in enumerate(uniq):
                hit = self.cache.get((layer_slot, int(r)))
                if hit is None:
                    missing.append(i)
                else:
                    self.cache.move_to_end((layer_slot, int(r)))
                    out[i] = hit
            self.cache_hits += uniq.size - len(missing)
        if missing:
            miss = np.asarray(missing)
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
            self.rows_read += len(missing)
            for i in missing:
                self.cache[(layer_slot, int(uniq[i]))] = out[i]
            while len(self.cache) > self.cache_rows:
                self.cache.popitem(last=False)
        return out[inverse].reshape((*ids.shape, self.row_bytes))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


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
