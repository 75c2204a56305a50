"""A layer-major group shorter than its program (jds41/prefill.py `n_valid`, jds41/prompt_pieces.py TAIL) and the
last-token head (`last_logits`): the same bits as the group run alone, and the engine's tiered piece plan that
reads the rest of a prompt after its full chunks as one such group.

References: `prefill_layer_major` on exactly the n tokens (itself bit-identical to the token-major scan,
tests/test_prefill_layer_major.py), and an engine with prefill_chunk=0 (the token-major scan and steps).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41 import model as M
from jds41 import prefill as PF
from jds41 import prompt_pieces as PP
from jds41.engine import Engine

SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1}


def _group(engine, state, tokens, capacity=None, last=False):
    """prefill_layer_major over `tokens`, padded to `capacity` rows (n_valid = len(tokens)) when given."""
    n = len(tokens)
    padded = list(tokens) + [0] * ((capacity or n) - n)
    rows = engine.engram_rows(padded, [])
    return PF.prefill_layer_major(engine.plan, engine.params, state, jnp.asarray(padded, jnp.int32),
                                  None if rows is None else jnp.asarray(rows), True, (0,), last,
                                  None if capacity is None else jnp.int32(n))


def _profile(tmp_path):
    path = tmp_path / "split3.json"
    path.write_text(json.dumps(SPLIT))
    return str(path)


SLOW = pytest.mark.slow


# The default run keeps one architecture's untiered case (the README's ~15-minute budget); the others are slow.
@pytest.mark.parametrize("arch,tiered", [("deepseek41", False), pytest.param("deepseek4", False, marks=SLOW),
                                         pytest.param("deepseek41", True, marks=SLOW)])
def test_a_short_group_in_a_longer_program_equals_the_group_alone(synthetic_model, tmp_path, arch, tiered):
    engine = Engine.open(str(synthetic_model(arch, "tiny", "q8")), max_ctx=64,
                         profile=_profile(tmp_path) if tiered else None)
    tokens = np.random.default_rng(11).integers(8, engine.vocab_size, 11).tolist()
    want_logits, want_state, want_trace, want_feat = _group(engine, M.init_state(engine.plan), tokens)
    got_logits, got_state, got_trace, got_feat = _group(engine, M.init_state(engine.plan), tokens, capacity=16)
    np.testing.assert_array_equal(np.asarray(got_logits)[:11], np.asarray(want_logits))
    assert not np.asarray(got_logits)[11:].any()  # rows never read stay zero
    np.testing.assert_array_equal(np.asarray(got_feat)[:11], np.asarray(want_feat))
    for key in want_trace:
        np.testing.assert_array_equal(np.asarray(got_trace[key])[:11], np.asarray(want_trace[key]), err_msg=key)
    assert int(got_state["pos"]) == 11
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
    # the last token's head alone, in the padded program and in the exact one
    for capacity in (16, None):
        last = _group(engine, M.init_state(engine.plan), tokens, capacity=capacity, last=True)[0]
        assert last.shape == (1, engine.vocab_size)
        np.testing.assert_array_equal(np.asarray(last)[0], np.asarray(want_logits)[-1])


def test_tiered_pieces_read_the_rest_after_full_chunks_as_one_group():
    tail = PP.TAIL
    assert PP.prompt_pieces(200, 1, 4096, tiered=True) == [(tail, 200)]
    assert PP.prompt_pieces(5000, 1, 4096, tiered=True) == [("layer-major", 4096), (tail, 904)]
    # below LAYER_MAJOR_MIN the rest stays token-major: a small group moves more than its tokens' experts
    assert PP.prompt_pieces(4096 + 40, 1, 4096, tiered=True) == ([("layer-major", 4096), ("scan", 32)]
                                                                 + [("step", 1)] * 8)
    # resident engines keep the power-of-two pieces, and chunk 0 stays the token-major reference
    assert PP.prompt_pieces(200, 1, 4096) == [("layer-major", 128), ("layer-major", 64)] + [("step", 1)] * 8
    assert PP.prompt_pieces(70, 1, 0, tiered=True) == [("scan", 32)] * 2 + [("step", 1)] * 6
    # every tail runs one program: the warm-up feeds one tail, not one per length
    lengths = PP.piece_lengths(4096, 1, 4096, tiered=True)
    assert lengths == [1, 32, 64, 4096]
    pieces = {p for n in lengths for p in PP.prompt_pieces(n, 1, 4096, tiered=True)}
    assert {how for how, _ in pieces} == {"step", "scan", tail, "layer-major"}


@pytest.mark.slow
def test_a_tiered_session_reads_a_tail_group_with_the_reference_bits(synthetic_model, tmp_path, monkeypatch):
    """chunk 16, LAYER_MAJOR_MIN 4: 39 tokens are 16 + 16 + a 7-token tail group in the 16-row program; every
    position's logits, the last-token feed and the greedy continuation equal the token-major engine's."""
    monkeypatch.setattr(PF, "LAYER_MAJOR_MIN", 4)
    path, profile = str(synthetic_model("deepseek41", "tiny", "q8")), _profile(tmp_path)
    tokens = np.random.default_rng(12).integers(8, 200, 39).tolist()
    assert PP.prompt_pieces(len(tokens), 1, 16, tiered=True) == [("layer-major", 16)] * 2 + [(PP.TAIL, 7)]
    grouped = Engine.open(path, max_ctx=64, prefill_chunk=16, profile=profile)
    reference = Engine.open(path, max_ctx=64, prefill_chunk=0, profile=profile)
    want = reference.session().feed(tokens, all_logits=True)
    np.testing.assert_array_equal(grouped.session().feed(tokens, all_logits=True), want)
    np.testing.assert_array_equal(grouped.session().feed(tokens), want[-1])
    assert list(grouped.session().generate(tokens, 4)) == list(reference.session().generate(tokens, 4))
