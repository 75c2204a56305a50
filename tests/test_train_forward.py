"""The parallel training forward computes what the engine computes (experiments/train/forward.py).

The reference is `jds41.model.prefill`, the token-by-token engine, run on the same float weights as F32
QTensors (Engram tables put on the e4m3/e8m0 grid first, so both read identical values). The sequence is longer
than the window (8) and spans 16 ratio-4 groups (indexer top-4 of up to 16 rows, so selection matters) and 4
ratio-16 groups; the hash layer, the Engram layer and the V4.1 mHC lag are all in the tiny config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from train_helpers import engine_logits, engine_params, tiny_setup

from experiments.train.forward import engram_ids_batch, forward
from experiments.train.moe_dispatch import routed_experts_dispatch
from jds41.layers.moe import routed_experts_rows
from jds41.quant import QTensor


@pytest.mark.slow
def test_forward_logits_equal_engine_prefill():
    cfg, params, buffers, hasher, _ = tiny_setup(seed=3)
    assert cfg.window == 8 and cfg.compress_ratios[1:3] == (4, 16) and cfg.index_topk == 4
    tokens = np.random.default_rng(5).integers(8, cfg.vocab_size, 64)
    eparams, source = engine_params(cfg, params, buffers)
    ref = engine_logits(cfg, eparams, source, hasher, tokens)
    ids = engram_ids_batch(hasher, tokens[None])
    fwd = jax.jit(lambda p, b, t, i: forward(cfg, p, b, t, i, block=4)[0])
    got = np.asarray(fwd(jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, buffers),
                         jnp.asarray(tokens[None], jnp.int32), jnp.asarray(ids)))[0]
    scale = np.abs(ref).max()
    assert scale > 1.0  # logits are not degenerate
    np.testing.assert_allclose(got, ref, atol=1e-4 * scale, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_block_dispatch_equals_per_token_experts():
    rng = np.random.default_rng(0)
    N, D, F, E, K = 37, 32, 32, 8, 2
    x = rng.standard_normal((N, D)).astype(np.float32)
    # uneven loads: expert 0 is in every token's pair, experts 6 and 7 in none
    idx = np.stack([np.zeros(N, np.int32), rng.integers(1, 6, N).astype(np.int32)], axis=1)
    w = rng.random((N, K)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F, D)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((E, D, F)).astype(np.float32)
    got = routed_experts_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), gate, up, down, 10.0, block=4)

    def q(a):
        return QTensor.from_raw(a, T.F32, a.shape)

    ref = routed_experts_rows(x, q(gate), q(up), q(down), idx, w, 10.0)
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_engram_ids_batch_equals_per_sequence_hash():
    cfg, _, _, hasher, _ = tiny_setup()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 20))
    got = engram_ids_batch(hasher, tokens)
    for b in range(3):
        np.testing.assert_array_equal(got[b], hasher.row_ids_seq(tokens[b]))


@pytest.mark.slow
def test_bf16_rematerialized_forward_stays_close_to_f32():
    """The training path (bf16 matmul inputs, per-layer remat) is the f32 forward up to bf16 input rounding."""
    cfg, params, buffers, hasher, _ = tiny_setup(seed=6)
    tokens = np.random.default_rng(8).integers(8, cfg.vocab_size, (2, 32))
    ids = jnp.asarray(engram_ids_batch(hasher, tokens))
    p, b = jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, buffers)
    f32 = np.asarray(jax.jit(lambda: forward(cfg, p, b, jnp.asarray(tokens), ids, block=8)[0])())
    bf16 = np.asarray(jax.jit(lambda: forward(cfg, p, b, jnp.asarray(tokens), ids, dtype=jnp.bfloat16, block=8,
                                              remat=True)[0])())
    rel = np.abs(bf16 - f32).mean() / np.abs(f32).mean()
    assert 1e-5 < rel < 0.03  # bf16 rounding is visible, and small
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() > 0.9
