"""One token's attention as two Triton launches (jds41/layers/attention_kernel.py), opt-in with JDS41_ATTN_KERNEL=1.

On every machine: the kernels in Pallas' interpreter against `attention.attend_xla` (the reference) and a float64
numpy re-derivation, over key counts that are not whole chunks, masked keys, a query whose keys are all masked
(the sink alone), head counts that are not whole head blocks; a row's output does not depend on the rows around it
(vmapped, permuted). Lowered for CUDA with the switch on, `attend` is the two Triton calls; for the CPU, or with the
switch off, it is not. On a GPU (marker `gpu`): the compiled kernels against the XLA spelling, and one row against
the same row in a vmapped block.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.layers import attention, attention_kernel
from jds41.layers.attention_kernel import attend_kernels

TRITON_CALL = "__gpu$xla.gpu.triton"


def _case(heads: int, kdim: int, n: int, seed: int = 0, masked: float = 0.2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, kdim)).astype(np.float32)
    keys = rng.standard_normal((n, kdim)).astype(np.float32)
    valid = rng.random(n) >= masked
    sink = (rng.standard_normal(heads) * 2).astype(np.float32)
    return q, keys, valid, sink


def _cfg(kdim: int):
    return types.SimpleNamespace(head_dim=kdim)


def _numpy_attend(q, keys, valid, sink):
    """attention.py's module docstring in float64: softmax over the valid keys with the sink in the denominator."""
    s = q.astype(np.float64) @ keys.astype(np.float64).T / np.sqrt(q.shape[1])
    s = np.where(valid[None, :], s, -np.inf)
    top = np.maximum(s.max(axis=1), sink)
    e = np.exp(s - top[:, None])
    return (e / (e.sum(axis=1) + np.exp(sink - top))[:, None]) @ keys.astype(np.float64)


@pytest.mark.parametrize("heads,kdim,n", [(2, 32, 45), (20, 64, 96), (64, 512, 70)])
def test_the_interpreted_kernels_equal_the_reference(heads, kdim, n):
    q, keys, valid, sink = _case(heads, kdim, n)
    got = np.asarray(attend_kernels(q, keys, valid, sink, kdim ** -0.5, interpret=True))
    want = np.asarray(jax.jit(lambda *a: attention.attend_xla(_cfg(kdim), sink, *a))(q, keys, valid))
    assert got.shape == (heads, kdim)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_allclose(got, _numpy_attend(q, keys, valid, sink), rtol=0, atol=2e-6 * np.abs(want).max())
    assert not np.array_equal(got, np.asarray(attend_kernels(q, keys, ~valid, sink, kdim ** -0.5, interpret=True)))


def test_a_query_with_every_key_masked_reads_the_sink_alone():
    q, keys, _, sink = _case(3, 32, 40, seed=1)
    none = np.zeros(40, bool)
    got = np.asarray(attend_kernels(q, keys, none, sink, 32 ** -0.5, interpret=True))
    want = np.asarray(attention.attend_xla(_cfg(32), sink, q, keys, none))
    np.testing.assert_array_equal(got, np.zeros_like(got))
    np.testing.assert_array_equal(want, np.zeros_like(want))
    # one live key in the last, partial chunk: its latent weighted by its share against the sink
    one = none.copy()
    one[-1] = True
    got = np.asarray(attend_kernels(q, keys, one, sink, 32 ** -0.5, interpret=True))
    np.testing.assert_allclose(got, _numpy_attend(q, keys, one, sink), rtol=2e-6, atol=1e-7)


def test_a_rows_output_does_not_depend_on_the_rows_around_it():
    rows = [_case(2, 32, 45, seed=s) for s in range(4)]
    q, keys, valid = (np.stack([r[i] for r in rows]) for i in range(3))
    sink = rows[0][3]
    run = lambda q, k, v: attend_kernels(q, k, v, sink, 32 ** -0.5, interpret=True)  # noqa: E731
    block = np.asarray(jax.vmap(run)(q, keys, valid))
    for r in (0, 3):
        np.testing.assert_array_equal(np.asarray(run(q[r], keys[r], valid[r])), block[r])
    perm = np.array([2, 0, 3, 1])
    np.testing.assert_array_equal(np.asarray(jax.vmap(run)(q[perm], keys[perm], valid[perm])), block[perm])


def test_attend_lowers_to_the_kernels_on_cuda_only_when_switched_on(monkeypatch):
    cfg = _cfg(32)
    w = {"attn_sinks": jnp.zeros(2, jnp.float32)}
    shapes = (jax.ShapeDtypeStruct((2, 32), jnp.float32), jax.ShapeDtypeStruct((45, 32), jnp.float32),
              jax.ShapeDtypeStruct((45,), jnp.bool_))

    def calls(platform):  # a new function each time: jit's trace cache would keep the first switch's graph
        fn = lambda q, k, v: attention.attend(cfg, w, q, k, v)  # noqa: E731
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text().count(TRITON_CALL)

    monkeypatch.setattr(attention_kernel.triton_matvec, "INTERPRET", False)
    monkeypatch.setattr(attention_kernel.triton_matvec, "ENABLED", True)
    monkeypatch.setattr(attention_kernel.triton_matvec, "has_triton_backend", lambda: True)
    monkeypatch.setattr(attention_kernel, "ENABLED", True)
    assert calls("cuda") == 2 and calls("cpu") == 0
    monkeypatch.setattr(attention_kernel, "ENABLED", False)
    assert calls("cuda") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kdim,n", [(2, 32, 45), (64, 512, 640), (64, 512, 136)])
def test_the_compiled_kernels_agree_with_the_xla_spelling_on_the_gpu(heads, kdim, n):
    q, keys, valid, sink = _case(heads, kdim, n, seed=3)
    got = np.asarray(attend_kernels(q, keys, valid, sink, kdim ** -0.5))
    want = np.asarray(jax.jit(lambda *a: attention.attend_xla(_cfg(kdim), sink, *a))(q, keys, valid))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    qs, ks, vs = (np.stack([a, a[::-1].copy()]) for a in (q, keys, valid))
    block = np.asarray(jax.vmap(lambda a, b, c: attend_kernels(a, b, c, sink, kdim ** -0.5))(qs, ks, vs))
    np.testing.assert_array_equal(block[0], got)
