"""A prefill group's next-layer SSD read-ahead (SsdStore.read_ahead, called by tiers/experts.source_fetch) and the
threaded copy of a union's answer out of the slots.

Oracles: the GGUF's own bytes (`GGUFModel.raw`) for what the slots and answers hold, and the same engine with the
read-ahead off for the logits and state (a read-ahead only changes when bytes are read, never which).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jds41.checkpoints import open_model
from jds41.engine import Engine
from jds41.tiers import stores as S
from jds41.tiers.ssd import ExpertReader
from jds41.tiers.stores import ExpertLayout, build_stores

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def q8(synthetic_model):
    with open_model(synthetic_model("deepseek4", "tiny", "q8")) as model:
        yield model


def _expected(model, layout, key) -> list[np.ndarray]:
    layer, e = key
    return [model.raw(s.name).reshape(s.shape[0], -1)[e] for s in layout.stacks[layer]]


def _all_on_ssd(layout, skip_layers=()) -> dict:
    """Every expert on the SSD, but the layers in skip_layers in HBM."""
    return {(layer, e): (0 if layer in skip_layers else 2, e)
            for layer in layout.layers for e in range(layout.n_experts(layer))}


def test_a_union_starts_reading_the_next_ssd_layer_and_its_call_then_only_hits(q8):
    layout = ExpertLayout.from_model(q8)
    E = layout.n_experts(0)
    with ExpertReader(layout, threads=2) as reader:
        # layer 1 keeps its experts in HBM: the next layer with SSD experts after 0 is 2
        ssd = build_stores(layout, _all_on_ssd(layout, skip_layers=(1,)), reader, n_slots=E).ssd
        every = np.arange(E)
        ssd.fetch(0, every, np.ones(E, bool))
        started = ssd.read_ahead(0, E)
        assert started == [(2, e) for e in range(E)]
        assert ssd.stats.set_ahead == E and ssd.stats.prefetches == E
        misses = ssd.stats.misses
        answer = ssd.fetch(2, every, np.ones(E, bool))
        assert ssd.stats.misses == misses  # every key of layer 2 was read (or in flight) before its call
        assert ssd.stats.prefetch_used == E
        for e in range(E):
            for got, want in zip(answer, _expected(q8, layout, (2, e))):
                np.testing.assert_array_equal(got[e].reshape(-1), want)
        # the last SSD layer has no next layer; a decode-sized ask (1 of E) starts nothing
        assert ssd.read_ahead(layout.layers[-1], E) == []
        assert ssd.read_ahead(0, 1) == []
        ssd.set_ahead = False
        assert ssd.read_ahead(2, E) == []
        ssd.close()


def test_a_pass_s_last_layer_reads_the_first_layer_ahead_only_when_another_pass_follows(q8):
    """expect_passes(n): after each of the first n - 1 passes' last SSD layer the first SSD layer's set is read,
    and the next pass's call there then only hits; the last pass, and any pass nobody announced, reads nothing."""
    layout = ExpertLayout.from_model(q8)
    E, first, last = layout.n_experts(0), layout.layers[0], layout.layers[-1]
    every = np.arange(E)
    with ExpertReader(layout, threads=2) as reader:
        ssd = build_stores(layout, _all_on_ssd(layout), reader, n_slots=E).ssd
        ssd.expect_passes(2)
        ssd.fetch(last, every, np.ones(E, bool))
        assert ssd.read_ahead(last, 1) == []  # a decode-sized ask is no pass and does not count one
        assert ssd.read_ahead(last, E) == [(first, e) for e in range(E)]
        misses = ssd.stats.misses
        answer = ssd.fetch(first, every, np.ones(E, bool))
        assert ssd.stats.misses == misses
        for e in range(E):
            for got, want in zip(answer, _expected(q8, layout, (first, e))):
                np.testing.assert_array_equal(got[e].reshape(-1), want)
        ssd.fetch(last, every, np.ones(E, bool))
        assert ssd.read_ahead(last, E) == []  # the second pass was the last announced
        ssd.expect_passes(3)
        ssd.expect_passes(0)  # a later feed's count replaces an earlier one
        assert ssd.read_ahead(last, E) == []
        ssd.close()


def test_a_read_ahead_waits_for_nothing_and_leaves_a_pinned_step_alone(q8):
    """With fewer free slots than the next layer has experts, the read-ahead takes what it can and stops: it never
    evicts what a running step has pinned."""
    layout = ExpertLayout.from_model(q8)
    E = layout.n_experts(0)
    with ExpertReader(layout, threads=2) as reader:
        ssd = build_stores(layout, _all_on_ssd(layout), reader, n_slots=E).ssd
        pinned = [(3, e) for e in range(E - 2)]
        ssd.acquire(pinned)  # a step of layer 3 holds E - 2 slots
        started = ssd.read_ahead(0, E)
        assert len(started) == 2 and all(k[0] == 1 for k in started)
        assert set(pinned) <= set(ssd.cache.resident())
        ssd.release(pinned)
        ssd.close()


def test_threaded_answer_copies_equal_the_file(q8, monkeypatch):
    layout = ExpertLayout.from_model(q8)
    E = layout.n_experts(0)
    monkeypatch.setattr(S, "PARALLEL_COPY_ROWS", 2)  # the tiny layer's 8 experts take the threaded copy
    with ExpertReader(layout, threads=2) as reader:
        ssd = build_stores(layout, _all_on_ssd(layout), reader, n_slots=E).ssd
        flags = np.arange(E) % 3 != 1  # some rows unflagged: they must come back zero
        answer = ssd.fetch(1, np.arange(E), flags)
        assert ssd._copier is not None  # the threaded path ran
        for e in range(E):
            want = _expected(q8, layout, (1, e))
            for got, w in zip(answer, want):
                np.testing.assert_array_equal(got[e].reshape(-1), w if flags[e] else np.zeros_like(w))
        assert ssd.stats.copy_s > 0
        ssd.close()


ALL_SSD = {"name": "all-ssd", "tier0_bytes": 0.0, "tier1_bytes": 0.0, "placement_source": "uniform",
           "slot_cache_slots": 8}


@pytest.mark.slow  # two tiered engines' compiles (~40 s each on 2 cores); CI runs it with the slow files
@pytest.mark.parametrize("prompt_width", [0, 8])
def test_the_read_ahead_keeps_the_bits_of_a_tiered_prefill(synthetic_model, tmp_path, prompt_width):
    """Layer-major groups (width 1) and the wide pass, every expert on the SSD with a slot per expert: the same
    logits and state with the read-ahead on and off, and on it really read the next layers ahead."""
    profile = tmp_path / "all-ssd.json"
    profile.write_text(json.dumps(ALL_SSD))
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=128, prefill_chunk=32,
                         prompt_width=prompt_width, profile=str(profile))
    ssd = engine.tiers.stores.ssd
    # what the feed announces, and each union call of the last SSD layer: asked, and whether it read ahead (the
    # programs capture the bound method when they are traced, so this goes in before the first feed)
    announced, last_calls, last = [], [], max(ssd._layer_keys)
    expect, read_ahead = ssd.expect_passes, ssd.read_ahead
    ssd.expect_passes = lambda n: (announced.append(n), expect(n))[1]

    def recorded(layer, asked):
        started = read_ahead(layer, asked)
        if layer == last:
            last_calls.append((asked >= S.SET_AHEAD_SHARE * len(ssd._layer_keys[last]), bool(started)))
        return started

    ssd.read_ahead = recorded
    tokens = np.random.default_rng(5).integers(8, 200, 70).tolist()
    runs = {}
    for on in (False, True):
        ssd.set_ahead = on
        before = dict(ssd.stats.to_dict())
        del announced[:], last_calls[:]
        session = engine.session()
        runs[on] = (session.feed(tokens, all_logits=True), session.state)
        after = ssd.stats.to_dict()
        runs[on] += ({k: after[k] - before[k] for k in ("set_ahead", "prefetch_used", "misses")},)
    # every announced pass ran (a pass-sized call of the last layer), and all but the last read the next one's
    # first layer ahead
    passes = [wrapped for is_pass, wrapped in last_calls if is_pass]
    assert announced[0] >= 2 and len(passes) == announced[0]
    assert passes == [True] * (announced[0] - 1) + [False]
    # a caller that says more prompt follows (the scheduler's read_next) has the last pass read ahead too
    del announced[:], last_calls[:]
    more = engine.session()
    more.read_next(tokens[:5])
    np.testing.assert_array_equal(more.feed(tokens, all_logits=True), runs[True][0])
    assert announced[0] == len(passes) + 1 and all(w for is_pass, w in last_calls if is_pass)
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(runs[True][1]), jax.tree.leaves(runs[False][1]),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
    assert runs[False][2]["set_ahead"] == 0
    assert runs[True][2]["set_ahead"] > 0 and runs[True][2]["prefetch_used"] > 0
    engine.tiers.close()
