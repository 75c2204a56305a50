"""`python -m jds41.serve MODEL --profile PROFILE.json` (real server process, real openai client): with the routed
experts split across HBM, pinned host memory and the SSD, each request decodes in its own session, and the
completions equal `Session.generate` of an engine opened in-process with the same profile (greedy through the
device loop, sampled and logprobs requests through the single-sequence step), also when a request resumes from
the prefix cache (`usage.prompt_tokens_details.cached_tokens` says how far). /metrics counts the expert traffic
by tier and /props reports the placement."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_harness import CTX, start_server, tiny_model

from jds41.engine import Engine, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Two of the tiny model's 8 experts per layer in HBM, two in pinned host memory, four on the SSD through 2 slots
# (fewer than a request needs over time: the slot cache evicts and refills). The serve tests' model has one layer,
# so there is no next layer for a look-ahead to guess.
PROFILE = {"name": "three-tiers", "tier0_bytes": 0.25, "tier1_bytes": 0.25, "placement_source": "uniform",
           "slot_cache_slots": 2, "lookahead": False, "router_lean": {"enabled": False}, "engram_tables": "ssd"}


def test_tiered_server_equals_in_process_generate(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    profile = tmp_path_factory.mktemp("serve-tiered") / "three-tiers.json"
    profile.write_text(json.dumps(PROFILE))
    engine = Engine.open(str(model), max_ctx=CTX, profile=str(profile))
    assert list(engine.tiers.placement.tier_experts) == [2, 2, 4]  # every tier holds experts of the layer
    greedy = [list(range(5, 30)), [11, 200, 7, 7, 3]]
    greedy_params, sampled_params = SamplingParams(), SamplingParams(temperature=0.8, seed=3)

    def text(prompt, n, params):
        return engine.tokenizer.decode(list(engine.session().generate(prompt, n, params)), skip_special=True)

    want_greedy = [text(p, 40, greedy_params) for p in greedy]  # 40 tokens: more than one device-loop chunk of 16
    want_sampled = text([9, 9, 9], 12, sampled_params)

    ids = list(range(3, 40))  # a prompt, then the same prompt extended by 3 ids: resumes from all of the first
    want_extended = text(ids + [7, 8, 9], 4, greedy_params)

    srv = start_server(tmp_path_factory, "tiered", "--profile", str(profile), "--prefix-cache-bytes", str(64 << 20))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = [c.completions.create(model="tiny-l1", prompt=p, max_tokens=40, temperature=0) for p in greedy]
        sampled = c.completions.create(model="tiny-l1", prompt=[9, 9, 9], max_tokens=12, temperature=0.8, seed=3)
        logprobs = c.completions.create(model="tiny-l1", prompt=greedy[1], max_tokens=6, temperature=0, logprobs=2)
        assert [r.choices[0].text for r in got] == want_greedy
        assert sampled.choices[0].text == want_sampled
        assert logprobs.choices[0].text == text(greedy[1], 6, greedy_params)  # the one-token step, logits kept
        assert len(logprobs.choices[0].logprobs.tokens) == 6
        lookups = {t: srv.metric("jds41:expert_lookups_total", f'tier="{t}"') for t in ("hbm", "host", "ssd")}
        assert all(v > 0 for v in lookups.values()), lookups
        assert 0 < srv.metric("jds41:expert_hits_total", 'tier="ssd"') <= lookups["ssd"]
        assert srv.metric("jds41:expert_hits_total", 'tier="host"') == lookups["host"]
        assert srv.metric("jds41:ssd_read_bytes_total") > 0
        c.completions.create(model="tiny-l1", prompt=ids, max_tokens=2, temperature=0)
        extended = c.completions.create(model="tiny-l1", prompt=ids + [7, 8, 9], max_tokens=4, temperature=0)
        assert extended.usage.prompt_tokens_details.cached_tokens == len(ids)
        assert extended.choices[0].text == want_extended
        props = httpx.get(srv.url + "/props", timeout=10).json()
        assert props["profile"] == str(profile) and props["tiers"]["profile"] == "three-tiers"
        assert min(props["tiers"][k] for k in ("hbm_bytes", "host_bytes", "ssd_bytes")) > 0
    finally:
        srv.stop()
