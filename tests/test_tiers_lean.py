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


def test_lean_guard_backs_off_only_below_the_floor():
    """The guard's arithmetic against hand-counted windows (K x layers = 10 selections per step)."""
    from jds41.tiers.lean_guard import LeanGuard

    g = LeanGuard(margin=0.4, agreement_floor=0.9, check_every=2, selections_per_step=10)
    assert not g.observe([1, 0])  # window agreement 1 - 1/20 = 0.95 >= 0.9: keep
    assert g.margin == 0.4 and g.last_agreement == pytest.approx(0.95)
    assert g.observe([[2, 1], [1, 0]])  # per-layer swaps summed per step: 4/20 -> 0.8 < 0.9: halve
    assert g.margin == pytest.approx(0.2) and g.backoffs == 1
    assert not g.observe([3])  # half a window: no decision yet
    assert g.observe([3]) and g.margin == pytest.approx(0.1)
    g.margin = 1.5e-4
    assert g.observe([5, 5]) and g.margin == 0.0  # under off_below: exactly unbiased routing
    assert not g.observe([9, 9]) and g.backoffs == 3  # nothing left to back off
    st = g.stats()
    assert st["steps"] == 10 and st["topk_agreement"] == pytest.approx(1 - 39 / 100)
    g.reset()
    assert g.margin == 0.4


@pytest.mark.slow
def test_forced_low_agreement_makes_the_live_guard_back_off(synthetic_model, tmp_path):
    """A margin so wide that the lean swaps on most steps, a 0.99 floor checked every 2 steps: the guard lowers the
    margin (in the parameters, without recompiling the step) until the routing is unbiased again, and the engine's
    stats report it; a session after the back-off routes exactly like the plain model."""
    from jds41 import model as M
    from jds41.decode_loop import decode_forced

    d = json.loads(open(_profile(tmp_path, 100.0)).read())
    d["router_lean"].update(agreement_floor=0.99, check_every=2)
    path_p = tmp_path / "guarded.json"
    path_p.write_text(json.dumps(d))
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    eng = Engine.open(path, max_ctx=96, profile=str(path_p), prefill_chunk=0)
    tokens = np.random.default_rng(4).integers(8, 512, 40).tolist()
    s = eng.session()
    s.feed(tokens[:2])
    compiled = M.decode_step._cache_size()
    for t in tokens[2:30]:  # one step per call: the guard decides every 2 steps
        s.feed([t])
    guard = eng.tiers.guard
    assert guard.backoffs >= 10 and guard.margin < 100.0 / 2**10
    assert M.decode_step._cache_size() == compiled  # back-offs swapped arrays, nothing recompiled
    leaves = [b["routed"].lean_margin for b in eng.params["blocks"] if "routed" in b]
    assert leaves and all(float(x) == np.float32(guard.margin) for x in leaves)
    st = eng.tiers.stats()["router_lean"]
    assert st["backoffs"] == guard.backoffs and st["topk_agreement"] < 0.99
    # it keeps backing off until a whole window agrees again (or the margin is 0)
    for t in tokens[30:]:
        if guard.margin == 0 or (guard.last_agreement or 0) >= 0.99:
            break
        s.feed([t])
    assert guard.margin == 0 or guard.last_agreement >= 0.99
    # margin 0 through the same path is exactly the unbiased routing (fixed stream through the device loop)
    guard.margin = 0.0
    eng.apply_lean_guard()
    plain = Engine.open(path, max_ctx=96, prefill_chunk=0)
    a, b = eng.session(), plain.session()
    a.feed(tokens[:8])
    b.feed(tokens[:8])
    np.testing.assert_array_equal(decode_forced(a, tokens[8:20]), decode_forced(b, tokens[8:20]))
