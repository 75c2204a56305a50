"""Where the Engram tables live, by profile: row sources for the host-side Engram read of every step.

Engram rows depend on token ids alone, so the host reads them before the step that uses them (MODEL.md §3). The
profile's `engram_tables` decides the source:
- "ssd": `SsdRowSource` reads each distinct row straight from the GGUF with O_DIRECT (the aligned span holding
  the row: a 264-byte V4.1 row costs one 4 KiB page, or two when it straddles a boundary) on a thread pool,
  behind an LRU row cache. This is how ds4 serves the 189 GiB V4.1 tables: never through the page cache.
  A prompt asks for many rows at once (V4.1: 2 layers x 24 rows per token, 196,608 for 4,096 tokens), so the
  missing rows go to the pool in runs of ROWS_PER_TASK, each run read into one reused aligned buffer: one future
  and one allocation per row made the 4K prompt's Engram read take about 8 s on the H200 (the gap between the
  h200 profile's wide prefill, 11.8 s, and all-host's, 4.0 s, whose tables sit in host memory), where the SSD
  needs about 0.4 s for its 0.8 GB at 1.9 GB/s. 32 threads keep that many reads in flight: single 4 KiB
  O_DIRECT reads are latency-bound, so the queue depth is what sets their rate.
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

ROWS_PER_TASK = 64  # rows one pool task reads in turn (module docstring)


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

    def _read_rows_into(self, slot: int, rows: np.ndarray, out: np.ndarray) -> None:
        """Read `rows` of table `slot` into out[i] in turn, through one aligned buffer of the widest span."""
        path, base, _ = self.tables[slot]
        buf = aligned_empty(-(-(self.row_bytes + ALIGN - 1) // ALIGN) * ALIGN + ALIGN)
        for i, row in enumerate(rows.tolist()):
            start = base + row * self.row_bytes
            lo = start - start % ALIGN
            hi = -(-(start + self.row_bytes) // ALIGN) * ALIGN
            try:
                self.files.read_into(path, lo, memoryview(buf[:hi - lo]), start + self.row_bytes - lo)
            except ReadFault as e:
                raise ExpertReadError(path, -1, row, f"Engram table {slot}: {e.reason}") from None
            out[i] = buf[start - lo:start - lo + self.row_bytes]

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
            fresh = np.empty((miss.size, self.row_bytes), np.uint8)
            runs = range(0, miss.size, ROWS_PER_TASK)
            for f in [self.pool.submit(self._read_rows_into, layer_slot, uniq[miss[a:a + ROWS_PER_TASK]],
                                       fresh[a:a + ROWS_PER_TASK]) for a in runs]:
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
