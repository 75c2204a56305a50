"""Loading the model in a background thread while the server already answers, with progress for /health.

Phases, in order: `starting`, `validating` (headers and tensor directory: a bad file fails here, in milliseconds),
`reading` (every byte of every shard once, which is what gives `bytes_done` / `bytes_total`), `building` (the
engine: parameters, tokenizer, plan), `compiling` (the scheduler's warm-up: every program a request runs), then
`ready`, or `failed` with the error message.

The read pass pulls the file through the page cache before the engine maps it. With the all-hbm profile the
engine reads every tensor anyway, so this costs nothing extra and turns an opaque load into measured progress. A
tiered profile skips it: its loader reads only the resident tensors and the HBM and host tiers, with O_DIRECT
around the page cache, and a pass over a file larger than host memory would read the SSD tier for nothing.

jax and the engine are imported in the thread: the port binds before a second of import time is spent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from jds41.errors import Jds41Error
from jds41.serve import DEFAULT_PROFILE, ServeOptions

log = logging.getLogger("jds41.serve")

READ_CHUNK = 16 << 20
PHASES = ("starting", "validating", "reading", "building", "compiling", "ready", "failed")


class ModelLoader:
    """Owns the engine and the scheduler once they exist. `on_failure(message)` runs in the loader thread."""

    def __init__(self, path: str, options: ServeOptions, on_failure: Callable[[str], None] | None = None):
        self.path, self.options, self.on_failure = path, options, on_failure
        self.phase = "starting"
        self.bytes_done = 0
        self.bytes_total = 0
        self.error: str | None = None
        self.engine: Any = None
        self.scheduler: Any = None
        self.started_at = time.time()
        self.ready_at: float | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- state for /health and /metrics -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def fraction(self) -> float:
        """0..1 for the jds41:model_load_progress gauge: reading counts for most of a real model's load."""
        if self.ready:
            return 1.0
        if self.phase in ("building", "compiling"):
            return 0.95
        return 0.9 * self.bytes_done / self.bytes_total if self.bytes_total else 0.0

    def progress(self) -> dict:
        out = {"phase": self.phase, "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
               "progress": round(self.fraction, 4), "elapsed_s": round(time.time() - self.started_at, 3)}
        if self.error is not None:
            out["error"] = self.error
        return out

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        # A daemon thread: Ctrl-C during a long load must not wait for the load to finish.
        self._thread = threading.Thread(target=self._run, name="jds41-loader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self.scheduler is not None:
            self.scheduler.stop()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._load()
        except Jds41Error as e:  # ModelFileError names the file and the tensor: the message is the report
            self._fail(str(e))
        except Exception as e:  # a bug or an accelerator failure; still a clean exit, not a hang
            log.exception("model load failed")
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        self.error, self.phase = message, "failed"
        if self.on_failure is not None:
            self.on_failure(message)

    def _load(self) -> None:
        self.phase = "validating"  # importing the reader (numpy, gguf) is part of it: a second or two
        from jds41.checkpoints import open_model

        with open_model(self.path) as model:
            shards = [(s.path, s.size) for s in model.shards]
        self.bytes_total = sum(size for _, size in shards)
        # all-hbm is the resident model itself (no tier table in the graph); any other profile places the experts
        resident = self.options.profile == DEFAULT_PROFILE
        self.phase = "reading"
        if self.options.load_delay_s > 0:
            self._stopping.wait(self.options.load_delay_s)
        if resident:  # module docstring: a tiered profile skips the read pass
            for path, _ in shards:
                self._read(path)
        if self._stopping.is_set():
            return

        self.phase = "building"
        from jds41.engine import Engine
        from jds41.scheduler import Scheduler

        o = self.options
        engine = Engine.open(self.path, max_ctx=o.ctx, prefill_chunk=o.prefill_chunk, decode_width=o.decode_width,
                             prompt_width=o.prompt_width,
                             prefix_cache_bytes=o.prefix_cache_bytes, prefix_cache_dir=o.prefix_cache_dir,
                             profile=None if resident else o.profile, numerics=o.numerics)
        drafter = None
        if o.draft is not None:
            from jds41.speculative import DSparkDrafter

            drafter = DSparkDrafter.open(engine, o.draft)
        scheduler = Scheduler(engine, n_slots=self.options.slots, max_queue=self.options.max_queue, drafter=drafter,
                              prefill_budget=self.options.prefill_budget)
        if self.options.warmup:
            self.phase = "compiling"  # every program a request runs, so the first client does not wait for XLA
            scheduler.warmup()
        if self._stopping.is_set():  # the server shut down while this thread compiled
            return
        scheduler.start()
        self.engine, self.scheduler = engine, scheduler
        self.ready_at = time.time()
        self.phase = "ready"
        log.info("model ready in %.1f s: %s (ctx %d, %d slots)", self.ready_at - self.started_at, self.path,
                 engine.max_ctx, self.options.slots)

    def _read(self, path: str) -> None:
        buf = bytearray(READ_CHUNK)
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while not self._stopping.is_set():
                n = f.readinto(buf)
                if not n:
                    return
                self.bytes_done += n
