"""Tier planning as data: usage counts -> placement -> JSON, profiles, and the profile -> placement CLI round trip.

The planner is tested on hand-written tables of 2 layers x 4 experts (STYLE.md 6): budget boundaries, ties,
zero budgets, everything fitting, first fit across expert sizes, hash layers. The end-to-end test runs both CLIs
on a 2-layer deepseek41 file (layer 0 a hash layer, layer 1 scored with Engram): the 2 layers keep the XLA:CPU
compile, which dominates, short; the profiler subprocess compiles at XLA's backend optimization level 0, which
changes compile time, not results (the in-process cross-check compiles the same way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jds41.tiers.placement import ModelBytes, Placement, model_bytes, placement_for_model, plan
from jds41.tiers.profiles import Profile, ProfileError, host_available_bytes, load_profile, shipped_profiles
from jds41.tiers.usage import ModelIdentity, Usage, UsageCounter, UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ModelIdentity("deepseek4", 2, 4, 2, "hand.gguf", "0" * 64)
COUNTS = [[10, 0, 5, 1], [3, 8, 0, 2]]  # ranking: (0,0) (1,1) (0,2) (1,0) (1,3) (0,3), then (0,1) (1,2) tied at 0


def usage(counts=COUNTS, hash_layers=()):
    return Usage.from_counts(counts, MODEL, hash_layers)


def tiers(p: Placement) -> list[list[int]]:
    return [list(r) for r in p.tier]


# ---- planner -------------------------------------------------------------------------------------------------


def test_budget_boundaries_slots_and_hit_rates():
    p = plan(usage(), 100, (200, 100))  # exactly two experts fit tier 0, one tier 1
    assert tiers(p) == [[0, 2, 1, 2], [2, 0, 2, 2]]
    assert [list(r) for r in p.slot] == [[0, 0, 0, 1], [0, 0, 1, 2]]  # per (layer, tier), by expert id
    assert p.experts(1, 2) == (0, 2, 3) and p.tier_experts == (2, 1, 5) and p.tier_bytes == (200, 100, 500)
    assert p.mapping()[(0, 2)] == (1, 0) and p.mapping()[(1, 3)] == (2, 2) and len(p.mapping()) == 8
    share = np.array([[10 / 16, 5 / 16, 1 / 16], [8 / 13, 0, 5 / 13]])
    np.testing.assert_allclose(p.layer_hit_rates, share)
    np.testing.assert_allclose(p.hit_rates, share.mean(0))
    np.testing.assert_allclose(p.bytes_per_token, 2 * 100 * share.sum(0))  # K=2 selections per layer and token
    assert tiers(plan(usage(), 100, (199, 100))) == [[0, 2, 2, 2], [2, 1, 2, 2]]  # one byte short: (1,1) demoted


def test_ties_spread_round_robin_and_are_deterministic():
    p = plan(usage([[1] * 4, [1] * 4]), 100, (300, 200))
    # equal counts: lower expert id first, then lower layer, so both layers get the same share of tier 0
    assert tiers(p) == [[0, 0, 1, 2], [0, 1, 2, 2]]
    assert p == plan(usage([[1] * 4, [1] * 4]), 100, (300, 200))
    np.testing.assert_allclose(p.hit_rates, [3 / 8, 2 / 8, 3 / 8])


def test_zero_budgets_and_everything_fits():
    none = plan(usage(), 100, (0, 0))
    assert tiers(none) == [[2] * 4] * 2 and [list(r) for r in none.slot] == [[0, 1, 2, 3]] * 2
    assert none.hit_rates == (0.0, 0.0, 1.0) and none.bytes_per_token[:2] == (0.0, 0.0)
    everything = plan(usage(), 100, (800, 0))
    assert tiers(everything) == [[0] * 4] * 2 and everything.hit_rates == (1.0, 0.0, 0.0)
    host = plan(usage(), 100, (0, 10**12))
    assert tiers(host) == [[1] * 4] * 2 and host.tier_bytes == (0, 800, 0)


def test_first_fit_across_expert_sizes():
    # layer 0 experts are 50 B, layer 1 experts 100 B: after (0,0), the hotter (1,1) does not fit the 90 B left,
    # so it goes to tier 1 while the colder but smaller (0,2) still takes tier-0 bytes.
    p = plan(usage(), (50, 100), (140, 100))
    assert tiers(p) == [[0, 2, 0, 2], [2, 1, 2, 2]]
    assert p.tier_bytes == (100, 100, 400)


def test_hash_layers_ranked_by_use_unless_discounted():
    u = usage(hash_layers=(0,))
    assert tiers(plan(u, 100, (200, 0))) == tiers(plan(usage(), 100, (200, 0)))  # bytes are bytes
    discounted = plan(u, 100, (200, 0), hash_weight=0.0)
    assert tiers(discounted) == [[2, 2, 2, 2], [0, 0, 2, 2]]  # the scored layer's used experts come first
    doc = discounted.to_json()
    assert [lay["kind"] for lay in doc["layers"]] == ["hash", "scored"]


def test_plan_rejects_bad_inputs():
    with pytest.raises(ValueError, match="expert_bytes"):
        plan(usage(), (100,), (0, 0))
    with pytest.raises(ValueError, match="budgets"):
        plan(usage(), 100, (-1, 0))
    with pytest.raises(UsageError, match="2 layers x 4 experts"):
        Usage.from_counts([[1, 2, 3]], MODEL)


def test_placement_json_round_trip_and_validation(tmp_path):
    p = plan(usage(hash_layers=(0,)), (50, 100), (140, 100), source="usage:x.json", meta={"note": 1})
    path = tmp_path / "placement.json"
    p.save(path)
    assert Placement.load(path) == p
    doc = json.loads(path.read_text())
    doc["layers"][0]["slot"][1] = 5
    path.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="layer 0 tier 2: slots"):
        Placement.load(path)
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="version 99"):
        Placement.load(path)


# ---- usage ---------------------------------------------------------------------------------------------------


def test_usage_counter_round_trip_and_engram_histogram(tmp_path):
    c = UsageCounter(MODEL, hash_layers=(0,), engram_layers=(1,), engram_table_rows=(100,), top_n=2)
    c.add_routing(np.array([[[0, 2], [1, 3]], [[0, 1], [1, 0]]]))  # 2 tokens x 2 layers x K=2
    c.add_engram(np.array([[[7, 7, 9]], [[7, 3, 5]]]))  # rows 7 x3, 9 3 5 once each
    c.add_engram(np.array([[[9, 9, 9]]]))  # row 9 -> 4
    u = c.finish(prompts=1, corpus={"file": "p.txt"})
    assert u.counts == ((2, 1, 1, 0), (1, 2, 0, 1)) and u.tokens == 2 and u.hash_layers == (0,)
    e = u.engram[0]
    assert (e.layer, e.lookups, e.distinct, e.top) == (1, 9, 4, ((9, 4), (7, 3)))
    assert e.rest == ((1, 2, 2, 2),)  # rows 3 and 5: count in [1, 2), two rows, two lookups
    u.save(tmp_path / "u.json")
    assert Usage.load(tmp_path / "u.json") == u
    doc = json.loads((tmp_path / "u.json").read_text())
    assert [lay["kind"] for lay in doc["layers"]] == ["hash", "scored"] and doc["version"] == 1
    doc["extra"] = 1
    (tmp_path / "u.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="unknown fields \\['extra'\\]"):
        Usage.load(tmp_path / "u.json")


def test_model_identity_mismatch_is_refused(synthetic_model, tmp_path):
    from jds41.checkpoints import open_model

    with open_model(synthetic_model("deepseek4", "tiny")) as a, open_model(synthetic_model("deepseek4", "tiny",
                                                                                           seed=1)) as b:
        ia, ib = ModelIdentity.of(a), ModelIdentity.of(b)
        assert ia.n_layers == ib.n_layers and ia.sha256 != ib.sha256  # same shapes, other weights
        Usage.uniform(ia).save(tmp_path / "a.json")
        assert placement_for_model(a, load_profile("lucebox"), str(tmp_path / "a.json")).model == ia
        with pytest.raises(UsageError, match="usage file .* was made for another model: sha256"):
            placement_for_model(b, load_profile("lucebox"), str(tmp_path / "a.json"))
        # file: source: a placement made earlier is reused as is, if the profile's budgets still hold it
        p = placement_for_model(a, load_profile("ssd-heavy"), str(tmp_path / "a.json"))
        p.save(tmp_path / "p.json")
        doc = {"tier0_bytes": "all", "tier1_bytes": "all", "placement_source": "file:p.json"}
        (tmp_path / "reuse.json").write_text(json.dumps(doc))
        again = placement_for_model(a, load_profile(str(tmp_path / "reuse.json")))
        assert again.tier == p.tier and again.source == f"file:{tmp_path / 'p.json'}"
        (tmp_path / "tight.json").write_text(json.dumps({**doc, "tier1_bytes": 0}))
        assert p.tier_experts[:2] == (0, 1)  # ssd-heavy on 32 experts: 1% is no expert, 4% is one
        with pytest.raises(UsageError, match="tier 1, profile 'tight' allows 0"):
            placement_for_model(a, load_profile(str(tmp_path / "tight.json")))
        with pytest.raises(UsageError, match="placement file .* was made for another model"):
            placement_for_model(b, load_profile(str(tmp_path / "reuse.json")))
        other = ModelIdentity("deepseek41", 2, 8, 2, "x.gguf", ia.sha256)
        with pytest.raises(UsageError, match="arch 'deepseek41'"):
            other.check_matches(ia, "usage file x")


# ---- profiles ------------------------------------------------------------------------------------------------


SIZES = ModelBytes(expert_bytes=(100, 100), n_experts=4, shared_bytes=30, engram_bytes=500, dense_bytes=1000)


def test_shipped_profiles_load_and_resolve():
    assert set(shipped_profiles()) >= {"all-hbm", "ssd-heavy", "lucebox", "h200"}
    for name in shipped_profiles():
        p = load_profile(name)
        assert p.name == name and "issue #11" in p.router_lean.comment
        # issue #11: the lean is on, under its guard, where a tier below HBM exists to lean away from
        assert p.router_lean.enabled == (name in ("lucebox", "h200"))
        assert not p.router_lean.enabled or (p.router_lean.margin > 0 and p.router_lean.agreement_floor >= 0.99)
    assert load_profile("all-hbm").budgets(SIZES) == (800, 0)
    assert load_profile("lucebox").budgets(SIZES) == (52, 480)  # 6.54% and 60% of 800 routed bytes
    assert load_profile("ssd-heavy").budgets(SIZES) == (8, 32)
    h200 = load_profile("h200")
    b0, b1 = h200.budgets(SIZES, host_available=20 * 2**30)
    assert b0 == 139 * 2**30 - 1030 - 256 * 100 - 16 * 2**30 and b1 == 4 * 2**30
    assert h200.budgets(SIZES, host_available=2**30)[1] == 0  # reserve larger than free memory: clamp at 0
    assert host_available_bytes() > 0


def test_lucebox_fractions_match_the_documented_v41_derivation():
    def row_bytes(t, n):
        block, size = GGML_QUANT_SIZES[t]
        return n // block * size

    expert = 2 * row_bytes(GGMLQuantizationType.IQ2_XXS, 2304 * 5120) + row_bytes(GGMLQuantizationType.Q2_K,
                                                                                 5120 * 2304)
    total = 40 * 384 * expert
    p = load_profile("lucebox")
    assert expert == 9_953_280 and total == 152_882_380_800 and str(total)[:6] in p.comment.replace(",", "")
    assert p.tier0_bytes == round(10e9 / total, 4) and p.tier1_bytes == 0.6


@pytest.mark.parametrize("change, match", [
    ({"colour": 1}, "unknown field\\(s\\) \\['colour'\\]"),
    ({"tier0_bytes": 1.5}, "'tier0_bytes': a float is a fraction"),
    ({"tier0_bytes": -1}, "bytes must be >= 0"),
    ({"tier0_bytes": True}, "'tier0_bytes'"),
    ({"tier1_bytes": {"hbm": 1, "reserve": 2}}, "'tier1_bytes': the object form takes exactly the keys"),
    ({"tier1_bytes": {"host_free_minus": "16G"}}, "tier1_bytes.host_free_minus"),
    ({"engram_tables": "tape"}, "'engram_tables'"),
    ({"host_fetch": "some"}, "'host_fetch'"),
    ({"placement_source": "magic"}, "'placement_source'"),
    ({"slot_cache_slots": -2}, "'slot_cache_slots'"),
    ({"lookahead": 2}, "'lookahead': .*the only depth built"),
    ({"router_lean": {"enabled": True, "speed": 2}}, "router_lean.*unknown field\\(s\\) \\['speed'\\]"),
    ({"router_lean": {"agreement_floor": 2.0}}, "router_lean.agreement_floor"),
    ({"router_lean": {"check_every": 0}}, "router_lean.check_every"),
])
def test_profile_validation_errors(tmp_path, change, match):
    doc = {"name": "t", "tier0_bytes": 0.1, "tier1_bytes": "all", **change}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=match) as e:
        load_profile(str(path))
    assert str(path) in str(e.value)


def test_profile_loading_errors_and_paths(tmp_path):
    with pytest.raises(ProfileError, match="unknown profile 'nope'; shipped profiles: .*lucebox"):
        load_profile("nope")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(str(tmp_path / "bad.json"))
    (tmp_path / "min.json").write_text(json.dumps({"tier1_bytes": 0}))
    with pytest.raises(ProfileError, match="missing required field 'tier0_bytes'"):
        load_profile(str(tmp_path / "min.json"))
    (tmp_path / "rel.json").write_text(json.dumps({"tier0_bytes": 10, "tier1_bytes": 0,
                                                  "placement_source": "usage:u.json", "lookahead": 1}))
    p = load_profile(str(tmp_path / "rel.json"))
    assert p == Profile("rel", 10, 0, f"usage:{tmp_path / 'u.json'}", lookahead=1) and p.lookahead_depth == 1


# ---- end to end: prompts -> usage.json -> placement.json from a profile ----------------------------------


def test_read_prompts_lines_and_jsonl(tmp_path):
    from jds41.errors import Jds41Error
    from jds41.tiers.profile import read_prompts

    (tmp_path / "a.txt").write_text("first prompt\n\n  {not json\nthird\n")
    assert read_prompts(str(tmp_path / "a.txt")) == ["first prompt", "  {not json", "third"]
    (tmp_path / "b.jsonl").write_text('{"text": "one\\ntwo"}\n\n{"text": "three", "id": 3}\n')
    assert read_prompts(str(tmp_path / "b.jsonl")) == ["one\ntwo", "three"]
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(Jds41Error, match="c.jsonl:2: expected an object with a string field"):
        read_prompts(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.txt").write_text("\n\n")
    with pytest.raises(Jds41Error, match="has no prompts"):
        read_prompts(str(tmp_path / "d.txt"))


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory):
    from jds41.checkpoints.presets import preset
    from jds41.checkpoints.synth import write_synthetic

    path = tmp_path_factory.mktemp("tiers") / "deepseek41-tiny-2layers.gguf"
    write_synthetic(path, preset("deepseek41", "tiny", layers=2), quant="f32", seed=0, progress=False)
    return str(path)


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()}
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_cli_profile_then_placement_round_trip(two_layer_model, tmp_path, monkeypatch):
    import jax.numpy as jnp

    from jds41 import model as M
    from jds41.engine import Engine
    from jds41.tiers import profile as P

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on the mat\n\nhello world, hello again\n" + "a long prompt of many words " * 8 +
                       "\n")
    usage_path, placement_path = tmp_path / "usage.json", tmp_path / "placement.json"
    r = _cli("jds41.tiers.profile", two_layer_model, "--prompts", str(prompts), "--out", str(usage_path),
             "--max-tokens-per-prompt", "40", "--quiet")
    assert "3 prompts" in r.stdout
    u = Usage.load(usage_path)

    engine = Engine.open(two_layer_model, max_ctx=64)
    K = engine.cfg.n_experts_used
    ids = [engine.tokenizer.encode(t)[:40] for t in P.read_prompts(str(prompts))]
    assert u.tokens == sum(map(len, ids)) and max(map(len, ids)) == 40 and u.corpus["truncated_prompts"] == 1
    assert u.hash_layers == (0,) and all(sum(row) == u.tokens * K for row in u.counts)
    tid2eid = engine.gguf.typed("blk.0.ffn_gate_tid2eid.weight")  # hash layer: expert ids known from tokens
    np.testing.assert_array_equal(u.counts[0], np.bincount(tid2eid[np.concatenate(ids)].ravel(), minlength=8))
    rows = np.concatenate([engine.engram[0].row_ids_seq(x) for x in ids])[:, 0, :].ravel()
    uniq, cnt = np.unique(rows, return_counts=True)
    eng = u.engram[0]
    assert (eng.layer, eng.lookups, eng.distinct) == (1, rows.size, uniq.size)
    assert dict(eng.top) == dict(zip(uniq.tolist(), cnt.tolist()))

    # In process, at the same optimization level: the traced prefill gives the plain prefill's logits bit for bit,
    # and its routing gives the CLI's counts exactly (the CLI drops the output head; routing is unchanged).
    opts = {"xla_backend_optimization_level": 0}
    chunk = jnp.asarray(ids[2][:P.CHUNK], jnp.int32)
    erows = jnp.asarray(engine.engram_rows(ids[2][:P.CHUNK], []))
    traced = P.traced_prefill.lower(engine.plan, engine.params, M.init_state(engine.plan), chunk, erows,
                                    with_logits=True).compile(opts)
    plain = M.prefill.lower(engine.plan, engine.params, M.init_state(engine.plan), chunk, erows).compile(opts)
    logits_t, _, _ = traced(engine.params, M.init_state(engine.plan), chunk, erows)
    logits_p, _ = plain(engine.params, M.init_state(engine.plan), chunk, erows)
    np.testing.assert_array_equal(np.asarray(logits_t), np.asarray(logits_p))
    monkeypatch.setattr(P, "traced_prefill", lambda plan, params, state, toks, rows: traced(params, state, toks, rows))
    counter = UsageCounter(u.model, u.hash_layers)
    P.profile_prompts(engine, ids, counter)
    assert counter.finish().counts == u.counts

    r = _cli("jds41.tiers.placement", two_layer_model, "--usage", str(usage_path), "--profile", "lucebox", "--out",
             str(placement_path))
    assert "tier 0 (HBM)" in r.stdout
    p = Placement.load(placement_path)
    sizes = model_bytes(engine.gguf)
    b0, b1 = load_profile("lucebox").budgets(sizes)
    assert p.model == u.model and p.source == f"usage:{usage_path}" and p.budgets == (b0, b1)
    assert p.tier_bytes[0] <= b0 and p.tier_bytes[1] <= b1 and sum(p.tier_experts) == 2 * 8
    assert p == plan(u, sizes.expert_bytes, (b0, b1), source=p.source, meta=p.meta)  # the CLI is `plan`
    assert p.meta["profile"]["name"] == "lucebox" and p.meta["model_bytes"]["routed_total"] == sizes.routed_total
