"""The attention's softmax with its sink as one Triton launch (jds41/layers/sink_softmax_kernel.py,
JDS41_SOFTMAX_KERNEL).

On every machine: the kernel in Pallas' interpreter against attention's XLA spelling (`_sink_softmax`, the
reference) and a float64 numpy re-derivation, at row lengths that are and are not powers of two, with masked keys,
a row with no valid key (all its weight on the sink) and a sink larger than every score; a row's weights do not
depend on the rows batched beside it (vmapped as the verify rows run it); switched on, `attend_xla` lowers to the
kernel for CUDA only. On a GPU (marker `gpu`): the compiled kernel against the XLA spelling at V4-Flash's shape
(64 heads, a window of 128 and 512 selected rows) and a vmapped row against the row alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.layers import attention, sink_softmax_kernel
from jds41.layers.attention import _sink_softmax

TRITON_CALL = "__gpu$xla.gpu.triton"
SCALE = 512 ** -0.5


def _inputs(heads: int, keys: int, seed: int = 0, valid_share: float = 0.8):
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal((heads, keys)) * 40).astype(np.float32)
    valid = rng.uniform(size=keys) < valid_share
    sink = rng.standard_normal(heads).astype(np.float32)
    return s, valid, sink


def _numpy(s, valid, sink):
    """attend's weights in float64: exp(l - top) / (sum exp(l - top) + exp(sink - top)), l = scale s or -inf."""
    logits = np.where(valid[None, :], s.astype(np.float64) * SCALE, -np.inf)
    top = np.maximum(logits.max(axis=1), sink.astype(np.float64))
    e = np.exp(logits - top[:, None])
    return e / (e.sum(axis=1) + np.exp(sink - top))[:, None]


def _kernel(s, valid, sink):
    return np.asarray(sink_softmax_kernel.probabilities(jnp.asarray(s), jnp.asarray(valid), jnp.asarray(sink),
                                                        scale=SCALE, interpret=True))


@pytest.mark.parametrize("heads,keys", [(4, 7), (8, 32), (16, 200), (2, 1)])
def test_the_interpreted_kernel_equals_the_xla_spelling_and_a_float64_rederivation(heads, keys):
    s, valid, sink = _inputs(heads, keys, seed=keys)
    valid[0] = True  # at least one key (the row with none is the next test)
    got = _kernel(s, valid, sink)
    want = np.asarray(jax.jit(_sink_softmax, static_argnums=3)(s, valid, sink, SCALE))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, _numpy(s, valid, sink), rtol=2e-6, atol=1e-7)
    assert not got[:, ~valid].any()  # masked keys weigh exactly 0


def test_a_row_with_no_valid_key_or_a_large_sink_puts_its_weight_on_the_sink():
    s, valid, sink = _inputs(4, 12, seed=3)
    sink[1] = 1e3  # larger than every scaled score: the row's weights vanish against it
    got = _kernel(s, np.zeros(12, bool), sink)
    assert not got.any()
    got = _kernel(s, np.ones(12, bool), sink)
    np.testing.assert_allclose(got, _numpy(s, np.ones(12, bool), sink), rtol=2e-6, atol=1e-30)
    assert got[1].max() < 1e-30


def test_a_row_does_not_depend_on_the_rows_batched_beside_it():
    rows = [_inputs(8, 40, seed=i) for i in range(4)]
    s, valid = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    sink = rows[0][2]
    run = jax.jit(jax.vmap(lambda a, v: sink_softmax_kernel.probabilities(a, v, jnp.asarray(sink), scale=SCALE,
                                                                          interpret=True)))
    block = np.asarray(run(s, valid))
    alone = np.asarray(run(s[2:3], valid[2:3]))
    np.testing.assert_array_equal(alone[0], block[2])
    np.testing.assert_array_equal(block[1], _kernel(s[1], valid[1], sink))


@pytest.mark.parametrize("enabled", [True, False])
def test_attend_lowers_to_the_kernel_on_cuda_only_when_switched_on(monkeypatch, enabled):
    monkeypatch.setattr(sink_softmax_kernel, "ENABLED", enabled)
    cfg = type("Cfg", (), {"q_head_norm": True, "rms_eps": 1e-6, "head_dim": 64})()  # attend_xla's fields

    def run(q, k, v, sink):
        return attention.attend_xla(cfg, sink, q, k, v, jnp.int32(5), jnp.ones(8, jnp.float32))

    args = (jax.ShapeDtypeStruct((4, 64), jnp.float32), jax.ShapeDtypeStruct((24, 64), jnp.float32),
            jax.ShapeDtypeStruct((24,), jnp.bool_), jax.ShapeDtypeStruct((4,), jnp.float32))
    for platform in ("cuda", "cpu"):
        text = jax.jit(run).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        on = enabled and platform == "cuda"
        assert ('"attention_sink_softmax"' in text) is on and (TRITON_CALL in text) is on


@pytest.mark.gpu
def test_the_compiled_kernel_agrees_with_the_xla_spelling_on_the_gpu():
    s, valid, sink = _inputs(64, 640, seed=5)
    got = np.asarray(sink_softmax_kernel.probabilities(jnp.asarray(s), jnp.asarray(valid), jnp.asarray(sink),
                                                       scale=SCALE))
    want = np.asarray(jax.jit(_sink_softmax, static_argnums=3)(s, valid, sink, SCALE))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got, _numpy(s, valid, sink), rtol=4e-6, atol=1e-7)
    run = jax.jit(jax.vmap(lambda a, v: sink_softmax_kernel.probabilities(a, v, jnp.asarray(sink), scale=SCALE)))
    block = np.asarray(run(np.stack([s, s[::-1]]), np.stack([valid, valid[::-1]])))
    np.testing.assert_array_equal(block[0], got)
