"""llama.cpp as the outside oracle: logits and greedy tokens of a GGUF file, computed by llama-cpp-python 0.3.36.

Owns the test-side API; the work runs in `tests/llamacpp_worker.py` in a subprocess, because llama.cpp aborts the
process on many bad files (LLAMACPP_DEEPSEEK4.md §7). Results come back through .npy/.json files in a temp dir.

    logits(path, tokens)            -> float32 [T, V]: the whole prompt in one batch (prefill path)
    logits(path, tokens, chunk=1)   -> float32 [T, V]: one token per decode call (decode path)
    greedy(path, prompt, n_new)     -> GreedyResult: argmax continuation, token ids and every position's logits

A rejected or aborted file raises `LlamaCppError` carrying the exit status and the tail of llama.cpp's log.
Tests that use it carry the `llamacpp` marker, whose skip/fail rule lives in `tests/conftest.py` (skip locally
without llama_cpp, fail under CI=true).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("llamacpp_worker.py")
LLAMACPP_VERSION = "0.3.36"  # the vendored llama.cpp that LLAMACPP_DEEPSEEK4.md describes
STDERR_TAIL_CHARS = 4000
REASON = re.compile(r"GGML_ASSERT|error|failed|llamacpp_worker:|Traceback", re.IGNORECASE)


class LlamaCppError(RuntimeError):
    """llama.cpp rejected the file or the run: `returncode` (negative = killed by that signal), `stderr_tail`."""

    def __init__(self, path: str | os.PathLike, returncode: int | None, stderr: str, what: str):
        self.path = str(path)
        self.returncode = returncode
        self.stderr_tail = stderr[-STDERR_TAIL_CHARS:]
        # The lines that say why (load errors, asserts, our worker's own message), wherever they are in the log.
        self.reasons = [ln.strip() for ln in stderr.splitlines() if REASON.search(ln)][-8:]
        if returncode is None:
            status = "timed out"
        elif returncode < 0:
            try:
                status = f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                status = f"killed by signal {-returncode}"
        else:
            status = f"exit status {returncode}"
        why = "".join(f"\n  {r}" for r in self.reasons)
        super().__init__(f"llama.cpp: {what} failed on {self.path} ({status}){why}\nstderr tail:\n{self.stderr_tail}")


@dataclasses.dataclass(frozen=True)
class GreedyResult:
    tokens: list[int]  # the n_new generated ids
    logits: np.ndarray  # float32 [T + n_new, V]: row i = logits after feeding position i of prompt + tokens


def logits(path: str | os.PathLike, tokens: Sequence[int], *, chunk: int = 0, n_ctx: int = 0,
           n_threads: int = 2, timeout: float = 600.0) -> np.ndarray:
    """Logits of every position, float32 [T, V]. chunk=0: one batch; chunk=k: k tokens per decode call."""
    out, _ = _run(path, tokens, n_new=0, chunk=chunk, n_ctx=n_ctx, n_threads=n_threads, timeout=timeout)
    return out


def greedy(path: str | os.PathLike, prompt: Sequence[int], n_new: int, *, chunk: int = 0, n_ctx: int = 0,
           n_threads: int = 2, timeout: float = 600.0) -> GreedyResult:
    """Prompt in one batch (or `chunk`-token calls), then n_new argmax tokens one decode call each."""
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    out, meta = _run(path, prompt, n_new=n_new, chunk=chunk, n_ctx=n_ctx, n_threads=n_threads, timeout=timeout)
    return GreedyResult(tokens=[int(t) for t in meta["greedy"]], logits=out)


def _run(path, tokens, *, n_new: int, chunk: int, n_ctx: int, n_threads: int, timeout: float):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("at least one token is needed")
    with tempfile.TemporaryDirectory(prefix="jds41-llamacpp-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps({"model": str(path.resolve()), "tokens": tokens, "n_new": n_new, "chunk": chunk,
                                   "n_ctx": n_ctx, "n_threads": n_threads, "out_dir": tmp}))
        # No gdb backtrace on abort: it would bury the GGML_ASSERT line under pages of frames.
        env = dict(os.environ, OMP_NUM_THREADS=str(n_threads), GGML_NO_BACKTRACE="1")
        try:
            proc = subprocess.run([sys.executable, str(WORKER), str(req)], check=False, capture_output=True,
                                  text=True, errors="replace", timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise LlamaCppError(path, None, err, f"evaluation within {timeout:.0f} s") from None
        stderr = proc.stderr + (proc.stdout or "")
        if proc.returncode != 0:
            raise LlamaCppError(path, proc.returncode, stderr, _stage(proc.returncode))
        out_file, meta_file = Path(tmp) / "logits.npy", Path(tmp) / "result.json"
        if not out_file.is_file() or not meta_file.is_file():
            raise LlamaCppError(path, proc.returncode, stderr, "evaluation (no result files written)")
        out = np.load(out_file)
        meta = json.loads(meta_file.read_text())
    expect = (len(tokens) + n_new, meta["n_vocab"])
    if out.shape != expect or out.dtype != np.float32:
        raise LlamaCppError(path, 0, stderr, f"evaluation (got {out.dtype}{out.shape}, expected float32{expect})")
    return out, meta


def _stage(rc: int) -> str:
    return {1: "import or run", 2: "request", 3: "model load", 4: "context creation", 5: "decode"}.get(rc, "run")
