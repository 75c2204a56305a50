"""The persistent compilation cache of `generate` and `serve` (jds41/compile_cache.py): a second run loads the
programs the first one compiled, and its tokens are the first run's; 'off' leaves JAX's cache alone.

Each run is its own process (the cache directory is process-wide JAX state), with the test session's own cache
setting removed from its environment so the command's default is what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jds41.compile_cache import OFF, enable_compile_cache

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "checkpoints" / "tiny-deepseek41-q8.gguf"


def _generate(env: dict, *extra: str) -> tuple[list[int], str]:
    cmd = [sys.executable, "-m", "jds41.generate", str(MODEL), "--tokens", "5,6,7,8", "-n", "4", "--json", *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens"], done.stderr


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.glob("*-cache")} if path.exists() else set()


@pytest.mark.slow  # two cold subprocess runs (~100 s on 2 cores)
def test_a_second_run_loads_the_first_runs_programs_and_gives_its_tokens(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_LOG_COMPILES="1", PYTHONPATH=str(ROOT))
    default = tmp_path / "xdg" / "jds41" / "xla"  # the default place, under $XDG_CACHE_HOME

    first, _ = _generate(env)
    written = _entries(default)
    assert written, "the first run kept no compiled program in the default directory"

    again, log = _generate(env, "--compile-cache", str(default))
    assert again == first
    assert _entries(default) == written  # nothing compiled anew that the first run had kept
    assert "Persistent compilation cache hit" in log

    off, _ = _generate({**env, "XDG_CACHE_HOME": str(tmp_path / "xdg-off")}, "--compile-cache", OFF)
    # no XLA cache anywhere under the cache home (it may hold jds41/native: the Engram handler's built library)
    assert off == first and not list((tmp_path / "xdg-off").glob("**/xla"))


def test_off_and_a_users_directory_are_left_as_they_are():
    before = jax.config.jax_compilation_cache_dir  # the test session's cache (tests/conftest.py)
    assert enable_compile_cache(OFF) is None
    assert jax.config.jax_compilation_cache_dir == before
    if before:  # set from the environment, as a user's $JAX_COMPILATION_CACHE_DIR would be
        assert enable_compile_cache(None) == before and jax.config.jax_compilation_cache_dir == before


def test_serve_takes_the_same_option(tmp_path):
    from jds41.serve.__main__ import parse

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # parse only checks that it exists
    assert parse([str(model)])[1].compile_cache is None
    assert parse([str(model), "--compile-cache", OFF])[1].compile_cache == OFF
    assert parse([str(model), "--compile-cache", str(tmp_path / "c")])[1].compile_cache == str(tmp_path / "c")
