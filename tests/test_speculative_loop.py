"""The device loop of speculative decoding (jds41/speculative_loop.py) against its two references: plain greedy
decode (Session.generate and decode_loop.greedy_generate) for the tokens, and the host-orchestrated
SpeculativeSession (step_loop=True) for everything it leaves behind: target state leaf for leaf, token history,
drafter state leaf for leaf, draft statistics, tier counts.

Tiny synthetic models with 2 DSpark draft stages (block 3), both architectures; the DSpark drafter from the file
itself and from a separate draft file; forced drafts (ForcedDrafter: plain decode's continuation, or never it) for
all-right / all-wrong blocks and for a stop id that falls inside an accepted block; a prompt that runs into the
context end (the last iterations are plain steps); experts split across HBM / host / SSD, with the verify blocks
run layer-major and token-major. One max_new (N_NEW) for every call, so each architecture compiles the loop once
per drafter kind.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jds41 import speculative_loop
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.decode_loop import greedy_generate
from jds41.engine import Engine
from jds41.speculative import DSparkDrafter, SpeculativeSession
from jds41.speculative_loop import ForcedDrafter, speculative_generate

ARCHS = ("deepseek4", "deepseek41")
N_NEW = 72
CTX = 96
PROMPT = [5, 17, 99, 3, 42]
LONG_PROMPT = [300 + i % 37 for i in range(40)]  # 40 + 72 > CTX: the generation runs into the context end


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (model file with draft stages, matching separate draft file), written on first use."""
    root, cache = tmp_path_factory.mktemp("specloop"), {}

    def get(arch):
        if arch not in cache:
            cfg = preset(arch, "tiny", draft_stages=2)
            path, draft = root / f"{arch}.gguf", root / f"{arch}-draft.gguf"
            write_synthetic(path, cfg, quant="q8", progress=False)
            write_synthetic(draft, cfg, quant="q8", progress=False, draft_only=True)
            cache[arch] = (str(path), str(draft))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def engines(files):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = Engine.open(files(arch)[0], max_ctx=CTX)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def plain(engines):
    """(arch, prompt) -> Session.generate's N_NEW greedy tokens (the reference of every token test)."""
    cache = {}

    def get(arch, prompt):
        key = (arch, tuple(prompt))
        if key not in cache:
            cache[key] = list(engines(arch).session().generate(prompt, N_NEW))
        return cache[key]

    return get


def _same_leaves(a, b, what):
    la, lb = jax.tree_util.tree_flatten_with_path(jax.device_get(a))[0], jax.tree_util.tree_flatten_with_path(
        jax.device_get(b))[0]
    assert [p for p, _ in la] == [p for p, _ in lb], what
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), (what, jax.tree_util.keystr(path))


def _both(engine, make_drafter, prompt, stop=()):
    """Run the host-orchestrated reference and the device loop with fresh drafters; check that they leave the same
    session and drafter behind; (tokens, device-loop session)."""
    runs = []
    for step_loop in (True, False):
        drafter = make_drafter()
        s = SpeculativeSession(engine, drafter, step_loop=step_loop)
        assert s.step_loop is step_loop
        runs.append((list(s.generate(prompt, N_NEW, stop_ids=stop)), s, drafter))
    (ref, s_ref, d_ref), (got, s_got, d_got) = runs
    assert got == ref
    assert s_got.tokens == s_ref.tokens
    _same_leaves(s_got.state, s_ref.state, "target state")
    _same_leaves(d_got.state, d_ref.state, "drafter state")
    assert s_got.stats == s_ref.stats
    return got, s_got


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_loop_equals_plain_decode_and_the_host_path(engines, files, plain, arch):
    engine = engines(arch)
    want = plain(arch, PROMPT)
    s = engine.session()
    assert greedy_generate(s, int(np.argmax(s.feed(PROMPT))), N_NEW) == want  # both plain paths agree
    for source in ("self", files(arch)[1]):
        got, spec = _both(engine, lambda source=source: DSparkDrafter.open(engine, source), PROMPT)
        assert got == want and len(got) == N_NEW, source
        st = spec.stats
        assert st.emitted == N_NEW - 1 and st.drafted == 3 * st.steps and st.plain_steps == 0
        assert len(spec.tokens) == len(PROMPT) + N_NEW - 1  # the last token is never fed
    # the session goes on from where the loop left it exactly as from the reference path
    np.testing.assert_array_equal(spec.feed([got[-1]]), s.feed([want[-1]]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("right", [True, False], ids=["all-right", "all-wrong"])
def test_forced_drafts(engines, plain, arch, right):
    engine = engines(arch)
    want = plain(arch, PROMPT)
    k = engine.cfg.dspark.block_size
    layers = engine.cfg.dspark.target_layer_ids

    def make():
        return ForcedDrafter(engine, PROMPT + want, right, k, layers)

    got, s = _both(engine, make, PROMPT)
    assert got == want
    st = s.stats
    if right:  # every draft kept: k+1 tokens per verify step
        assert st.accepted == st.drafted and st.steps == -(-(N_NEW - 1) // (k + 1))
    else:  # one target token per verify step
        assert st.accepted == 0 and st.steps == N_NEW - 1
    assert int(s.drafter.state["observed"]) == len(s.tokens)  # features of exactly the committed positions


@pytest.mark.slow
def test_stop_id_inside_an_accepted_block(engines, plain):
    """All-right drafts with a stop id that is accepted mid-block: the output stops at it, while the state keeps the
    whole accepted block, exactly as the reference leaves it."""
    arch = "deepseek41"
    engine = engines(arch)
    want = plain(arch, PROMPT)
    k = engine.cfg.dspark.block_size
    # the first token whose first occurrence is not the last token of a block (index 1 + m*(k+1) + k)
    i = next(i for i in range(5, N_NEW) if want.index(want[i]) == i and (i - 1) % (k + 1) != k)
    stop = (want[i], 100000)
    got, s = _both(engine, lambda: ForcedDrafter(engine, PROMPT + want, True, k, engine.cfg.dspark.target_layer_ids),
                   PROMPT, stop)
    assert got == want[:i + 1]
    assert len(s.tokens) > len(PROMPT) + i  # the accepted block past the stop id was fed (as the reference does)
    # and the plain reference stops at the same token
    assert list(engine.session().generate(PROMPT, N_NEW, stop_ids=stop)) == got


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_context_end(engines, plain, arch):
    """A prompt that leaves fewer than N_NEW positions: the last iterations are plain steps, the output ends where
    plain decode's does (the context is full)."""
    engine = engines(arch)
    want = plain(arch, LONG_PROMPT)
    assert len(LONG_PROMPT) + len(want) - 1 == CTX  # the reference itself stops at the context end
    got, s = _both(engine, lambda: DSparkDrafter.open(engine, "self"), LONG_PROMPT)
    assert got == want and len(s.tokens) == CTX
    assert s.stats.plain_steps > 0


def _tiered_run(path, step_loop, verify="auto"):
    """(24 tokens, session, tier counts) of a fresh engine under ssd-heavy; step_loop None: plain decode."""
    engine = Engine.open(path, max_ctx=CTX, profile="ssd-heavy")
    if step_loop is None:
        s = engine.session()
    else:
        s = SpeculativeSession(engine, DSparkDrafter.open(engine, "self"), step_loop=step_loop, verify=verify)
        assert s.verify_mode == verify
    out = list(s.generate(PROMPT, 24))
    st = engine.tiers.stats()
    engine.tiers.close()
    return out, s, (st["tokens"], *(st[t]["lookups"] for t in ("hbm", "host", "ssd")))


@pytest.fixture(scope="module")
def tiered_plain(files):
    """arch -> plain decode's run under ssd-heavy (shared by both verify modes)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = _tiered_run(files(arch)[0], None)
        return cache[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("verify", ["layer-major", "token-major"])
def test_tiered_experts(files, tiered_plain, arch, verify):
    """Experts across HBM / host / SSD (the real O_DIRECT tier and slot cache), verify blocks layer-major (each
    expert moved once per block; what "auto" picks here) or token-major: same tokens, state and tier counts as the
    host path with the same verify, and plain decode's tokens."""
    path, _ = files(arch)
    outs = [tiered_plain(arch)] + [_tiered_run(path, step_loop, verify) for step_loop in (True, False)]
    counts = [c for _, _, c in outs]
    (plain_out, _, _), (ref, s_ref, _), (got, s_got, _) = outs
    assert got == ref == plain_out
    # every path feeds (and records) the same committed positions with the same routing
    assert counts[0] == counts[1] == counts[2] and counts[2][0] == len(PROMPT) + 23 and counts[2][3] > 0
    assert s_got.tokens == s_ref.tokens
    _same_leaves(s_got.state, s_ref.state, "target state")
    np.testing.assert_array_equal(s_got.expert_counts, s_ref.expert_counts)


def test_device_loop_stops_at_a_stop_id(engines, plain):
    """The default run's check: the DSpark drafter of the file, the device loop alone, stopped by a stop id at the
    first occurrence of plain decode's 16th token."""
    engine = engines("deepseek41")
    drafter = DSparkDrafter.open(engine, "self")
    s = SpeculativeSession(engine, drafter)
    first = int(np.argmax(s.feed(PROMPT)))
    got = speculative_generate(s, drafter, first, N_NEW, stop_ids=(plain("deepseek41", PROMPT)[15],))
    want = plain("deepseek41", PROMPT)
    assert got == want[:want.index(want[15]) + 1]
    assert s.stats.steps > 0 and s.stats.emitted >= len(got) - 1
    # the next call (another session, stop id and prompt) reuses the compiled loop
    compiled = speculative_loop._loop._cache_size()
    drafter.reset()
    s = SpeculativeSession(engine, drafter)
    first = int(np.argmax(s.feed(PROMPT[:3])))
    speculative_generate(s, drafter, first, N_NEW, stop_ids=(want[3], want[9]))
    assert speculative_loop._loop._cache_size() == compiled


@pytest.mark.slow
def test_cli_draft_uses_the_device_loop(files, monkeypatch, capsys):
    """`python -m jds41.generate --draft` runs the device loop; with `--step-loop` the host path; with
    `--verify layer-major` the device loop verifies layer-major (resident experts: auto is token-major); same
    tokens and drafts."""
    import json

    from jds41 import generate, speculative_loop

    calls = []
    real = speculative_loop.speculative_generate
    monkeypatch.setattr(speculative_loop, "speculative_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    path, draft = files("deepseek41")
    base = [path, "--tokens", ",".join(map(str, PROMPT)), "-n", str(N_NEW), "--json", "--ctx", str(CTX),
            "--ignore-eos", "--draft", draft]
    results = []
    for extra in ([], ["--step-loop"], ["--verify", "layer-major"]):
        assert generate.main(base + extra) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert calls == [1, 1]  # the --step-loop run did not go through the device loop
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"] and len(results[0]["tokens"]) == N_NEW
    assert results[0]["draft"] == results[1]["draft"] == {**results[2]["draft"], "verify": "token-major"}
    assert results[2]["draft"]["verify"] == "layer-major"
