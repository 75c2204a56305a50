"""The persistent XLA compilation cache that `serve` and `generate` keep across restarts.

Compiling is most of the time to ready: the V4-Flash 8-layer wide prefill program took 139 s to compile on the H200
(experiments/results/bench_prefill_matrix_v4_8L_h200.jsonl, `compile_s`), and a server compiles its programs before
/health turns 200. With this cache a restart loads them from disk instead. JAX keys every entry on the program, the
compile options, the XLA flags, the jax/jaxlib versions and the device kind, so what it loads is the executable a
compile would have produced: tokens do not depend on the cache (tests/test_compile_cache.py).

`where`: a directory, "off", or None for the default: $JAX_COMPILATION_CACHE_DIR when the user set it, else
$XDG_CACHE_HOME/jds41/xla (~/.cache/jds41/xla). The cache is bounded (DEFAULT_MAX_BYTES, least recently used entries
go first); programs that compile in under a second are not kept (JAX's default threshold).
"""

from __future__ import annotations

import os

import jax

DEFAULT_MAX_BYTES = 8 << 30
OFF = "off"


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jds41", "xla")


def enable_compile_cache(where: str | None = None) -> str | None:
    """Point JAX's persistent cache at `where` (module docstring) before anything compiles; returns the directory,
    or None when turned off. A directory that cannot be made is an error, not a silent fallback."""
    if where == OFF:
        return None
    if where is None and jax.config.jax_compilation_cache_dir:  # set by the user ($JAX_COMPILATION_CACHE_DIR)
        return jax.config.jax_compilation_cache_dir
    path = os.path.abspath(os.path.expanduser(where or default_dir()))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if jax.config.jax_compilation_cache_max_size < 0:  # JAX's default is unbounded
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
    return path
