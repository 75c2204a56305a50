"""The one-loop greedy decode (jds41/decode_loop.py) gives exactly the reference path's tokens and leaves the session
where the reference leaves it: `Session.generate` at temperature 0, one jitted step and one host round trip per
token, is the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jds41.decode_loop import decode_forced, greedy_generate
from jds41.engine import Engine, SamplingParams

PROMPT = [5, 17, 3, 99, 42, 7, 64, 12, 200, 31]


def _reference(engine, prompt, n, stop=()):
    s = engine.session()
    toks = list(s.generate(prompt, n, SamplingParams(), stop))
    return toks, s


def _fused(engine, prompt, n, stop=()):
    s = engine.session()
    logits = s.feed(prompt)
    return greedy_generate(s, int(np.argmax(logits)), n, stop), s


def _same_state(a, b):
    import jax

    la, lb = jax.tree.leaves(a.state), jax.tree.leaves(b.state)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.tokens == b.tokens


@pytest.mark.parametrize("arch,quant", [("deepseek41", "q8"), ("deepseek4", "mxfp4")])
def test_loop_equals_reference_tokens_and_state(synthetic_model, arch, quant):
    engine = Engine.open(str(synthetic_model(arch, "tiny", quant)), max_ctx=96)
    ref, s_ref = _reference(engine, PROMPT, 40)
    got, s_got = _fused(engine, PROMPT, 40)
    assert got == ref and len(got) == 40
    _same_state(s_got, s_ref)
    # the session goes on from where the loop left it exactly as from the reference
    assert s_got.feed([got[-1]]).tolist() == s_ref.feed([ref[-1]]).tolist()


def test_a_loop_sized_larger_stops_at_its_limit(synthetic_model):
    """greedy_generate with n_max above max_new (the server's fixed-size chunks) yields max_new tokens and leaves the
    session where the reference does after max_new: the loop does not run on to its size."""
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=96)
    ref, s_ref = _reference(engine, PROMPT, 5)
    s = engine.session()
    got = greedy_generate(s, int(np.argmax(s.feed(PROMPT))), 5, n_max=17)
    assert got == ref and len(got) == 5
    _same_state(s, s_ref)


@pytest.mark.parametrize("arch,quant", [("deepseek41", "q8"), ("deepseek4", "mxfp4")])
def test_forced_stream_equals_feeding_the_tokens(synthetic_model, arch, quant):
    """decode_forced (the benchmarks' fixed token stream) = Session.feed of the same tokens: same argmax after each
    fed token, same state."""
    engine = Engine.open(str(synthetic_model(arch, "tiny", quant)), max_ctx=96)
    stream = [int(t) for t in np.random.default_rng(1).integers(0, engine.vocab_size, 30)]
    ref = engine.session()
    ref.feed(PROMPT)
    want = np.argmax(ref.feed(stream[:-1], all_logits=True), axis=-1)
    got = engine.session()
    got.feed(PROMPT)
    np.testing.assert_array_equal(decode_forced(got, stream), want)
    _same_state(got, ref)


def test_loop_stops_where_the_reference_stops(synthetic_model):
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=96)
    free, _ = _reference(engine, PROMPT, 30)
    stop = (free[7], 100000)  # a token the model does produce: both stop at its first occurrence, unfed
    ref, s_ref = _reference(engine, PROMPT, 30, stop)
    got, s_got = _fused(engine, PROMPT, 30, stop)
    assert got == ref and got[-1] == free[7] and len(got) <= 8
    _same_state(s_got, s_ref)


def test_loop_stops_at_the_context_limit(synthetic_model):
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=len(PROMPT) + 6)
    ref, s_ref = _reference(engine, PROMPT, 30)
    got, s_got = _fused(engine, PROMPT, 30)
    assert got == ref and len(s_got.tokens) == engine.max_ctx
    _same_state(s_got, s_ref)


@pytest.mark.slow
def test_loop_with_tiered_experts_matches_and_counts_the_same(synthetic_model):
    """Experts across HBM / host / SSD (the real O_DIRECT tier and slot cache): same tokens, same tier counts."""
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    stats = []
    outs = []
    for fn in (_reference, _fused):
        engine = Engine.open(path, max_ctx=96, profile="ssd-heavy")
        toks, _ = fn(engine, PROMPT, 24)
        outs.append(toks)
        st = engine.tiers.stats()
        stats.append((st["tokens"], *(st[t]["lookups"] for t in ("hbm", "host", "ssd"))))
    assert outs[0] == outs[1]
    assert stats[0] == stats[1] and stats[0][0] > 0


def test_generate_cli_device_loop_equals_step_loop():
    """`python -m jds41.generate` uses the device loop for greedy decoding; `--step-loop` is the reference."""
    from jds41.generate import _parse, run

    model = str(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-deepseek41-q8.gguf")
    base = [model, "-p", "def fibonacci(n):", "-n", "12", "--json", "--ignore-eos"]
    fused, ref = run(_parse(base)), run(_parse([*base, "--step-loop"]))
    assert fused["tokens"] == ref["tokens"] and len(fused["tokens"]) == 12
