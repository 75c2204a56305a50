"""The Engram host call as an XLA FFI handler (engram_ffi.cc): build, load, register, call.

A decode or verify step of a V4.1 model needs the Engram rows of the tokens it feeds, which depend on the previous
step's output, so the host is entered once per step. As a Python `io_callback` that cost 0.7-1.4 ms of device idle
per token on the H200 (experiments/README.md); DESIGN.md §4 names an FFI handler compiled at install time as the
alternative (1-5 us of call overhead on the CPU). This module compiles the handler the first time it is needed
(the C++ compiler `c++`, XLA's FFI headers from jaxlib; the library is cached by a hash of its source and of those
headers), registers it for the CPU and, where JAX has one, the CUDA platform, and gives each engine a context that
holds its hash parameters and where its tables are: in memory (the GGUF's mmap or a host copy, `MmapRowSource`) or
in the file, read with O_DIRECT behind the handler's own row cache (`SsdRowSource`'s layout and cache size).

Where the handler cannot be built or a row source is of another kind, `engram_ffi_for` returns None and the step
keeps the Python callback; it also keeps it, by measurement, for an SSD expert tier with hash layers (its
docstring); `JDS41_ENGRAM_HOST=callback` asks for the callback everywhere, `=ffi` for the handler wherever it can.
Measured on the H200 (V4.1, 4 layers, experiments/README.md): decode 514 against 348 tok/s resident, 312 against
214 in the h200 profile, the same predictions.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jds41.layers.engram_rows import EngramHasher, MmapRowSource

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("engram_ffi.cc")
TARGET = "jds41_engram_rows"
ENV_CHOICE = "JDS41_ENGRAM_HOST"  # "auto" (default), "ffi" or "callback": engram_ffi_for
ENV_DIR = "JDS41_NATIVE_DIR"  # where built libraries are cached (default ~/.cache/jds41/native)
ENV_LIB = "JDS41_ENGRAM_FFI_LIB"  # a library built elsewhere, used as is (a machine without a compiler)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


class NativeBuildError(RuntimeError):
    pass


def _cache_dir() -> Path:
    where = os.environ.get(ENV_DIR)
    if where:
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jds41" / "native"


def library_path() -> Path:
    """The built library's path: named by a hash of the source and of XLA's FFI headers it compiles against."""
    include = Path(jax.ffi.include_dir())
    digest = hashlib.sha256(SOURCE.read_bytes())
    for header in sorted((include / "xla" / "ffi" / "api").glob("*.h")):
        digest.update(header.read_bytes())
    return _cache_dir() / f"engram_ffi-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile engram_ffi.cc unless a library of this source and these headers is cached; returns its path."""
    if os.environ.get(ENV_LIB):
        return Path(os.environ[ENV_LIB])
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread",
           f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp, "-ldl"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise NativeBuildError(f"cannot run the C++ compiler ({cmd[0]}): {e}") from None
    if done.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: a concurrent builder's library is the same bytes
    return out


def load() -> ctypes.CDLL:
    """The library, built and registered with XLA once per process (raises NativeBuildError when it cannot be)."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise NativeBuildError(_lib_error)
        try:
            lib = ctypes.CDLL(str(build()))
        except (NativeBuildError, OSError) as e:
            _lib_error = str(e)
            raise NativeBuildError(_lib_error) from None
        _declare(lib)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.Jds41EngramRowsCpu), platform="cpu")
        if any(d.platform == "gpu" for d in jax.devices()):
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.Jds41EngramRowsCuda), platform="CUDA")
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.jds41_engram_last_error.restype = ctypes.c_char_p
    lib.jds41_engram_new.restype = i64
    lib.jds41_engram_new.argtypes = [i32, i32, i32, i32, i32, p, i64, ctypes.c_uint64, p, p, p]
    lib.jds41_engram_table_memory.argtypes = [i64, i32, p, i64]
    lib.jds41_engram_table_file.argtypes = [i64, i32, ctypes.c_char_p, i64, i64, i32]
    lib.jds41_engram_readers.argtypes = [i64, i64, i32]
    lib.jds41_engram_counters.argtypes = [i64, p]
    lib.jds41_engram_rows_host.argtypes = [i64, p, i32, p, i32, p, i64]
    lib.jds41_engram_row_ids.argtypes = [i64, p, i32, p, i32, p]
    lib.jds41_engram_feed_on.argtypes = [i64]
    lib.jds41_engram_feed_wait.argtypes = [i64, p, i32, i32]
    lib.jds41_engram_feed_close.argtypes = [i64]
    lib.jds41_engram_free.argtypes = [i64]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class EngramFfi:
    """One engine's handler context; calling it inside jit gives the rows of a block of tokens.

    `self(block [T] int32, hist [n-1] int32 (-1 = none, newest last), n_hist int32)` -> uint8
    [T, n_layers, n_buckets, row_bytes], exactly `read_step_rows(source, hasher.row_ids_seq(block, history))`.
    Memory tables must stay alive as long as this object: it keeps a reference to `source`. `source=None` makes a
    context that only hashes (`row_ids`).
    """

    def __init__(self, hasher: EngramHasher, source, lib: ctypes.CDLL | None = None, prefetch=None):
        from jds41.tiers.engram_store import SsdRowSource

        self.lib = lib or load()
        self.ctx = 0
        self._feed_thread = None
        self.source = source
        e = hasher.ecfg
        self.shape = (len(e.layer_ids), e.n_buckets, e.row_bytes)
        self._arrays = [np.ascontiguousarray(a) for a in (
            hasher.token_map.astype(np.uint64), hasher.mult.astype(np.uint64), hasher.primes.astype(np.uint64),
            hasher.offsets.astype(np.int64))]
        tmap, mult, primes, offsets = self._arrays
        self.ctx = int(self.lib.jds41_engram_new(len(e.layer_ids), e.n_buckets, e.max_ngram, e.n_heads, e.row_bytes,
                                                 _ptr(tmap), tmap.size, int(hasher.pad_cid), _ptr(mult),
                                                 _ptr(primes), _ptr(offsets)))
        if source is None:  # hash only (row_ids): no tables
            return
        if isinstance(source, MmapRowSource):
            for slot, table in enumerate(source.tables):
                if not table.flags.c_contiguous:  # a copy of a 100 GB table is never what anyone wants
                    raise ValueError(f"Engram table {slot} is not contiguous in memory")
                self._check(self.lib.jds41_engram_table_memory(self.ctx, slot, _ptr(table), table.shape[0]))
        elif isinstance(source, SsdRowSource) and source.reads_files:
            for slot, (path, offset, rows) in enumerate(source.tables):
                self._check(self.lib.jds41_engram_table_file(self.ctx, slot, str(path).encode(), offset, rows,
                                                             int(source.files.stats.direct_io)))
            self.lib.jds41_engram_readers(self.ctx, source.cache_keys.size, source.pool._max_workers)
        else:
            self.close()
            raise TypeError(f"no FFI form for an Engram row source of type {type(source).__name__}")
        if prefetch is not None:
            self.lib.jds41_engram_feed_on(self.ctx)
            # the thread holds the library and the context id, not this object, so dropping it still closes it
            self._feed_thread = threading.Thread(target=_feed, args=(self.lib, self.ctx, prefetch), daemon=True,
                                                 name="jds41-engram-prefetch")
            self._feed_thread.start()

    def _check(self, rc: int) -> None:
        if rc != 0:
            msg = self.lib.jds41_engram_last_error().decode() or "bad Engram table"
            self.close()
            raise ValueError(msg)

    def __call__(self, block, hist, n_hist):
        out = jax.ShapeDtypeStruct((block.shape[0], *self.shape), jnp.uint8)
        return jax.ffi.ffi_call(TARGET, out, has_side_effect=True)(
            block.astype(jnp.int32), hist.astype(jnp.int32), jnp.asarray(n_hist, jnp.int32).reshape(1),
            context_id=np.int64(self.ctx))

    def host_rows(self, block, history) -> np.ndarray:
        """The handler's rows computed straight from Python (no XLA): for tests and diagnostics."""
        blk = np.ascontiguousarray(block, np.int32)
        hist = np.ascontiguousarray(history, np.int32)
        out = np.empty((blk.size, *self.shape), np.uint8)
        if self.lib.jds41_engram_rows_host(self.ctx, _ptr(blk), blk.size, _ptr(hist), hist.size, _ptr(out),
                                           out.nbytes):
            raise ValueError(self.lib.jds41_engram_last_error().decode())
        return out

    def row_ids(self, block, history) -> np.ndarray:
        """The handler's hash alone: int64 [T, n_layers, n_buckets], as EngramHasher.row_ids_seq gives them."""
        blk = np.ascontiguousarray(block, np.int32)
        hist = np.ascontiguousarray(history, np.int32)
        out = np.empty((blk.size, *self.shape[:2]), np.int64)
        if self.lib.jds41_engram_row_ids(self.ctx, _ptr(blk), blk.size, _ptr(hist), hist.size, _ptr(out)):
            raise ValueError(self.lib.jds41_engram_last_error().decode())
        return out

    def counters(self) -> dict:
        c = np.zeros(4, np.int64)
        self.lib.jds41_engram_counters(self.ctx, _ptr(c))
        return dict(zip(("calls", "rows_requested", "rows_read", "cache_hits"), map(int, c), strict=True))

    def close(self) -> None:
        if self.ctx:
            self.lib.jds41_engram_feed_close(self.ctx)
            if self._feed_thread is not None and self._feed_thread is not threading.current_thread():
                self._feed_thread.join()
            self.lib.jds41_engram_free(self.ctx)
            self.ctx = 0

    def __del__(self):
        self.close()


def _feed(lib: ctypes.CDLL, ctx: int, prefetch) -> None:
    """The prefetch thread: every token id the handler is called with goes to `prefetch` (a list of ids), on this
    thread, while the step goes on. A prefetch only starts reads, so its timing never changes a value."""
    buf = np.empty(256, np.int32)
    while True:
        n = lib.jds41_engram_feed_wait(ctx, _ptr(buf), buf.size, 200)
        if n < 0:
            return
        if n:
            try:
                prefetch(buf[:n].tolist())
            except Exception:  # noqa: BLE001 - a failed prefetch is a later miss, which reports its error
                log.exception("Engram token feed: prefetch failed")


def engram_ffi_for(engine) -> EngramFfi | None:
    """The handler for `engine`'s Engram tables, or None where the step keeps its Python callback.

    JDS41_ENGRAM_HOST: "callback" always the callback; "ffi" the handler wherever it can be built and has a form
    for the row source; unset ("auto") the same, except for an SSD expert tier with hash layers. There the
    callback also starts the fed tokens' hash-layer expert reads before the step, and the handler hands the ids to
    a thread instead (the token feed), which starts them later. That case has not been measured: the lucebox A/B
    once cited for it (V4.1 4 layers, handler 23.6 / 27.1 tok/s against the callback's 28.6 / 28.4,
    experiments/results/bench_decode_engram_ffi_lucebox_*) ran a file with no hash layer, so no feed, and the
    same code's lucebox rows later ranged 23.3-32.1 tok/s from call to call (bench_decode_final_* and
    bench_decode_warmfix_*): within that spread. The callback stays there until a file with hash layers on an
    SSD tier is timed both ways.
    """
    choice = os.environ.get(ENV_CHOICE, "auto")
    if engine.engram is None or choice == "callback":
        return None
    tiers = engine.tiers
    prefetch = None
    if tiers is not None and tiers.stores.ssd is not None and tiers.hash_tables:
        if choice != "ffi":
            return None
        prefetch = tiers.prefetch_tokens
    try:
        return EngramFfi(*engine.engram, prefetch=prefetch)
    except (NativeBuildError, TypeError) as e:
        log.warning("Engram rows stay a Python callback: %s", e)
        return None
