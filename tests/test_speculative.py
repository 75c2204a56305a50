"""Speculative decoding gives plain greedy decode's tokens, and its state after a partial accept is plain decode's.

Reference = plain `Session.generate` (one-token `decode_step`s) of the same file; nothing is hard-coded. Both
architectures (tiny presets with 2 DSpark draft stages, block 3): the DSpark drafter from the file itself and from
a separate draft file, an oracle that always proposes plain decode's own next tokens (must accept every draft) and
one that always proposes wrong tokens (must accept none); 256 tokens for several prompts. The state test drives
`SpeculativeSession.verify` with drafts right up to a chosen point and compares every state leaf, bit for bit,
with a session that fed the same tokens one by one (same ring size), across compressor group boundaries.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.engine import Engine, RequestError, SamplingParams
from jds41.speculative import DSparkDrafter, SpeculativeSession, greedy_accept

ARCHS = ("deepseek4", "deepseek41")
N_NEW = 256
CTX = 448
PROMPTS = ([5, 17, 99, 3, 42], [300 + i % 37 for i in range(40)])  # decode-only and prefill-chunk prompts


class _Models(dict):
    """arch (or "deepseek41-shared": the V4.1 shared KV / latent index key layout) -> (engine of a file with draft
    stages, path of the matching separate draft file), written on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, key):
        arch, _, shared = key.partition("-")
        cfg = preset(arch, "tiny-shared" if shared else "tiny", draft_stages=2)
        path, draft = self.root / f"{key}.gguf", self.root / f"{key}-draft.gguf"
        write_synthetic(path, cfg, quant="q8", progress=False)
        write_synthetic(draft, cfg, quant="q8", progress=False, draft_only=True)
        self[key] = (Engine.open(str(path), max_ctx=CTX), str(draft))
        return self[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def plain(models):
    """(arch, prompt index) -> plain greedy decode's N_NEW tokens."""
    cache = {}

    def get(arch, i):
        if (arch, i) not in cache:
            cache[(arch, i)] = list(models[arch][0].session().generate(PROMPTS[i], N_NEW))
        return cache[(arch, i)]

    return get


class Oracle:
    """Proposes plain decode's continuation (right=True) or a token that is never it (right=False)."""

    def __init__(self, engine: Engine, stream: list[int], right: bool):
        self.stream, self.right, self.vocab = stream, right, engine.vocab_size
        self.block_size = engine.cfg.dspark.block_size
        self.feature_layers = engine.cfg.dspark.target_layer_ids  # same compiled programs as the DSpark drafter
        self.observed = 0

    def observe(self, features, pos0, count):
        self.observed += count

    def propose(self, last, pos):
        assert self.stream[pos] == last  # the session hands over plain decode's token at that position
        true = [self.stream[p] if p < len(self.stream) else 0 for p in range(pos + 1, pos + 1 + self.block_size)]
        return true if self.right else [(t + 1) % self.vocab for t in true]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_dspark_drafting_equals_plain_decode(models, plain, arch):
    engine, draft_file = models[arch]
    for i, prompt in enumerate(PROMPTS):
        want = plain(arch, i)
        stats = []
        for source in ("self", draft_file):
            s = SpeculativeSession(engine, DSparkDrafter.open(engine, source))
            assert list(s.generate(prompt, N_NEW)) == want, (arch, i, source)
            assert s.stats.emitted == N_NEW - 1  # every token after the first came from a verify step
            stats.append(s.stats.to_dict())
        assert stats[0] == stats[1]  # a separate draft file holds the same stages: the same drafts


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("right", [True, False], ids=["all-right", "all-wrong"])
def test_forced_drafts_give_plain_decode(models, plain, arch, right):
    engine, _ = models[arch]
    prompt = PROMPTS[1]
    want = plain(arch, 1)
    oracle = Oracle(engine, list(prompt) + want, right)
    s = SpeculativeSession(engine, oracle)
    assert list(s.generate(prompt, N_NEW)) == want
    st = s.stats
    k = engine.cfg.dspark.block_size
    if right:
        assert st.accepted == st.drafted and st.steps * (k + 1) >= N_NEW - 1  # every draft kept, k+1 per step
        assert st.steps == -(-(N_NEW - 1) // (k + 1))
    else:
        assert st.accepted == 0 and st.steps == N_NEW - 1  # one target token per step
    assert oracle.observed == len(s.tokens)  # features of exactly the committed positions


def _leaves(state):
    return jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS + ("deepseek41-shared",))
def test_state_after_partial_accept_equals_plain_decode(models, plain, arch):
    """Keep 1..k+1 positions of each block (random), and compare the whole state with one-token steps. The shared
    layout has ratio-2 / ratio-1 compressors, whose buffers a 4-token block overwrites, and latent index keys."""
    engine, _ = models[arch]
    prompt, want = PROMPTS[1], plain(arch, 1)
    stream = list(prompt) + want
    k = engine.cfg.dspark.block_size
    spec = SpeculativeSession(engine, Oracle(engine, stream, True))
    ref = SpeculativeSession(engine, Oracle(engine, stream, True))  # same plan and ring size, fed one by one
    spec.feed(prompt)
    ref.feed(prompt)
    rng = np.random.default_rng(0)
    checked = set()
    while len(spec.tokens) + k + 1 < len(stream) and len(spec.tokens) < 200:  # crosses ratio-4/16/128 groups
        pos = len(spec.tokens)
        keep = int(rng.integers(1, k + 2))
        drafts = stream[pos + 1:pos + 1 + k]
        drafts = drafts[:keep - 1] + [(t + 1) % engine.vocab_size for t in drafts[keep - 1:]]
        emitted = spec.verify(stream[pos], drafts)
        assert emitted == stream[pos + 1:pos + 1 + keep]
        for t in stream[pos:pos + keep]:
            ref.feed([t])
        assert spec.tokens == ref.tokens
        got, exp = _leaves(spec.state), _leaves(ref.state)
        assert [p for p, _ in got] == [p for p, _ in exp]
        for (path, a), (_, b) in zip(got, exp, strict=True):
            assert np.array_equal(a, b), (arch, pos, keep, jax.tree_util.keystr(path))
        checked.add(keep)
    assert checked == set(range(1, k + 2))


def test_greedy_accept_rule():
    logits = np.zeros((4, 10), np.float32)
    for row, tok in enumerate([3, 5, 7, 9]):
        logits[row, tok] = 1.0
    assert greedy_accept([3, 5, 7], logits) == (3, [3, 5, 7, 9])
    assert greedy_accept([3, 6, 7], logits) == (1, [3, 5])
    assert greedy_accept([4, 5, 7], logits) == (0, [3])


def test_temperature_is_refused(models):
    engine, _ = models["deepseek41"]
    s = SpeculativeSession(engine, DSparkDrafter.open(engine, "self"))
    with pytest.raises(RequestError, match="greedy"):
        next(s.generate([1, 2, 3], 4, SamplingParams(temperature=0.7)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_cli_draft_gives_the_same_tokens(models, arch, capsys):
    """`python -m jds41.generate MODEL --draft DRAFT --tokens ... --json` == the same command without --draft."""
    from jds41 import generate

    engine, draft_file = models[arch]
    base = [engine.path, "--tokens", ",".join(map(str, PROMPTS[0])), "-n", "64", "--json", "--ctx", str(CTX),
            "--ignore-eos"]
    results = []
    for extra in ([], ["--draft", draft_file], ["--draft", "self"]):
        assert generate.main(base + extra) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert len(results[0]["tokens"]) == 64 and "draft" not in results[0]
    for r in results[1:]:
        assert r["tokens"] == results[0]["tokens"]
        assert r["draft"]["verify_steps"] > 0 and 0 <= r["draft"]["acceptance_rate"] <= 1
        assert r["draft"]["tokens_per_step"] >= 1
    assert generate.main(base + ["--draft", draft_file, "--temperature", "0.5"]) == 1
    assert "greedy" in capsys.readouterr().err
