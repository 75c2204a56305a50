"""Router lean (DESIGN.md §3) wired through a profile: margin 0 changes nothing; a wide margin swaps SSD experts
for faster-tier ones (counted), and the weights of the kept experts still come from the unbiased scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jds41.engine import Engine
from jds41.tiers.profiles import load_profile


def _profile(tmp_path, margin: float, enabled: bool = True) -> str:
    d = load_profile("ssd-heavy").to_json()
    d["tier0_bytes"], d["tier1_bytes"] = 0.25, 0.25  # room in the fast tiers to lean towards
    d["router_lean"] = {**d["router_lean"], "enabled": enabled, "margin": margin}
    path = tmp_path / f"lean-{margin}.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.slow
def test_lean_margin_zero_is_invariant_and_a_wide_margin_swaps(synthetic_model, tmp_path):
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    tokens = np.random.default_rng(3).integers(8, 512, 12).tolist()
    plain = Engine.open(path, max_ctx=64).session().feed(tokens, all_logits=True)

    zero = Engine.open(path, max_ctx=64, profile=_profile(tmp_path, 0.0))
    np.testing.assert_array_equal(zero.session().feed(tokens, all_logits=True), plain)
    assert zero.tiers.lean_swaps == 0 and zero.tiers.stats()["router_lean_topk_agreement"] == 1.0

    wide = Engine.open(path, max_ctx=64, profile=_profile(tmp_path, 100.0))
    wide.session().feed(tokens, all_logits=True)
    stats = wide.tiers.stats()
    assert stats["router_lean_swaps"] > 0 and stats["router_lean_topk_agreement"] < 1.0
    # every scored layer now picks its K experts from the fastest tiers available: with K=2 and >= 2 experts in
    # HBM + host per layer, no SSD expert is selected on a scored layer
    scored = [i for i in range(wide.cfg.n_layers) if not wide.cfg.is_hash_layer(i)]
    fast = (wide.tiers.tier_LE[scored] < 2).sum(axis=1)
    assert (fast >= wide.cfg.n_experts_used).all()
    hashed = sum(wide.cfg.is_hash_layer(i) for i in range(wide.cfg.n_layers))
    assert stats["ssd"]["lookups"] <= hashed * wide.cfg.n_experts_used * len(tokens)


@pytest.mark.slow
def test_lookahead_and_exact_hash_prefetch_change_nothing_but_the_cache(synthetic_model):
    """ssd-heavy (look-ahead on): same tokens as the plain model; next-layer predictions are made and scored, and
    prefetched experts (predicted or hash-layer exact) are found in the slot cache by the step that needs them."""
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    prompt = np.random.default_rng(4).integers(8, 512, 6).tolist()
    want = list(Engine.open(path, max_ctx=64).session().generate(prompt, 10))
    engine = Engine.open(path, max_ctx=64, profile="ssd-heavy")
    assert engine.plan.lookahead
    assert list(engine.session().generate(prompt, 10)) == want
    stats = engine.tiers.stats()
    la = stats["lookahead"]
    assert la["predictions"] > 0 and 0 <= la["correct"] <= la["predictions"]
    cache = stats["ssd"]["slot_cache"]
    assert cache["prefetches"] > 0 and cache["prefetch_used"] > 0
