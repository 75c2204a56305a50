"""`import jds41` adds its default XLA flags to XLA_FLAGS (jds41/__init__.py) and never overrides one the user set;
JAX still starts its backend with them."""
import os
import platform
import subprocess
import sys

import pytest

_PRINT_FLAGS = ("import os, jds41, jax, jax.numpy as jnp; "
                "assert float(jnp.arange(4.0).sum()) == 6.0; print(os.environ['XLA_FLAGS'])")


def _flags_after_import(xla_flags: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", _PRINT_FLAGS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split()


def test_defaults_are_added_when_the_user_sets_none():
    flags = _flags_after_import(None)
    assert "--xla_gpu_autotune_level=0" in flags
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "--xla_cpu_max_isa=AVX2" in flags
    assert len(flags) == len(set(flags))


@pytest.mark.parametrize("theirs", ["--xla_gpu_autotune_level=4",
                                    "--xla_gpu_autotune_level=4 --xla_cpu_max_isa=SSE4_2"])
def test_a_flag_the_user_set_is_kept_and_not_repeated(theirs):
    flags = _flags_after_import(theirs)
    assert flags[:len(theirs.split())] == theirs.split()  # theirs first, unchanged
    assert sum(f.startswith("--xla_gpu_autotune_level=") for f in flags) == 1
    assert sum(f.startswith("--xla_cpu_max_isa=") for f in flags) <= 1
