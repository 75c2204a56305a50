"""The scheduler with a tiered engine (routed experts in HBM, pinned host memory and on the SSD): every request
decodes in its own session (greedy ones through the device loop in chunks, sampled and logprobs ones through the
one-token step), and each request's tokens equal `Session.generate` of the same engine, with more requests than
slots, a stop id inside a chunk, and a request longer than one chunk."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jds41 import scheduler as S
from jds41.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

CTX = 96
PROFILE = {"name": "three-tiers", "tier0_bytes": 0.25, "tier1_bytes": 0.25, "placement_source": "uniform",
           "slot_cache_slots": 2, "lookahead": True, "router_lean": {"enabled": False}, "engram_tables": "ssd"}


def test_tiered_requests_equal_session_generate(synthetic_model, tmp_path):
    profile = tmp_path / "three-tiers.json"
    profile.write_text(json.dumps(PROFILE))
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=CTX, profile=str(profile))
    assert list(engine.tiers.placement.tier_experts)[2] > 0 and list(engine.tiers.placement.tier_experts)[1] > 0
    rng = np.random.default_rng(4)
    prompts = [rng.integers(8, 512, n).tolist() for n in (12, 5, 7)]
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, seed=11)
    want = [list(engine.session().generate(prompts[0], 40, greedy)),  # longer than one 16-token chunk
            list(engine.session().generate(prompts[1], 24, sampled))]
    stop = want[0][20]  # the first request again, with a stop id it meets inside its second chunk
    want.append(list(engine.session().generate(prompts[0], 40, greedy, stop_ids=[stop])))
    assert want[2][-1] == stop and len(want[2]) <= 21
    want.append(list(engine.session().generate(prompts[2], 8, greedy)))

    sched = S.Scheduler(engine, n_slots=2, max_queue=8)  # four requests through two slots
    sched.start()
    try:
        handles = [sched.submit(S.GenRequest(prompts[0], 40, greedy)),
                   sched.submit(S.GenRequest(prompts[1], 24, sampled)),
                   sched.submit(S.GenRequest(prompts[0], 40, greedy, stop_ids=(stop,))),
                   sched.submit(S.GenRequest(prompts[2], 8, greedy, logprobs=2))]
        results = [list(h.iter_events(timeout=300)) for h in handles]
    finally:
        sched.stop()
    for i, (events, expected) in enumerate(zip(results, want)):
        *tokens, end = events
        assert isinstance(end, S.Finished), (i, end)
        ids = [t.id for t in tokens]
        if i == 2:  # the stop token is counted, not sent
            assert ids == expected[:-1] and end.reason == "stop", i
        else:
            assert ids == expected, i
    assert all(t.logprob is not None and len(t.top) == 2 for t in results[3][:-1])
    assert engine.tiers.stores.ssd.stats.lookups > 0 and engine.tiers.lookups[1] > 0


def test_a_tiered_scheduler_reads_a_prompt_chunk_in_one_group(synthetic_model, tmp_path, monkeypatch):
    """A tiered engine's scheduler feeds a 300-token prompt in one slice (one layer-major group of 256, then the
    scan and steps), so each layer's experts move once for it; a resident one feeds 256 tokens per iteration. The
    tokens equal Session.generate either way."""
    profile = tmp_path / "three-tiers.json"
    profile.write_text(json.dumps(PROFILE))
    model = str(synthetic_model("deepseek41", "tiny", "q8"))
    prompt = np.random.default_rng(9).integers(8, 512, 300).tolist()
    fed: list[int] = []
    real_feed = S.Session.feed
    monkeypatch.setattr(S.Session, "feed", lambda self, tokens, *a, **k: fed.append(len(tokens)) or
                        real_feed(self, tokens, *a, **k))
    for tiered, slices in ((True, [300]), (False, [256, 44])):
        engine = Engine.open(model, max_ctx=320, profile=str(profile) if tiered else None)
        want = list(engine.session().generate(prompt, 4, SamplingParams()))
        sched = S.Scheduler(engine, n_slots=1)
        assert sched.prefill_budget == (4096 if tiered else S.PREFILL_BUDGET)
        fed.clear()
        sched.start()
        try:
            *tokens, end = list(sched.submit(S.GenRequest(prompt, 4, SamplingParams())).iter_events(timeout=300))
        finally:
            sched.stop()
        assert isinstance(end, S.Finished) and [t.id for t in tokens] == want, tiered
        assert fed[:len(slices)] == slices, (tiered, fed)
