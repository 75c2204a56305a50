"""The JAX model against the independent float64 numpy reference (tests/reference), for both architectures.

The reference computes every position of a sequence at once, with explicit key sets and no cache, so agreement
means the cached decode state (window ring, compressor partial groups, compressed rows, indexer keys, Engram
history) reproduces a full forward pass. Prompts run past the window and past several compressed rows of every
ratio the tiny configs have (4 and 16/128). Greedy generation is checked against the argmax of the reference
forward over the growing prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference.gguf_weights import load_token_map, load_weights
from reference.numpy_deepseek import forward

from jds41 import model as M
from jds41.engine import Engine, SamplingParams

# (arch, size, prompt length): deepseek4 tiny has an HCA ratio of 128, so its prompt must pass 2 x 128 tokens.
CASES = [("deepseek4", "tiny", 300), ("deepseek41", "tiny", 80), ("deepseek41", "tiny-shared", 80)]
# Logits have a scale of ~4; f32 against float64 over 4-8 layers stays near 1e-6 (measured), so 1e-4 has margin.
ATOL = 1e-4


def _reference(path, tokens):
    return forward(Engine.open(str(path)).cfg, load_weights(path), np.asarray(tokens), token_map=load_token_map(path))


@pytest.mark.parametrize("arch,size,T", CASES)
def test_prefill_logits_match_reference(synthetic_model, arch, size, T):
    path = synthetic_model(arch, size)
    engine = Engine.open(str(path), max_ctx=512)
    tokens = np.random.default_rng(1).integers(8, engine.vocab_size, T).tolist()
    ours = engine.session().feed(tokens, all_logits=True)
    ref = _reference(path, tokens)
    assert ours.shape == ref.shape == (T, engine.vocab_size)
    err = np.abs(ours - ref).max(axis=1)
    assert err.max() < ATOL, f"worst position {int(err.argmax())}: {err.max():.3g}"
    assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("arch,size", [("deepseek4", "tiny"), ("deepseek41", "tiny-shared")])
def test_greedy_decode_equals_argmax_of_full_forward(synthetic_model, arch, size):
    path = synthetic_model(arch, size)
    engine = Engine.open(str(path), max_ctx=512)
    prompt = np.random.default_rng(2).integers(8, engine.vocab_size, 37).tolist()
    out = list(engine.session().generate(prompt, 24, SamplingParams()))
    assert len(out) == 24
    ref = _reference(path, prompt + out[:-1])
    expected = ref.argmax(axis=1)[len(prompt) - 1:]
    np.testing.assert_array_equal(out, expected)


def test_prefill_chunks_and_single_steps_agree(synthetic_model):
    """Prompt chunks (scan) and one-token steps are the same per-token program: bit-identical logits."""
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny")), max_ctx=256)
    tokens = np.random.default_rng(3).integers(8, engine.vocab_size, 70).tolist()
    chunked = engine.session().feed(tokens, all_logits=True)
    stepwise = engine.session()
    single = np.stack([stepwise.feed([t]) for t in tokens])
    np.testing.assert_array_equal(chunked, single)


def test_decode_does_not_recompile(synthetic_model):
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny")), max_ctx=128)
    session = engine.session()
    session.feed([9, 10, 11])
    before = M.decode_step._cache_size()
    for t in range(20, 40):
        session.feed([t])
    assert M.decode_step._cache_size() == before


def test_bad_tokens_and_context_overflow_are_request_errors(synthetic_model):
    from jds41.engine import RequestError

    engine = Engine.open(str(synthetic_model("deepseek4", "tiny")), max_ctx=16)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.session().feed([engine.vocab_size])
    with pytest.raises(RequestError, match="maximum context length is 16 tokens"):
        engine.session().feed(list(range(8, 25)))
