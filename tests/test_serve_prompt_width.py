"""`python -m jds41.serve MODEL --prompt-width R` (real server process, real openai client): prompts are read in
R-row blocks with grouped expert products (ModelPlan.prompt_width), and the completions equal `Session.generate`
of an engine opened in-process with the same prompt width, for prompts shorter than a block, of whole blocks, and
longer than a prefill group (several pieces and a rest block), greedy and seeded-sampled. /props reports the width.
The reference is independent of the server's scheduler, batching and warm-up: one session of a fresh engine."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_harness import CTX, start_server, tiny_model

from jds41.engine import Engine, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

R, CHUNK = 8, 32


def test_a_server_at_a_prompt_width_equals_in_process_generate(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    engine = Engine.open(str(model), max_ctx=CTX, prefill_chunk=CHUNK, prompt_width=R)
    prompts = [[11, 200, 7, 7, 3], list(range(5, 21)), [(7 * i) % 250 + 3 for i in range(77)]]
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, seed=3)

    def text(prompt, n, params):
        return engine.tokenizer.decode(list(engine.session().generate(prompt, n, params)), skip_special=True)

    want = [text(p, 24, greedy) for p in prompts]
    want_sampled = text(prompts[2], 12, sampled)
    decode_width = Engine.open(str(model), max_ctx=CTX, prefill_chunk=CHUNK)  # prompt width 0: decode's arithmetic
    ref_logits = decode_width.session().feed(prompts[2])

    srv = start_server(tmp_path_factory, "prompt-width", "--prompt-width", str(R), "--prefill-chunk", str(CHUNK))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = [c.completions.create(model="tiny-l1", prompt=p, max_tokens=24, temperature=0) for p in prompts]
        assert [r.choices[0].text for r in got] == want
        assert [r.usage.prompt_tokens for r in got] == [len(p) for p in prompts]
        s = c.completions.create(model="tiny-l1", prompt=prompts[2], max_tokens=12, temperature=0.8, seed=3)
        assert s.choices[0].text == want_sampled
        props = httpx.get(srv.url + "/props", timeout=10).json()
        assert props["prompt_width"] == R and props["decode_width"] == 1
    finally:
        srv.stop()
    # the setting is a numerics of its own: the same values as decode's arithmetic to f32 rounding, not its bits
    wide_logits = engine.session().feed(prompts[2])
    assert not (wide_logits == ref_logits).all()
    assert abs(wide_logits - ref_logits).max() <= 1e-5 * abs(ref_logits).max()
