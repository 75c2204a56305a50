"""The layer-major verify (speculative.verify_block with layer_major=True: the layer-major pass of jds41/prefill.py)
against the token-major verify (the scan of decode's `step`) on the same blocks: logits, state, undo rows, the
per-position small compressor leaves, the routing trace and the DSpark target features, leaf for leaf and bit for
bit. Both architectures (tiny files with 2 DSpark draft stages, block 3), every layer's experts split across HBM /
pinned host / SSD (a slot cache of 2, smaller than a block's SSD union; look-ahead on), a dozen consecutive blocks
with random partial accepts, so the blocks cross compressor group boundaries. The device loop with either verify
is checked against plain decode in tests/test_speculative_loop.py (test_tiered_experts).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.engine import Engine
from jds41.speculative import SpeculativeSession, resolve_verify, rollback, verify_block

ARCHS = ("deepseek4", "deepseek41")
CTX = 96
# Uniform placement ranks experts round-robin across layers, so fractions of the routed bytes per tier give every
# layer experts in all three tiers.
SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1}


class _Drafter:
    """What SpeculativeSession reads of a drafter when the test drives verify_block itself."""

    def __init__(self, engine):
        self.block_size = engine.cfg.dspark.block_size
        self.feature_layers = tuple(engine.cfg.dspark.target_layer_ids)

    def observe(self, features, pos0, count):
        pass


def _same(got, want, what):
    lg, lw = jax.tree_util.tree_flatten_with_path(jax.device_get(got))[0], jax.tree_util.tree_flatten_with_path(
        jax.device_get(want))[0]
    assert [p for p, _ in lg] == [p for p, _ in lw], what
    for (path, g), (_, w) in zip(lg, lw, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_layer_major_verify_equals_token_major_bitwise(synthetic_model, tmp_path, arch):
    profile = tmp_path / "split3.json"
    profile.write_text(json.dumps(SPLIT))
    engine = Engine.open(str(synthetic_model(arch, "tiny", "q8", draft_stages=2)), max_ctx=CTX, profile=str(profile))
    try:
        tiers = engine.tiers.tier_LE
        assert all(set(np.unique(tiers[layer]).tolist()) == {0, 1, 2} for layer in range(engine.cfg.n_layers))
        s = SpeculativeSession(engine, _Drafter(engine))
        assert s.verify_mode == "layer-major"  # auto: the experts are tiered
        assert s.feature_layers
        rng = np.random.default_rng(0)
        last = int(np.argmax(s.feed(rng.integers(8, engine.vocab_size, 6).tolist())))
        ssd_reads = engine.tiers.stores.ssd.stats.to_dict()["lookups"]
        for _ in range(12):
            block = [last] + rng.integers(8, engine.vocab_size, s.k).tolist()
            args = (jnp.asarray(block, jnp.int32), s._engram_rows(block), True, s.feature_layers)
            want = verify_block(s.plan, engine.params, jax.tree.map(jnp.copy, s.state), *args, "token-major")
            got = verify_block(s.plan, engine.params, jax.tree.map(jnp.copy, s.state), *args, "layer-major")
            assert len(got) == len(want) == 6  # logits, state, undo, small, routing, features
            assert got[0].shape == (s.k + 1, engine.vocab_size)
            assert got[5].shape == (s.k + 1, len(s.feature_layers), engine.cfg.dim) and got[5].dtype == jnp.float32
            for name, g, w in zip(("logits", "state", "undo", "small", "routing", "features"), got, want):
                _same(g, w, name)
            keep = int(rng.integers(1, s.k + 2))
            s.state = rollback(s.plan, got[1], got[2], got[3], jnp.int32(keep))
            s.tokens += block[:keep]
            last = block[keep] if keep <= s.k else int(np.argmax(got[0][-1]))
        assert len(s.tokens) > 6 + 16  # past ratio-4 and ratio-16 group ends
        assert engine.tiers.stores.ssd.stats.to_dict()["lookups"] > ssd_reads  # verify really read the SSD tier
    finally:
        engine.tiers.close()


def test_verify_mode_choice():
    resident, tiered = {"blocks": [{}, {}]}, {"blocks": [{}, {"routed": object()}]}
    assert resolve_verify("auto", resident) == "token-major" and resolve_verify("auto", tiered) == "layer-major"
    assert resolve_verify("layer-major", resident) == "layer-major"
    assert resolve_verify("token-major", tiered) == "token-major"
    with pytest.raises(ValueError, match="verify must be one of"):
        resolve_verify("column-major", tiered)
