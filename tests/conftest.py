"""Test-suite policy for the markers of pyproject.toml: what runs where, and what may be skipped.

- `gpu`: skipped (with the reason shown by `-ra`) on a machine where JAX sees no GPU; CI machines have none, GPU
  results are committed under experiments/results/ instead.
- `llamacpp`: needs llama-cpp-python 0.3.36 built from source (`.ci/run` installs it). Without it a developer's
  run skips these tests with the reason; under CI=true a missing llama_cpp is a FAILURE, never a silent skip.
- `slow`: left out of the README's default run (`-m "not slow"`); CI runs them right after it.

Compiled programs are shared: unless JAX_COMPILATION_CACHE_DIR is already set (`.ci/run` sets one for its whole
run), the first pytest process of a run points JAX's persistent compilation cache at a fresh temporary directory,
and the pytest-xdist workers it starts inherit it. Most tests build the same tiny models, so most of their XLA
programs compile once per run instead of once per process; on 2 cores compiling is most of the suite's time.
A cached program is the same executable (the key covers the HLO, the compile options, XLA_FLAGS and the jax
version), so the cache changes no result; tests that count compilations count cache hits as well.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@functools.cache
def _has_gpu() -> bool:
    import jax  # only imported when a gpu-marked test was collected

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # "Unknown backend gpu" / no devices of that platform
        return False


_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE: list[str] = []  # the directory this process made (and removes at the end), if it made one


def pytest_configure(config):
    if not os.environ.get(_CACHE_ENV):
        _OWN_CACHE.append(tempfile.mkdtemp(prefix="jds41-xla-cache-"))
        os.environ[_CACHE_ENV] = _OWN_CACHE[0]
    # Programs of a few milliseconds are worth caching too: the suite compiles thousands of them.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "jax" in sys.modules:  # a plugin imported jax before us: its flags already read the environment
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="gpu: JAX sees no GPU on this machine")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def pytest_runtest_setup(item):
    if item.get_closest_marker("llamacpp") and importlib.util.find_spec("llama_cpp") is None:
        msg = "llamacpp: llama_cpp is not importable (install llama-cpp-python==0.3.36 from source, see .ci/run)"
        if under_ci():
            pytest.fail(msg + "; CI=true, so this is a failure, not a skip", pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def synthetic_model(tmp_path_factory):
    """`synthetic_model(arch, size, quant="f32", seed=0, draft_stages=0)` -> path of a synthetic GGUF (with that many
    DSpark draft stages), written once per session."""
    from jds41.checkpoints.presets import preset
    from jds41.checkpoints.synth import write_synthetic

    root = tmp_path_factory.mktemp("models")
    cache: dict = {}

    def make(arch: str, size: str, quant: str = "f32", seed: int = 0, draft_stages: int = 0):
        key = (arch, size, quant, seed, draft_stages)
        if key not in cache:
            path = root / f"{arch}-{size}-{quant}-{seed}{f'-d{draft_stages}' if draft_stages else ''}.gguf"
            write_synthetic(path, preset(arch, size, draft_stages=draft_stages), quant=quant, seed=seed,
                            progress=False)
            cache[key] = path
        return cache[key]

    return make
