"""Loading the resident part of a model: whole tensors read on 8 threads with O_DIRECT into their final buffers.

DESIGN.md §6: resident tensors are read around the page cache (a 100+ GB file read through it would evict
everything else and be kept twice), on eight threads of ~1 MiB requests (§7: the rate that measured best), with a
progress bar, and the load reports bytes, seconds and GB/s. Each tensor lands in one page-aligned buffer covering
its enclosing aligned span; the array handed back is a view of it, so no byte is copied on the host. With a
`sharding` each array is then `jax.device_put` there (the device copy is the one copy).

If the file system refuses O_DIRECT the loader reads buffered, warns once and says so in the result (ssd.py).
A short read or an I/O error becomes a ModelFileError naming the shard and the tensor; a read that makes no
progress for `stall_timeout_s` fails the load instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from collections.abc import Sequence

import jax
from tqdm import tqdm

from jds41.errors import ModelFileError
from jds41.tiers.ssd import (
    ALIGN,
    CHUNK_BYTES,
    DirectFiles,
    OpenFn,
    ReadFault,
    ReadFn,
    Span,
    aligned_empty,
    read_spans,
    round_up,
)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """`arrays[name]`: uint8 rows `[n_rows, row_bytes]` exactly as `GGUFModel.raw(name)` (numpy, or device arrays
    when a sharding was given)."""

    arrays: dict
    bytes: int
    seconds: float
    direct_io: bool
    fallback_reason: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> dict:
        return {"tensors": len(self.arrays), "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "gbps": round(self.gbps, 3), "direct_io": self.direct_io, "fallback_reason": self.fallback_reason}


def load_tensors(model, names: Sequence[str], *, threads: int = 8, chunk_bytes: int = CHUNK_BYTES,
                 direct: bool = True, sharding: jax.sharding.Sharding | None = None, progress: bool = True,
                 stall_timeout_s: float = 60.0, align: int = ALIGN, open_fn: OpenFn | None = None,
                 read_fn: ReadFn | None = None) -> LoadResult:
    """Read `names` of an open GGUFModel (its tensor directory only: the memory maps are not touched). An Orbax
    checkpoint (jds41.checkpoints.orbax_model) restores them its own way and gives the same result."""
    if hasattr(model, "load_tensors"):
        return model.load_tensors(names, progress=progress, sharding=sharding)
    infos = [model.tensors[n] if n in model.tensors else _missing(model, n) for n in dict.fromkeys(names)]
    files = DirectFiles(direct=direct, align=align, open_fn=open_fn, read_fn=read_fn)
    spans, views = [], {}
    for t in infos:
        start = t.offset - t.offset % align
        buf = aligned_empty(round_up(t.offset + t.n_bytes - start, align), align)
        head = t.offset - start
        views[t.name] = buf[head:head + t.n_bytes].reshape(t.n_rows, t.row_bytes)
        spans.append(Span(t.shard, start, head + t.n_bytes, buf, [t.name]))
    total = sum(t.n_bytes for t in infos)

    moved = [0]
    lock = threading.Lock()
    bar = tqdm(total=sum(len(s.buf) for s in spans), unit="B", unit_scale=True, desc="loading", disable=not progress)

    def on_chunk(n: int) -> None:
        with lock:
            moved[0] += n
        bar.update(n)

    t0 = time.perf_counter()
    # Not a `with` block: its exit joins the threads, and a read stuck in the kernel would hang the failure path.
    pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="jds41-load")
    try:
        _wait(read_spans(pool, files, spans, chunk_bytes, on_chunk), moved, stall_timeout_s, model.path)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        files.close(wait_s=0.1)
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    seconds = time.perf_counter() - t0
    files.close()
    arrays = views if sharding is None else {n: jax.device_put(v, sharding) for n, v in views.items()}
    return LoadResult(arrays, total, seconds, files.stats.direct_io, files.stats.fallback_reason)


def _wait(fut: cf.Future, moved: list[int], stall_timeout_s: float, path: str) -> None:
    """Wait for the load, failing if no chunk lands for `stall_timeout_s` (a total timeout would have to guess
    the size of the model and the speed of the disk)."""
    last, last_change = -1, time.monotonic()
    while True:
        try:
            exc = fut.exception(timeout=min(1.0, stall_timeout_s))
        except cf.TimeoutError:
            if moved[0] != last:
                last, last_change = moved[0], time.monotonic()
            elif time.monotonic() - last_change > stall_timeout_s:
                raise ModelFileError(path, f"loader made no progress for {stall_timeout_s:g} s (stuck disk?)") from None
            continue
        if exc is None:
            return
        if isinstance(exc, ReadFault):
            raise ModelFileError(exc.path, exc.reason, tensor=exc.owners[0] if exc.owners else None) from exc
        raise exc


def _missing(model, name: str):
    raise ModelFileError(model.path, "no such tensor to load", tensor=name)
