"""The wide pass's tail (jds41/prompt_pieces.py WIDE_TAIL; jds41/layer_major_rows.py `n_valid`): the whole R-row
blocks after a prompt's full groups read by the full group's program with a traced block count.

References are independent cuts of the same prompt, never values from this code path: the tail's blocks read as a
group of exactly their own size (its own program, a scan of a static block count), and engines whose groups are a
single block (prefill_chunk = R: no tail ever). Every row of the wide pass must get the same bits in any of them.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41 import layer_major_rows as LMR
from jds41 import model as M
from jds41 import prefill as PF
from jds41 import prompt_pieces as PP
from jds41.engine import Engine

R, CHUNK = 8, 32  # full groups of 4 blocks
SLOW = pytest.mark.slow
SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1}


def _tokens(n, seed=31):
    return np.random.default_rng(seed).integers(8, 200, n).tolist()


def _profile(tmp_path) -> str:
    path = tmp_path / "split3.json"
    path.write_text(json.dumps(SPLIT))
    return str(path)


def _assert_same_state(got, want):
    assert int(got["pos"]) == int(want["pos"])
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


def test_a_wide_prompt_runs_at_most_three_programs():
    """Full groups, then at most one tail of whole blocks shorter than a group, then at most one rest; the warm-up's
    lengths run each program once (every tail and every rest share one)."""
    for n in range(1, 300):
        pieces = PP.prompt_pieces(n, 1, CHUNK, prompt_width=R)
        assert sum(m for _, m in pieces) == n
        kinds = [how for how, _ in pieces]
        assert kinds == sorted(kinds, key=("wide", PP.WIDE_TAIL, PP.WIDE_REST).index), (n, pieces)
        assert kinds.count(PP.WIDE_TAIL) <= 1 and kinds.count(PP.WIDE_REST) <= 1
        for how, m in pieces:
            if how == "wide":
                assert m == CHUNK
            elif how == PP.WIDE_TAIL:
                assert 0 < m < CHUNK and m % R == 0
            else:
                assert 0 < m < R
    for chunk, width in ((CHUNK, R), (4096, 64), (0, R)):
        lengths = PP.piece_lengths(300, 1, chunk, prompt_width=width)
        programs = {(how, 0 if how != "wide" else m) for n in lengths
                    for how, m in PP.prompt_pieces(n, 1, chunk, prompt_width=width)}
        assert len(lengths) == len(programs)  # one feed per program
        assert len(programs) == (2 if chunk == 0 else 3 if chunk <= 300 else 2)  # chunk 0: no tail; 4096: no full
    assert PP.prompt_pieces(24, 1, 0, prompt_width=R) == [("wide", R)] * 3  # chunk 0: one block per group


def _group(engine, state, tokens, blocks=None, last=False, history=()):
    """prefill_layer_major_rows at the prompt width over `tokens` (whole blocks), padded to `blocks` blocks with a
    traced n_valid when given; the routing trace and the first and last layers' features come back too."""
    n = len(tokens)
    padded = list(tokens) + [0] * ((blocks or n // R) * R - n)
    rows = engine.engram_rows(padded, list(history))
    state = jax.tree.map(jnp.copy, state)  # the call donates its state
    tok = jnp.asarray(padded, jnp.int32).reshape(-1, R)
    rows = None if rows is None else jnp.asarray(rows).reshape(-1, R, *rows.shape[1:])
    feature_layers = (0, engine.cfg.n_layers - 1)
    return LMR.prefill_layer_major_rows(engine.plan, engine.params, state, tok, rows, True, feature_layers, R, last,
                                        None if blocks is None else jnp.int32(n // R))


# The default run keeps one architecture's untiered case (the README's ~15-minute budget); the others are slow.
@pytest.mark.parametrize("arch,tiered", [("deepseek41", False), pytest.param("deepseek4", False, marks=SLOW),
                                         pytest.param("deepseek41", True, marks=SLOW)])
def test_a_tail_in_the_group_program_equals_its_blocks_read_alone(synthetic_model, tmp_path, arch, tiered):
    """After a full group, 3 blocks read by the 4-block program (n_valid 3) and by a 3-block program: logits, routing,
    features and every leaf of the state the same; the last-row head alone the same as the last row."""
    engine = Engine.open(str(synthetic_model(arch, "tiny", "q8")), max_ctx=128, prefill_chunk=CHUNK, prompt_width=R,
                         profile=_profile(tmp_path) if tiered else None)
    tokens = _tokens(CHUNK + 3 * R)
    first, tail = tokens[:CHUNK], tokens[CHUNK:]
    state = _group(engine, M.init_state(engine.plan), first)[1]
    want = _group(engine, state, tail, history=first)
    got = _group(engine, state, tail, blocks=CHUNK // R, history=first)
    n = len(tail)
    np.testing.assert_array_equal(np.asarray(got[0])[:n], np.asarray(want[0]))
    assert not np.asarray(got[0])[n:].any()  # rows never read stay zero
    _assert_same_state(got[1], want[1])
    assert int(got[1]["pos"]) == len(tokens)
    for key in want[2]:
        np.testing.assert_array_equal(np.asarray(got[2][key])[:n], np.asarray(want[2][key]), err_msg=key)
    np.testing.assert_array_equal(np.asarray(got[3])[:n], np.asarray(want[3]))
    last = _group(engine, state, tail, blocks=CHUNK // R, last=True, history=first)[0]
    assert last.shape == (1, engine.vocab_size)
    np.testing.assert_array_equal(np.asarray(last)[0], np.asarray(want[0])[-1])


# slow for both: test_prompt_width.py's cuts (default run) cover tails after a full group too
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek41", "deepseek4"])
def test_prompts_with_a_tail_give_the_bits_of_one_block_groups(synthetic_model, arch):
    """61 tokens are a full group, a 3-block tail and a 5-token rest; an engine whose groups are single blocks
    (prefill_chunk = R) reads the same prompt without a tail: all logits and the state the same, and cuts of the
    prompt whose pieces have other tails too."""
    path = str(synthetic_model(arch, "tiny", "q8"))
    tokens = _tokens(61)
    assert [how for how, _ in PP.prompt_pieces(61, 1, CHUNK, prompt_width=R)] == ["wide", PP.WIDE_TAIL, PP.WIDE_REST]
    blockwise = Engine.open(path, max_ctx=128, prefill_chunk=R, prompt_width=R).session()
    want = blockwise.feed(tokens, all_logits=True)
    engine = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R)
    for cuts in ([61], [16, 45], [40, 21]):  # tails of 3 blocks; 2 then 1; 1 then 2 (after a full group)
        s, out, i = engine.session(), [], 0
        for n in cuts:
            out.append(s.feed(tokens[i:i + n], all_logits=True))
            i += n
        np.testing.assert_array_equal(np.concatenate(out), want, err_msg=str(cuts))
        _assert_same_state(s.state, blockwise.state)
    np.testing.assert_array_equal(engine.session().feed(tokens[:56]), want[55])  # a feed ending in a tail


@pytest.mark.slow
def test_tiered_tails_prefix_resume_and_drafting_keep_the_bits(synthetic_model, tmp_path):
    """Tiered experts (HBM / host / SSD), a prefix-cache resume in the middle of a block, and a speculative
    session's feed (target features handed to the drafter, cut on the host): the resident one-block-group bits."""
    from jds41.speculative import DSparkDrafter, SpeculativeSession

    path = str(synthetic_model("deepseek41", "tiny", "q8", draft_stages=2))
    tokens = _tokens(61)
    reference = Engine.open(path, max_ctx=128, prefill_chunk=R, prompt_width=R)
    want = reference.session().feed(tokens, all_logits=True)

    tiered = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R, profile=_profile(tmp_path))
    s = tiered.session()
    np.testing.assert_array_equal(s.feed(tokens, all_logits=True), want)
    ref_state = reference.session()
    ref_state.feed(tokens)
    _assert_same_state(s.state, ref_state.state)

    cached = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R, prefix_cache_bytes=1 << 26)
    list(cached.session().generate(tokens[:37], 1))  # snapshots at 32 (a chunk boundary) and 37
    resumed = cached.session()
    n = resumed.restore_prefix(tokens)
    assert n == 37
    assert [how for how, _ in PP.prompt_pieces(len(tokens) - n, 1, CHUNK, prompt_width=R)][0] == PP.WIDE_TAIL
    np.testing.assert_array_equal(resumed.feed(tokens[n:], all_logits=True), want[n:])

    resident = Engine.open(path, max_ctx=128, prefill_chunk=CHUNK, prompt_width=R)
    spec = SpeculativeSession(resident, DSparkDrafter.open(resident, "self"))
    np.testing.assert_array_equal(spec.feed(tokens, all_logits=True), want)


@pytest.mark.slow
def test_padding_blocks_bring_no_expert(synthetic_model, tmp_path, monkeypatch):
    """Prompt width 2, groups of 4 blocks, SSD experts: a one-block tail read in the 4-block program asks the union
    (and the SSD) for exactly the experts the same block asks for read as its own group (prefill_chunk = R)."""
    width = 2
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    profile = _profile(tmp_path)
    tokens = _tokens(4 * width + width, seed=5)
    unions: list = []
    real_union = PF.expert_union

    def recorded(idx_TK, n_experts):
        union, valid, pos = real_union(idx_TK, n_experts)
        jax.debug.callback(lambda u, v: unions.append(tuple(np.asarray(u)[np.asarray(v)].tolist())), union, valid)
        return union, valid, pos

    monkeypatch.setattr(PF, "expert_union", recorded)
    LMR.prefill_layer_major_rows.clear_cache()
    try:
        seen = {}
        for chunk in (4 * width, width):
            engine = Engine.open(path, max_ctx=64, prefill_chunk=chunk, prompt_width=width, profile=profile)
            s = engine.session()
            s.trace_routing = True
            s.feed(tokens[:4 * width])
            jax.effects_barrier()
            ssd = engine.tiers.stores.ssd.stats
            before, unions[:] = ssd.lookups, []
            assert PP.prompt_pieces(width, 1, chunk, prompt_width=width)[0][0] == (PP.WIDE_TAIL if chunk > width
                                                                                    else "wide")
            s.feed(tokens[4 * width:])
            jax.effects_barrier()
            seen[chunk] = (sorted(unions), ssd.lookups - before)
    finally:
        LMR.prefill_layer_major_rows.clear_cache()
    assert seen[4 * width] == seen[width]
    assert seen[width][1] > 0  # the SSD tier was asked
    # not vacuous: a padding block routed anywhere (e.g. as zeros, to expert 0) would have grown some union
    assert any(0 not in u for u in seen[width][0]), seen[width][0]
