"""mHC's Sinkhorn as one Triton kernel (jds41/layers/sinkhorn_kernel.py), the comb's fast path on CUDA.

On every machine: the kernel in Pallas' interpreter against mhc's XLA spelling (the reference) and a float64
numpy re-derivation; each row's comb does not depend on the rows around it (one row alone, in a block, permuted,
under vmap). Lowered for CUDA, `hc_split` is the Triton custom call; lowered for the CPU it is not. On a GPU
(marker `gpu`): the compiled kernel against the XLA spelling, and a row alone against the same row in a block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mhc_reference import numpy_sinkhorn

from jds41.layers.mhc import _sinkhorn, hc_split
from jds41.layers.sinkhorn_kernel import sinkhorn_rows

TRITON_CALL = "__gpu$xla.gpu.triton"
EPS, ITERS = 1e-6, 20


def _logits(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 4, 4)) * 4).astype(np.float32)


def test_the_interpreted_kernel_equals_the_reference():
    lg = _logits(9)
    got = np.asarray(sinkhorn_rows(jnp.asarray(lg.reshape(9, 16)), EPS, ITERS, interpret=True))
    got = got.reshape(9, 4, 4)
    want = np.asarray(jax.jit(lambda x: _sinkhorn(x, EPS, ITERS))(lg))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, numpy_sinkhorn(lg, EPS, ITERS), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.sum(-2), 1, atol=1e-4)  # columns normalised last: doubly stochastic to eps


def test_a_rows_comb_does_not_depend_on_the_rows_around_it():
    iters = 3  # the property does not depend on the round count; fewer rounds compile faster in the interpreter
    lg = jnp.asarray(_logits(6, seed=1).reshape(6, 16))
    run = lambda x: sinkhorn_rows(x, EPS, iters, interpret=True)  # noqa: E731
    block = np.asarray(run(lg))
    perm = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(np.asarray(run(lg[perm])), block[perm])
    for r in (0, 4):
        np.testing.assert_array_equal(np.asarray(run(lg[r:r + 1]))[0], block[r])
    vm = jax.vmap(lambda x: run(x[None])[0])(lg)
    np.testing.assert_array_equal(np.asarray(vm), block)


def test_hc_split_lowers_to_the_kernel_on_cuda_only():
    mix = jax.ShapeDtypeStruct((3, 24), jnp.float32)
    fn = lambda m: hc_split(m, jnp.ones(3), jnp.zeros(24), EPS, ITERS)
    for platform, want in (("cuda", True), ("cpu", False)):
        text = jax.jit(fn).trace(mix).lower(lowering_platforms=(platform,)).as_text()
        assert (TRITON_CALL in text) is want, platform


@pytest.mark.gpu
def test_the_compiled_kernel_agrees_with_the_xla_spelling_on_the_gpu():
    lg = jnp.asarray(_logits(64, seed=2))
    got = np.asarray(sinkhorn_rows(lg.reshape(64, 16), EPS, ITERS)).reshape(64, 4, 4)
    want = np.asarray(jax.jit(lambda x: _sinkhorn(x, EPS, ITERS))(lg))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    one = np.asarray(sinkhorn_rows(lg[5].reshape(1, 16), EPS, ITERS))[0]
    np.testing.assert_array_equal(one, got[5].reshape(16))
