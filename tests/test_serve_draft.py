"""`python -m jds41.serve MODEL --draft DRAFT.gguf` (real server process, real openai client): a greedy completion
is drafted (the spec_decode counters move) and gives the text of plain greedy decode in `Session.generate`, the
path of `python -m jds41.generate`, computed here in-process without any drafter, and the text of a server
without --draft; a sampled request beside it completes too."""

from __future__ import annotations

import openai
import pytest
from serve_harness import CTX, start_server, tiny_model

from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.engine import Engine, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_drafted_completion_equals_plain_greedy_decode(tmp_path_factory):
    model = tiny_model(tmp_path_factory)  # the serve tests' one-layer deepseek4
    draft = tmp_path_factory.mktemp("serve-draft") / "draft.gguf"
    write_synthetic(draft, preset("deepseek4", "tiny", layers=1, draft_stages=2), quant="f32", progress=False,
                    draft_only=True)
    engine = Engine.open(str(model), max_ctx=CTX)
    prompts = [list(range(5, 30)), [11, 200, 7, 7, 3]]
    want = [engine.tokenizer.decode(list(engine.session().generate(p, 20, SamplingParams())), skip_special=False)
            for p in prompts]

    srv = start_server(tmp_path_factory, "draft", "--draft", str(draft))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        sampled = c.completions.create(model="tiny-l1", prompt=[9, 9, 9], max_tokens=8, temperature=0.7, seed=1)
        got = [c.completions.create(model="tiny-l1", prompt=p, max_tokens=20, temperature=0) for p in prompts]
        assert [r.choices[0].text for r in got] == want
        assert all(r.usage.completion_tokens == 20 for r in got)
        assert sampled.usage.completion_tokens == 8
        drafted = srv.metric("jds41:spec_decode_num_draft_tokens_total")
        assert drafted > 0 and 0 <= srv.metric("jds41:spec_decode_num_accepted_tokens_total") <= drafted
        timings = [r.model_extra["timings"] for r in got]  # per request, llama.cpp's draft_n / draft_n_accepted
        assert all(t["draft_n"] > 0 for t in timings) and sum(t["draft_n"] for t in timings) == drafted
        assert sum(t["draft_n_accepted"] for t in timings) == srv.metric("jds41:spec_decode_num_accepted_tokens_total")
        assert sampled.model_extra["timings"]["draft_n"] == 0
    finally:
        srv.stop()
    # and a server without the draft (its batched step agrees with Session.generate to float rounding; on these
    # prompts no near-tie separates them: SERVING.md's "identical with and without the draft")
    plain = start_server(tmp_path_factory, "draft-plain")
    try:
        c = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [c.completions.create(model="tiny-l1", prompt=p, max_tokens=20, temperature=0).choices[0].text
                for p in prompts] == want
        assert plain.metric("jds41:spec_decode_num_draft_tokens_total") == 0
    finally:
        plain.stop()
