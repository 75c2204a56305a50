"""The SSD reader pool: routed experts (and, for the loader, whole tensors) read with O_DIRECT straight from the GGUF.

Owns:
- `DirectFiles`: one descriptor per shard, opened O_DIRECT; if the file system refuses (EINVAL on open or on the
  first read), buffered reads with ONE `DirectIOUnavailable` warning and `stats.direct_io = False`.
- `read_spans`: runs aligned spans as ~1 MiB chunk reads on a thread pool (DESIGN.md §7: 8 threads x 1 MiB gave
  1.9 GB/s on the GPU box, 4 MiB requests only 1.5) and calls each span's delivery when its last chunk lands.
- `ExpertReader`: `submit(keys) -> Future[{(layer, expert): uint8 gate|up|down}]`, `read(keys)` with a timeout;
  where each expert's pieces sit comes from an `ExpertLayout` (stores.py).

O_DIRECT wants the file offset, the length and the buffer address aligned (4096 here). Expert `e > 0` of a Q8_0
stack usually starts mid-page, so each request reads the enclosing aligned span into an aligned bounce buffer
and copies the pieces out: a host copy runs at ~117 GB/s against 1.9 GB/s from the SSD, so it costs ~2%. The
pieces of one request are coalesced: gate/up/down of one expert and neighbouring experts that share pages become
one span, read once.

Faults never become wrong bytes or a hang: a short read (truncated file), EIO or any other error fails the whole
request with `ExpertReadError(path, layer, expert, reason)`, and `read` waits at most `timeout_s`. Reads go
through an injectable `read_fn(fd, buf, offset) -> n` and `open_fn(path, flags) -> fd`, so tests inject faults.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Self

import numpy as np

from jds41.errors import Jds41Error
from jds41.tiers.stats import ReaderStats

if TYPE_CHECKING:
    from jds41.tiers.stores import ExpertLayout

ALIGN = 4096  # O_DIRECT's logical block size on the NVMe/virtio disks we target; GGUF general.alignment=4096
CHUNK_BYTES = 1 << 20
MAX_SPAN_BYTES = 16 << 20  # bounds the bounce buffer when a request names many neighbouring experts
Key = tuple[int, int]
ReadFn = Callable[[int, memoryview, int], int]
OpenFn = Callable[[str, int], int]


class ExpertReadError(Jds41Error):
    """Reading one routed expert failed; names the file, the layer, the expert and why. `keys`: every expert of
    the failed request that shared the failing span (the first is the one named)."""

    def __init__(self, path: str, layer: int, expert: int, reason: str):
        self.path, self.layer, self.expert, self.reason = str(path), int(layer), int(expert), reason
        self.keys: tuple[Key, ...] = ((self.layer, self.expert),)
        super().__init__(f"{self.path}: layer {self.layer} expert {self.expert}: {reason}")


class DirectIOUnavailable(RuntimeWarning):
    """The file system refused O_DIRECT; reads go through the page cache."""


class ReadFault(Exception):
    """A chunk read failed (internal; callers translate it into their own error naming what the bytes were)."""

    def __init__(self, path: str, reason: str, owners: tuple = ()):
        self.path, self.reason, self.owners = path, reason, owners
        super().__init__(f"{path}: {reason}")


def aligned_empty(n: int, align: int = ALIGN) -> np.ndarray:
    """Uninitialized uint8[n] whose first byte sits on an `align` boundary (numpy only promises 16 or 64)."""
    raw = np.empty(n + align, np.uint8)
    head = (-raw.ctypes.data) % align
    return raw[head:head + n]


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def _settle(fut: cf.Future, value=None, exc: BaseException | None = None) -> None:
    """Settle once; the loser of a race (a sibling chunk, close()) is ignored."""
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(value)
    except cf.InvalidStateError:
        pass


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


class DirectFiles:
    """Descriptors by path (opened lazily, shared by all reader threads: pread has no file position) and the
    O_DIRECT decision per file, with its one warning."""

    def __init__(self, *, direct: bool = True, align: int = ALIGN, open_fn: OpenFn | None = None,
                 read_fn: ReadFn | None = None):
        self.align = align
        self.stats = ReaderStats(direct_io=direct, fallback_reason="" if direct else "buffered reads requested")
        self._want_direct = direct
        self._open = open_fn or os.open
        self._read = read_fn or _pread
        self._fds: dict[str, tuple[int, bool]] = {}
        self._retired: list[int] = []  # direct fds replaced mid-flight: other threads may still read from them
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # reads in progress: close() must not free a descriptor number a read still uses
        self._closed = False

    def _fd(self, path: str) -> tuple[int, bool]:
        with self._lock:
            if self._closed:
                raise ReadFault(path, "reader closed")
            if path in self._fds:
                return self._fds[path]
            try:
                if self._want_direct:
                    try:
                        self._fds[path] = (self._open(path, os.O_RDONLY | os.O_DIRECT), True)
                        return self._fds[path]
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        self._fell_back(path, f"open(O_DIRECT) refused: {e.strerror or e}")
                self._fds[path] = (self._open(path, os.O_RDONLY), False)
                return self._fds[path]
            except OSError as e:
                raise ReadFault(path, f"cannot open: {_describe(e)}") from e

    def _fell_back(self, path: str, reason: str) -> None:
        """Caller holds the lock. Warn once per DirectFiles: every shard of a model sits on the same mount."""
        if self.stats.direct_io:
            self.stats.direct_io, self.stats.fallback_reason = False, f"{path}: {reason}"
            warnings.warn(f"{path}: {reason}; reading through the page cache instead (slower, pollutes the cache)",
                          DirectIOUnavailable, stacklevel=4)

    def _refuse_direct(self, path: str, fd: int, reason: str) -> tuple[int, bool]:
        with self._lock:
            if self._fds.get(path) == (fd, True):  # the first thread to see EINVAL swaps the descriptor
                self._fell_back(path, reason)
                self._retired.append(fd)
                try:
                    self._fds[path] = (self._open(path, os.O_RDONLY), False)
                except OSError as e:
                    raise ReadFault(path, f"cannot reopen without O_DIRECT: {_describe(e)}") from e
            return self._fds[path]

    def read_into(self, path: str, offset: int, view: memoryview, required: int) -> int:
        """Fill `view` (aligned address and length) from the aligned `offset`; at least `required` bytes must
        arrive (the rest may lie past the end of the file). Raises ReadFault on a short read or an OS error."""
        with self._lock:
            self._busy += 1
        try:
            return self._read_into(path, offset, view, required)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def read_many(self, path: str, jobs: Sequence[tuple[int, memoryview, int]]) -> None:
        """`read_into` for each (offset, view, required) of one file, with the descriptor looked up and the counters
        updated once for all of them: an Engram prompt read is ~10^5 reads of one or two pages, and four lock
        rounds per read cost more host time than the read itself. A read that comes back short or fails goes
        through `_read_into` (retries, the O_DIRECT fallback, the error); its ReadFault carries `job`, the index
        of that read in `jobs`."""
        with self._lock:
            self._busy += 1
        try:
            fd = self._fd(path)[0]
            t0, chunks, got = time.perf_counter(), 0, 0
            for i, (offset, view, required) in enumerate(jobs):
                try:
                    n = self._read(fd, view, offset)
                except OSError:
                    n = -1
                if n >= required:
                    chunks, got = chunks + 1, got + n
                    continue
                try:
                    self._read_into(path, offset, view, required)
                except ReadFault as e:
                    e.job = i
                    raise
                fd = self._fd(path)[0]  # _read_into may have left O_DIRECT for this file
            with self._lock:
                self.stats.chunks += chunks
                self.stats.bytes_read += got
                self.stats.read_s += time.perf_counter() - t0
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def _read_into(self, path: str, offset: int, view: memoryview, required: int) -> int:
        fd, direct = self._fd(path)
        got, t0 = 0, time.perf_counter()
        while got < required:
            try:
                n = self._read(fd, view[got:], offset + got)
            except OSError as e:
                if e.errno == errno.EINVAL and direct:  # some file systems accept the open, refuse the read
                    fd, direct = self._refuse_direct(path, fd, f"O_DIRECT read refused: {e.strerror or e}")
                    continue
                raise ReadFault(path, f"{_describe(e)} reading {len(view) - got} bytes at offset {offset + got}") from e
            if n <= 0:
                break
            got += n
            if direct and got % self.align:  # an unaligned partial O_DIRECT read only happens at end of file
                break
        if got < required:
            raise ReadFault(path, f"short read: {got} of {required} bytes at offset {offset} (file truncated?)")
        with self._lock:
            self.stats.chunks += 1
            self.stats.bytes_read += got
            self.stats.read_s += time.perf_counter() - t0
        return got

    def close(self, wait_s: float = 5.0) -> None:
        """Close the descriptors once running reads are out. A read stuck past `wait_s` keeps them open (leaked):
        closing under it could let the number be reused by another open() and the read see a different file."""
        with self._lock:
            self._closed = True
            if not self._idle.wait_for(lambda: self._busy == 0, wait_s):
                logging.getLogger(__name__).warning("%d reads still running after %g s: descriptors left open",
                                                    self._busy, wait_s)
                return
            fds = [fd for fd, _ in self._fds.values()] + self._retired
            self._fds, self._retired = {}, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _describe(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    return f"{name} ({e.strerror})" if name and e.strerror else (name or str(e) or type(e).__name__)


@dataclasses.dataclass(eq=False)
class Span:
    """One aligned file range read into one aligned buffer. `need` bytes from `start` must arrive; `owners` name
    what they serve (for errors); `deliver(span)` runs once all chunks are in (copies pieces out)."""

    path: str
    start: int
    need: int
    buf: np.ndarray
    owners: list = dataclasses.field(default_factory=list)
    deliver: Callable[[Span], None] | None = None


def read_spans(pool: cf.Executor, files: DirectFiles, spans: Sequence[Span], chunk_bytes: int = CHUNK_BYTES,
               on_chunk: Callable[[int], None] | None = None) -> cf.Future:
    """Read every span as chunks on `pool`; the future resolves to None or the first ReadFault (with `owners`).
    After a failure the remaining chunks are skipped, not cancelled: they may already be running."""
    if chunk_bytes % files.align:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of the alignment {files.align}")
    done: cf.Future = cf.Future()
    done.set_running_or_notify_cancel()
    lock = threading.Lock()
    left = {id(s): -(-s.need // chunk_bytes) for s in spans}
    spans_left = [len(spans)]

    def settle(exc: BaseException | None) -> None:
        _settle(done, None, exc)

    def job(span: Span, lo: int) -> None:
        try:
            if done.done():
                return
            hi = min(lo + chunk_bytes, len(span.buf))
            files.read_into(span.path, span.start + lo, memoryview(span.buf)[lo:hi], min(hi, span.need) - lo)
            if on_chunk:
                on_chunk(hi - lo)
            with lock:
                left[id(span)] -= 1
                last = left[id(span)] == 0
            if last:
                if span.deliver:
                    span.deliver(span)
                with lock:
                    spans_left[0] -= 1
                    finished = spans_left[0] == 0
                if finished:
                    settle(None)
        except Exception as e:  # noqa: BLE001 - any failure must reach the waiter, never kill a worker silently
            fault = e if isinstance(e, ReadFault) else ReadFault(span.path, f"{type(e).__name__}: {e}")
            fault.owners = tuple(span.owners)
            settle(fault)

    if not spans:
        settle(None)
    try:
        for span in spans:
            for lo in range(0, span.need, chunk_bytes):
                pool.submit(job, span, lo)
    except RuntimeError as e:  # pool shut down
        settle(ReadFault(spans[0].path, f"reader closed: {e}"))
    return done


class ExpertReader:
    """A pool of reader threads serving whole experts. Thread-safe; `close()` (or `with`) releases threads and
    descriptors. `out`, when given, maps a key to where its bytes go (one uint8 buffer of `expert_nbytes`, or
    gate/up/down buffers): the slot cache and the stores pass their final host buffers so nothing is copied twice.
    """

    def __init__(self, layout: ExpertLayout, *, threads: int = 8, chunk_bytes: int = CHUNK_BYTES,
                 direct: bool = True, timeout_s: float = 30.0, align: int = ALIGN,
                 open_fn: OpenFn | None = None, read_fn: ReadFn | None = None):
        self.layout, self.chunk_bytes, self.timeout_s = layout, chunk_bytes, timeout_s
        self.files = DirectFiles(direct=direct, align=align, open_fn=open_fn, read_fn=read_fn)
        self.stats = self.files.stats
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="jds41-ssd")
        # Checksums (Orbax chunks) run on their own pool: hashing one expert takes as long as reading it, so a
        # request's experts are hashed in parallel, and a finishing request never waits on the reader threads.
        self._check_pool = (cf.ThreadPoolExecutor(threads, thread_name_prefix="jds41-check")
                            if layout.check is not None else None)
        self._pending: set[cf.Future] = set()  # unsettled requests: close() fails them so no waiter is left

    def submit(self, keys: Iterable[Key], out: dict | None = None) -> cf.Future:
        """Start reading; the future gives {key: uint8 gate|up|down} (for keys in `out`: the object given there)
        or raises ExpertReadError. Never blocks."""
        keys = list(dict.fromkeys((int(k[0]), int(k[1])) for k in keys))
        dests = {k: self._dests(k, (out or {}).get(k)) for k in keys}
        spans = self._spans(keys, dests)
        with self.files._lock:
            self.stats.requests += 1
            self.stats.bytes_useful += sum(self.layout.expert_nbytes(k[0]) for k in keys)
        result: cf.Future = cf.Future()
        result.set_running_or_notify_cancel()
        with self.files._lock:
            self._pending.add(result)

        def finish(f: cf.Future) -> None:
            with self.files._lock:
                self._pending.discard(result)
            exc = f.exception()
            if exc is None and self.layout.check is not None:  # an Orbax chunk checksum: bad bytes never pass
                exc = self._check(keys, dests)
            if exc is None:
                _settle(result, {k: dests[k][0] for k in keys})
                return
            with self.files._lock:
                self.stats.errors += 1
            layer, expert = (getattr(exc, "owners", ()) or keys)[0]
            reason = exc.reason if isinstance(exc, ReadFault) else f"{type(exc).__name__}: {exc}"
            error = ExpertReadError(getattr(exc, "path", "?"), layer, expert, reason)
            error.keys = tuple(getattr(exc, "owners", ()) or keys)
            _settle(result, exc=error)

        read_spans(self._pool, self.files, spans, self.chunk_bytes).add_done_callback(finish)
        return result

    def _check(self, keys: list[Key], dests: dict) -> ReadFault | None:
        def one(k: Key) -> str | None:
            try:
                return self.layout.check(k, dests[k][1])
            except Exception as e:  # noqa: BLE001 - the request must settle, never leave its waiter hanging
                return f"checking the bytes failed: {type(e).__name__}: {e}"

        try:
            reasons = list(self._check_pool.map(one, keys)) if len(keys) > 1 else [one(k) for k in keys]
        except RuntimeError as e:  # the check pool was shut down by close()
            return ReadFault(self.layout.pieces(keys[0])[0][0], f"reader closed: {e}", owners=(keys[0],))
        for k, why in zip(keys, reasons):
            if why:
                return ReadFault(self.layout.pieces(k)[0][0], why, owners=(k,))
        return None

    def read(self, keys: Iterable[Key], out: dict | None = None, timeout: float | None = None) -> dict:
        """Blocking read; raises ExpertReadError on a fault or when nothing came back within the timeout."""
        keys = list(keys)
        fut = self.submit(keys, out)
        timeout = self.timeout_s if timeout is None else timeout
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            # The chunks may still land later; they write only into this request's own buffers (or `out`,
            # which the caller must not reuse before the future settles: the slot cache keeps such slots busy).
            path = self.layout.pieces(keys[0])[0][0]
            raise ExpertReadError(path, *keys[0], f"no answer within {timeout:g} s ({len(keys)} experts)") from None

    def _dests(self, key: Key, given) -> tuple[object, list[np.ndarray]]:
        """(what the result maps the key to, per-piece destination views): a fresh array, or `given` itself."""
        sizes = [n for _, _, n in self.layout.pieces(key)]
        if given is None:
            whole = np.empty(sum(sizes), np.uint8)
            return whole, list(np.split(whole, np.cumsum(sizes)[:-1]))
        parts = [given] if isinstance(given, np.ndarray) else list(given)
        if not all(isinstance(p, np.ndarray) and p.flags.c_contiguous and p.flags.writeable for p in parts):
            raise ValueError(f"expert {key}: destinations must be writable C-contiguous numpy arrays")
        flat = [p.reshape(-1).view(np.uint8) for p in parts]  # views (contiguous): the bytes land in `given`
        if len(flat) == 1 and flat[0].size == sum(sizes):
            flat = list(np.split(flat[0], np.cumsum(sizes)[:-1]))
        if [f.size for f in flat] != sizes:
            raise ValueError(f"expert {key}: destinations hold {[f.size for f in flat]} bytes, needs {sizes}")
        return given, flat

    def _spans(self, keys: list[Key], dests: dict) -> list[Span]:
        """Aligned spans covering every piece; pieces whose aligned ranges touch or overlap share one span."""
        pieces = sorted((path, off, n, key, i)
                        for key in keys for i, (path, off, n) in enumerate(self.layout.pieces(key)))
        spans: list[Span] = []
        groups: list[list] = []
        for path, off, n, key, i in pieces:
            lo, hi = off - off % self.files.align, round_up(off + n, self.files.align)
            g = groups[-1] if groups else None
            if g and g[0] == path and lo <= g[2] and max(hi, g[2]) - g[1] <= MAX_SPAN_BYTES:
                g[2] = max(g[2], hi)
                g[3].append((off, n, key, i))
            else:
                groups.append([path, lo, hi, [(off, n, key, i)]])
        for path, lo, _, items in groups:
            need = max(off + n for off, n, _, _ in items) - lo

            def deliver(span: Span, items=items) -> None:
                for off, n, key, i in items:
                    dests[key][1][i][:] = span.buf[off - span.start:off - span.start + n]

            owners = list(dict.fromkeys(key for _, _, key, _ in items))
            spans.append(Span(path, lo, need, aligned_empty(round_up(need, self.files.align), self.files.align),
                              owners, deliver))
        return spans

    def close(self) -> None:
        # Running chunks finish (a thread cannot be interrupted mid-read); queued ones are dropped, and the
        # requests they belonged to fail now instead of leaving their waiters to time out.
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=False, cancel_futures=True)
        with self.files._lock:
            pending, self._pending = list(self._pending), set()
        for fut in pending:
            _settle(fut, exc=ExpertReadError("?", -1, -1, "reader closed before the read finished"))
        self.files.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
