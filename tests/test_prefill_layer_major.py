"""Layer-major chunked prefill (jds41/prefill.py) against the token-major reference `model.prefill`: logits, the decode
state, the routing trace and the target features bit for bit, for both architectures (V4.1 with shared KV /
candidate blocks, V4 with its own indexer compressors), across two consecutive groups (the second starts from the
first's state), with experts placed across HBM / pinned host / SSD (the SSD union read in batches smaller than the
union), and through the engine's piece plan (full chunks, power-of-two pieces, token-major remainder).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41 import model as M
from jds41 import prefill as PF
from jds41.checkpoints import open_model
from jds41.engine import Engine
from jds41.tiers import experts as TE
from jds41.tiers.experts import place_experts, whole_stack_fits, with_tiered_fields
from jds41.tiers.ssd import ExpertReader
from jds41.tiers.stores import ExpertLayout, build_stores
from jds41.weights import load_params


def _run(fn, engine, tokens: list[int], T: int):
    """Feed `tokens` in groups of T through `fn` (model.prefill's signature); logits, routing (with the target
    features of the first and last layers under "features"), final state."""
    state, logits, routing = M.init_state(engine.plan), [], []
    feature_layers = (0, engine.cfg.n_layers - 1)
    for i in range(0, len(tokens), T):
        chunk = tokens[i:i + T]
        rows = engine.engram_rows(chunk, tokens[:i])
        out, state, trace, features = fn(engine.plan, engine.params, state, jnp.asarray(chunk, jnp.int32),
                                         None if rows is None else jnp.asarray(rows), True, feature_layers)
        logits.append(np.asarray(out))
        routing.append({**jax.tree.map(np.asarray, trace), "features": np.asarray(features)})
    return np.concatenate(logits), routing, jax.tree.map(np.asarray, state)


def _assert_same(engine, tokens, T):
    want = _run(M.prefill, engine, tokens, T)
    got = _run(PF.prefill_layer_major, engine, tokens, T)
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(want[2])):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))
    return got


def test_plan_pieces():
    assert PF.plan_pieces(20000, 4096, 64) == ([4096] * 4 + [2048, 1024, 512], 32)
    assert PF.plan_pieces(100, 4096, 64) == ([64], 36)
    assert PF.plan_pieces(23, 8, 4) == ([8, 8, 4], 3)
    assert PF.plan_pieces(7, 8, 4) == ([4], 3)
    assert PF.plan_pieces(50, 0) == ([], 50)  # 0: the token-major reference path only
    for n in range(0, 300, 7):
        pieces, rest = PF.plan_pieces(n, 48, 8)
        assert sum(pieces) + rest == n and rest < 8 and all(p == 48 or p & (p - 1) == 0 for p in pieces)


@pytest.mark.parametrize("arch,size", [("deepseek41", "tiny-shared"), ("deepseek4", "tiny")])
def test_layer_major_equals_token_major_bitwise(synthetic_model, arch, size):
    engine = Engine.open(str(synthetic_model(arch, size)), max_ctx=64)
    tokens = np.random.default_rng(5).integers(8, engine.vocab_size, 16).tolist()
    _assert_same(engine, tokens, 8)


def _mixed_placement(cfg, seed: int = 3) -> dict:
    """Every layer's experts spread over all three tiers (at least one of each)."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(cfg.n_layers):
        tiers = np.concatenate([[0, 1, 2], rng.integers(0, 3, cfg.n_experts - 3)])
        rng.shuffle(tiers)
        count = {0: 0, 1: 0, 2: 0}
        for e, t in enumerate(tiers):
            out[(layer, e)] = (int(t), count[int(t)])
            count[int(t)] += 1
    return out


def test_whole_stack_moves_only_within_the_device_memory_bound():
    free = {"bytes_limit": 100, "bytes_in_use": 40}  # 60 free: whole-stack moves may hold up to 30
    assert whole_stack_fits(30, free)
    assert not whole_stack_fits(31, free)
    assert whole_stack_fits(10**12, None)  # a backend with no device memory count (CPU)


def test_held_host_bytes_counts_every_layer_or_the_layers_held_at_once(monkeypatch):
    sized = SimpleNamespace  # what held_host_bytes reads of a QTensor: nbytes
    stores = SimpleNamespace(host=SimpleNamespace(stacks={layer: {"gate": sized(nbytes=layer + 1),
                                                                  "down": sized(nbytes=10 * (layer + 1))}
                                                          for layer in range(4)}))
    monkeypatch.setattr(TE, "HOST_STACK_AHEAD", None)
    assert TE.held_host_bytes(stores, range(4)) == 11 * (1 + 2 + 3 + 4)
    monkeypatch.setattr(TE, "HOST_STACK_AHEAD", 1)  # the 3 largest layers
    assert TE.held_host_bytes(stores, range(4)) == 11 * (4 + 3 + 2)


@pytest.mark.slow
def test_layer_major_with_tiered_experts_bitwise_and_moves_less(synthetic_model):
    """HBM / pinned-host / SSD placement, a slot cache of 2 (smaller than a group's SSD union): identical to the
    token-major scan over the same placement; fewer expert bytes moved."""
    path = synthetic_model("deepseek41", "tiny", "q8")
    engine = Engine.open(str(path), max_ctx=64)
    model = open_model(path)
    layout = ExpertLayout.from_model(model)
    tokens = np.random.default_rng(6).integers(8, engine.vocab_size, 16).tolist()
    with ExpertReader(layout) as reader:
        stores = build_stores(layout, _mixed_placement(engine.cfg), reader, n_slots=2)
        placed = place_experts(load_params(engine.cfg, model), stores, layout)
        # Each group's union covers every host expert, so the host stacks move whole: in one transfer (what the
        # placement chose here: no device memory bound on the CPU) and, as a placement over the device memory
        # bound gets, one device_put per expert.
        assert all(b["routed"].host_whole for b in placed["blocks"] if "routed" in b)
        # Each layer's whole-stack move held back until the layer before it starts (HOST_STACK_AHEAD, default 1)
        tied = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PF, "HOST_STACK_AHEAD", 1)
            mp.setattr(PF, "tie_host_stacks", lambda tl, at: tied.append(tl.layer) or TE.tie_host_stacks(tl, at))
            PF.prefill_layer_major.clear_cache()
            routing = _assert_same(engine.with_params(placed), tokens, 8)[1]  # (placement alone changes
            #                                                                   nothing: test_tiers_invariance)
        # and the moves scheduled freely (JDS41_HOST_STACK_AHEAD=0), whole or one device_put per expert
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PF, "HOST_STACK_AHEAD", None)
            PF.prefill_layer_major.clear_cache()
            _assert_same(engine.with_params(placed), tokens, 8)
            _assert_same(engine.with_params(with_tiered_fields(placed, host_whole=False)), tokens, 8)
        PF.prefill_layer_major.clear_cache()
        assert tied == list(range(1, engine.cfg.n_layers))  # every layer but the first, once (one trace)
        assert stores.ssd.stats.to_dict()["lookups"] > 0  # the SSD tier was really read

    class Tiers:  # what moved_bytes reads of a TierRuntime
        tier_LE, _ = stores.tier_table(layout)
        expert_bytes = np.array([layout.expert_nbytes(layer) for layer in range(engine.cfg.n_layers)])

    moved = PF.moved_bytes(Tiers, routing[0]["experts"])
    assert 0 < moved["ssd"] <= moved["ssd_token_major"]
    assert 0 < moved["host"] <= moved["host_token_major"]

    # Groups of 2 tokens with every expert in host memory: the union (<= 2 x K = 4) is smaller than the host
    # stack (8), so its experts move one by one instead of the whole stack.
    all_host = {(layer, e): (1, e) for layer in range(engine.cfg.n_layers) for e in range(engine.cfg.n_experts)}
    assert 2 * engine.cfg.n_experts_used < engine.cfg.n_experts
    with ExpertReader(layout) as reader:
        stores = build_stores(layout, all_host, reader, n_slots=2)
        _assert_same(engine.with_params(place_experts(load_params(engine.cfg, model), stores, layout)), tokens[:4], 2)


@pytest.mark.slow
def test_engine_pieces_equal_token_major_feed(synthetic_model, monkeypatch):
    """Engine.open(prefill_chunk=8) with 4-token pieces: 8 + 8 + 4 layer-major + 3 single steps; the same logits
    at every position as prefill_chunk=0 (the token-major scan and steps), then the same greedy continuation."""
    monkeypatch.setattr(PF, "LAYER_MAJOR_MIN", 4)
    path = str(synthetic_model("deepseek41", "tiny"))
    tokens = np.random.default_rng(7).integers(8, 200, 23).tolist()
    assert PF.plan_pieces(len(tokens), 8) == ([8, 8, 4], 3)
    layer_major = Engine.open(path, max_ctx=64, prefill_chunk=8)
    reference = Engine.open(path, max_ctx=64, prefill_chunk=0)
    np.testing.assert_array_equal(layer_major.session().feed(tokens, all_logits=True),
                                  reference.session().feed(tokens, all_logits=True))
    assert list(layer_major.session().generate(tokens, 4)) == list(reference.session().generate(tokens, 4))


def test_bad_prefill_chunk_is_rejected(synthetic_model):
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine.open(str(synthetic_model("deepseek41", "tiny")), max_ctx=64, prefill_chunk=-1)
