"""The wide prompt pass (ModelPlan.prompt_width; jds41/prompt_pieces.py "wide", WIDE_TAIL and WIDE_REST): prompts
read in R-row blocks, layer-major, with grouped expert products.

Its promise is that a position's bits do not depend on how the prompt was cut: whole, in arbitrary feeds, with
or without layer-major groups (chunk 0: one block per piece), resumed from a prefix-cache snapshot, through tiered
experts, or fed by a speculative session. References are the same engine reading the whole prompt in one feed
(the plain prefill at that width), and, for the values, decode's per-token arithmetic (prompt_width 0), which
must agree to f32 rounding.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jds41 import model as M
from jds41 import prompt_pieces as PP
from jds41.checkpoints.presets import preset
from jds41.engine import Engine
from jds41.speculative import DSparkDrafter, SpeculativeSession

R, CHUNK = 8, 32
SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1}


def _tokens(n, seed=21):
    return np.random.default_rng(seed).integers(8, 200, n).tolist()


def _feed_cut(session, tokens, cuts):
    out, i = [], 0
    for n in [*cuts, len(tokens) - sum(cuts)]:
        out.append(session.feed(tokens[i:i + n], all_logits=True))
        i += n
    return np.concatenate(out)


def _assert_same_state(got, want):
    assert int(got["pos"]) == int(want["pos"])
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


def test_the_wide_piece_plan():
    rest, tail = PP.WIDE_REST, PP.WIDE_TAIL
    assert PP.prompt_pieces(77, 1, 32, prompt_width=8) == [("wide", 32), ("wide", 32), (tail, 8), (rest, 5)]
    assert PP.prompt_pieces(5, 5, 32, tiered=True, prompt_width=8) == [(rest, 5)]
    assert PP.prompt_pieces(24, 1, 0, prompt_width=8) == [("wide", 8)] * 3  # chunk 0: one block per piece
    assert PP.prompt_pieces(4096 + 200, 1, 4096, prompt_width=64) == [("wide", 4096), (tail, 192), (rest, 8)]
    # every rest runs one program, and so does every tail: the warm-up reads one rest, one tail and one full group
    assert PP.piece_lengths(64, 1, 32, prompt_width=8) == [1, 8, 32]
    with pytest.raises(ValueError, match="prompt_width"):  # a grouped tile needs 2 rows
        M.make_plan(preset("deepseek41", "tiny"), 64, prompt_width=1)


# The default run keeps one architecture's untiered case (the README's ~15-minute budget); the others are slow.
@pytest.mark.parametrize("arch", ["deepseek41", pytest.param("deepseek4", marks=pytest.mark.slow)])
def test_any_cut_of_a_prompt_gives_the_same_bits(synthetic_model, arch):
    path = str(synthetic_model(arch, "tiny", "q8"))
    engine = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R)
    tokens = _tokens(77)
    whole = engine.session()
    want = whole.feed(tokens, all_logits=True)
    for cuts in ([3, 29, 1], [40, 30], [8, 8, 8, 8, 8]):
        s = engine.session()
        np.testing.assert_array_equal(_feed_cut(s, tokens, cuts), want, err_msg=str(cuts))
        _assert_same_state(s.state, whole.state)
    for n in (64, 77):  # a feed's own logits (last row only: the head runs on the last block alone) are the same
        np.testing.assert_array_equal(engine.session().feed(tokens[:n]), want[n - 1], err_msg=str(n))
    blockwise = Engine.open(path, max_ctx=128, prefill_chunk=0, prompt_width=R).session()  # no groups at all
    np.testing.assert_array_equal(blockwise.feed(tokens, all_logits=True), want)
    # the same values as decode's arithmetic, to f32 rounding (another summation order in the experts)
    decode = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK).session().feed(tokens, all_logits=True)
    np.testing.assert_allclose(want, decode, rtol=0, atol=1e-5 * np.abs(decode).max())
    assert not np.array_equal(want, decode)  # not decode's bits: the setting is a numerics of its own


@pytest.mark.slow
def test_tiered_experts_resumed_prefixes_and_drafting_keep_the_bits(synthetic_model, tmp_path):
    path = str(synthetic_model("deepseek41", "tiny", "q8", draft_stages=2))
    profile = tmp_path / "split3.json"
    profile.write_text(json.dumps(SPLIT))
    tokens = _tokens(70)
    resident = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R)
    want = resident.session().feed(tokens, all_logits=True)
    want_gen = list(resident.session().generate(tokens, 6))

    tiered = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R, profile=str(profile))
    np.testing.assert_array_equal(_feed_cut(tiered.session(), tokens, [13, 30]), want)
    assert list(tiered.session().generate(tokens, 6)) == want_gen

    cached = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R, prefix_cache_bytes=1 << 26)
    first = cached.session()
    list(first.generate(tokens[:45], 1))  # snapshots at 32 (a chunk boundary) and 45 (the prompt's end)
    resumed = cached.session()
    n = resumed.restore_prefix(tokens)
    assert n == 45  # the longest cached prefix, not on a block boundary: the rest starts mid-block
    np.testing.assert_array_equal(resumed.feed(tokens[n:], all_logits=True), want[n:])

    spec = SpeculativeSession(resident, DSparkDrafter.open(resident, "self"))
    np.testing.assert_array_equal(spec.feed(tokens, all_logits=True), want)
    assert list(SpeculativeSession(resident, DSparkDrafter.open(resident, "self")).generate(tokens, 6)) == want_gen


@pytest.mark.slow
def test_tiered_wide_pass_with_host_moves_held_back_keeps_the_bits(synthetic_model, tmp_path, monkeypatch):
    """JDS41_HOST_STACK_AHEAD=1 (each layer's whole-stack host move tied to the start of the layer before it): the
    same bits as the resident wide pass."""
    from jds41 import layer_major_rows as LMR
    from jds41 import prefill as PF
    from jds41.tiers import experts as TE

    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    profile = tmp_path / "split3.json"
    profile.write_text(json.dumps(SPLIT))
    tokens = _tokens(70)
    want = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R).session().feed(tokens, all_logits=True)
    tied = []
    monkeypatch.setattr(PF, "HOST_STACK_AHEAD", 1)
    monkeypatch.setattr(PF, "tie_host_stacks", lambda tl, at: tied.append(tl.layer) or TE.tie_host_stacks(tl, at))
    for fn in (LMR.prefill_layer_major_rows, LMR.prefill_wide_rest):
        fn.clear_cache()
    tiered = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R, profile=str(profile))
    got = tiered.session().feed(tokens, all_logits=True)
    for fn in (LMR.prefill_layer_major_rows, LMR.prefill_wide_rest):
        fn.clear_cache()
    assert tied  # the held-back moves were traced
    np.testing.assert_array_equal(got, want)
