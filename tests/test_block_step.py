"""Decode at a row width (jds41/block_step.py): a verify block of W real rows equals decode at the same width.

The row-batched step is the same model as the one-token step (close, not bit-equal: batched matvecs sum in their
own order), and it is bit-identical to itself across calls: row i of a verify block (speculative.verify_block
how="batched") gives exactly the logits and state that decode at width W (block_step.decode_rows: the token in
row 0, padding after it, rolled back to one position) gives at that position. That is what makes drafting exact
when the engine decodes at the verify width.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41 import model as M
from jds41.block_step import decode_rows
from jds41.engine import Engine
from jds41.speculative import rollback, verify_block

CTX = 96
W = 4
SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1}


def _rows(engine, tokens, history):
    rows = engine.engram_rows(tokens, history)
    return None if rows is None else jnp.asarray(rows)


def _same(got, want, what):
    lg = jax.tree_util.tree_flatten_with_path(jax.device_get(got))[0]
    lw = jax.tree_util.tree_flatten_with_path(jax.device_get(want))[0]
    assert [p for p, _ in lg] == [p for p, _ in lw], what
    for (path, g), (_, w) in zip(lg, lw, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=f"{what}{jax.tree_util.keystr(path)}")


def _open(synthetic_model, tmp_path, arch, tiered):
    profile = None
    if tiered:
        profile = tmp_path / "split3.json"
        profile.write_text(json.dumps(SPLIT))
    engine = Engine.open(str(synthetic_model(arch, "tiny", "q8")), max_ctx=CTX,
                         profile=None if profile is None else str(profile))
    return engine, dataclasses.replace(engine.plan, ring_slack=W - 1)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("arch,tiered", [pytest.param("deepseek4", False, marks=SLOW), ("deepseek41", False),
                                         pytest.param("deepseek41", True, marks=SLOW)])
def test_verify_rows_equal_decode_at_the_same_width(synthetic_model, tmp_path, arch, tiered):
    engine, plan = _open(synthetic_model, tmp_path, arch, tiered)
    try:
        rng = np.random.default_rng(1)
        prompt = rng.integers(8, engine.vocab_size, 5).tolist()
        stream = rng.integers(8, engine.vocab_size, 30).tolist()
        state0 = M.init_state(plan)
        _, state0 = M.prefill(plan, engine.params, state0, jnp.asarray(prompt, jnp.int32),
                              _rows(engine, prompt, []))
        # decode at width W, one position per call: the reference
        want_logits, want_states, st = [], [], jax.tree.map(jnp.copy, state0)
        for i, t in enumerate(stream):
            rows = _rows(engine, [t], prompt + stream[:i])
            lg, st = decode_rows(plan, engine.params, st, jnp.int32(t), None if rows is None else rows[0], False, (), W)
            want_logits.append(np.asarray(lg))
            want_states.append(jax.tree.map(np.asarray, st))
        # verify blocks of W real rows, keeping a random prefix of each
        st, i, n_blocks = jax.tree.map(jnp.copy, state0), 0, 0
        while i + W <= len(stream):
            block = stream[i:i + W]
            res = verify_block(plan, engine.params, st, jnp.asarray(block, jnp.int32),
                               _rows(engine, block, prompt + stream[:i]), how="batched")
            keep = int(rng.integers(1, W + 1))
            for j in range(keep):
                np.testing.assert_array_equal(np.asarray(res[0][j]), want_logits[i + j], err_msg=f"position {i + j}")
            st = rollback(plan, res[1], res[2], res[3], jnp.int32(keep))
            i += keep
            n_blocks += 1
            _same(st, want_states[i - 1], f"state after position {i - 1}")
        assert n_blocks >= 8 and i >= 20  # past several compressor group ends
        # the same model as the one-token step (the reference path), up to summation order
        ref_state = jax.tree.map(jnp.copy, state0)
        for j, t in enumerate(stream[:8]):
            rows = _rows(engine, [t], prompt + stream[:j])
            lg, ref_state = M.decode_step(plan, engine.params, ref_state, jnp.int32(t),
                                          None if rows is None else rows[0])
            scale = np.abs(want_logits[j]).max()
            np.testing.assert_allclose(want_logits[j], np.asarray(lg), atol=1e-4 * scale, rtol=0)
    finally:
        if engine.tiers is not None:
            engine.tiers.close()


@pytest.mark.slow
def test_drafting_at_the_decode_width_equals_plain_decode_at_that_width(tmp_path):
    """An engine that decodes at width k+1: plain greedy decode (host step loop and device loop) and DSpark drafting
    (real drafter, forced all-right drafts: host path and device loop) give the same tokens; each verify block is
    one batched pass, and both sessions read the prompt in batched blocks."""
    from jds41.checkpoints.presets import preset
    from jds41.checkpoints.synth import write_synthetic
    from jds41.decode_loop import greedy_generate
    from jds41.speculative import DSparkDrafter, SpeculativeSession
    from jds41.speculative_loop import ForcedDrafter

    cfg = preset("deepseek41", "tiny", draft_stages=2)
    path = tmp_path / "m.gguf"
    write_synthetic(path, cfg, quant="q8", progress=False)
    k = cfg.dspark.block_size
    # prompt groups of two (k+1)-row blocks: both sessions read the first 20 prompt tokens as four batched blocks
    engine = Engine.open(str(path), max_ctx=CTX, decode_width=k + 1, prefill_chunk=2 * (k + 1))
    assert engine.plan.decode_width == k + 1 and engine.plan.ring_slack >= k
    prompt, n_new = [5, 17, 99, 3, 42] * 4 + [7, 8, 9], 40
    want = list(engine.session().generate(prompt, n_new))
    s = engine.session()
    assert greedy_generate(s, int(np.argmax(s.feed(prompt))), n_new) == want
    drafters = {"dspark": lambda: DSparkDrafter.open(engine, "self"),
                "all-right": lambda: ForcedDrafter(engine, prompt + want, True, k, cfg.dspark.target_layer_ids)}
    for name, make in drafters.items():
        for step_loop in (True, False):
            spec = SpeculativeSession(engine, make(), step_loop=step_loop)
            assert spec.verify_mode == "batched"
            assert list(spec.generate(prompt, n_new)) == want, (name, step_loop)
            if name == "all-right":
                assert spec.stats.accepted == spec.stats.drafted > 0
    # width 1 is the one-token step: the same model, equal up to float rounding (not required to be bitwise)
    narrow = Engine.open(str(path), max_ctx=CTX)
    wide_logits = engine.session().feed(prompt + want[:8], all_logits=True)
    narrow_logits = narrow.session().feed(prompt + want[:8], all_logits=True)
    np.testing.assert_allclose(wide_logits, narrow_logits, atol=1e-4 * np.abs(narrow_logits).max(), rtol=0)
    from jds41.errors import Jds41Error
    with pytest.raises(Jds41Error, match="decodes at width"):
        SpeculativeSession(Engine.open(str(path), max_ctx=CTX, decode_width=k), DSparkDrafter.open(engine, "self"))


# slow (~150 s on 2 cores): the default run's width property is test_verify_rows_equal_decode_at_the_same_width
@pytest.mark.parametrize("tiered", [pytest.param(False, marks=SLOW), pytest.param(True, marks=SLOW)])
def test_prompt_pieces_at_the_decode_width_equal_decode_at_that_width(synthetic_model, tmp_path, monkeypatch,
                                                                       tiered):
    """A prompt cut into whole W-row blocks (block_step.prefill_rows, a scan of batched passes; pieces of 6, 4 and 1
    blocks) and single width-W steps gives, position by position, the logits, routing and DSpark features of
    feeding it one token at a time through decode_rows at width W, and the same state after the last one; so does
    the layer-major pass at width W (layer_major_rows) over the same blocks."""
    from jds41 import prompt_pieces as PP

    monkeypatch.setattr(PP, "ROWS_MIN_BLOCKS", 1)
    engine, _ = _open(synthetic_model, tmp_path, "deepseek41", tiered)
    plan = dataclasses.replace(engine.plan, decode_width=W, ring_slack=W - 1)
    trace, features = engine.tiers is not None, (0, plan.cfg.n_layers - 1)
    try:
        prompt = np.random.default_rng(3).integers(8, engine.vocab_size, 6 * W + 4 * W + W + 3).tolist()
        pieces = PP.prompt_pieces(len(prompt), W, 6 * W)
        assert [h for h, _ in pieces] == ["rows"] * 3 + ["step"] * 3 and [n for _, n in pieces][:3] == [24, 16, 4]

        def run(cut):
            st, outs, i = M.init_state(plan), [], 0
            for how, n in cut:
                res = PP.run_piece(plan, engine.params, st, how, prompt[i:i + n],
                                   _rows(engine, prompt[i:i + n], prompt[:i]), trace, features)
                st, i = res[1], i + n
                outs.append([res[0], *res[2:]])
            return jax.tree.map(lambda *a: np.concatenate(a), *outs), st

        got, got_state = run(pieces)
        want, want_state = run([("step", 1)] * len(prompt))
        _same(got, want, "per-position outputs")
        _same(got_state, want_state, "state after the prompt")
        # the layer-major pass at width W: the same rows, each layer's experts moved once per group
        lm, lm_state = run([("layer-major-rows", n) if how == "rows" else (how, n) for how, n in pieces])
        _same(lm, want, "layer-major per-position outputs")
        _same(lm_state, want_state, "layer-major state after the prompt")
    finally:
        if engine.tiers is not None:
            engine.tiers.close()
