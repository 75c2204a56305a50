"""The scheduler's speculative lane (serve --draft): greedy requests decode with the DSpark drafter in the device
loop, a chunk per iteration, beside sampled requests in the batched step.

Reference: `Session.generate` at temperature 0 (what `python -m jds41.generate` prints), computed independently of
the scheduler and of drafting. Tiny deepseek41 with 2 draft stages (block 3).
"""

from __future__ import annotations

import numpy as np
import pytest

from jds41 import scheduler as S
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.engine import Engine, SamplingParams
from jds41.errors import Jds41Error
from jds41.speculative import DSparkDrafter

CTX = 96
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("schedraft") / "m.gguf"
    write_synthetic(path, preset("deepseek41", "tiny", draft_stages=2), quant="q8", progress=False)
    return str(path)


@pytest.fixture(scope="module", params=[1, 4], ids=["width1", "width4"])
def engine(model, request):
    """Width 1 (token-major verify) and the draft block's width, 3 + 1 (batched verify, `serve --decode-width 4`);
    plain greedy decode at the same width is the reference."""
    return Engine.open(model, max_ctx=CTX, decode_width=request.param)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(8, 512, n).tolist()


def _plain(engine, prompt, n, stop=()) -> list[int]:
    return list(engine.session().generate(prompt, n, GREEDY, stop_ids=stop))


def _collect(handle):
    events = list(handle.iter_events(timeout=300))
    return [e.id for e in events[:-1]], events[-1]


@pytest.mark.slow
def test_drafted_requests_equal_plain_greedy_beside_sampled_ones(engine):
    drafter = DSparkDrafter.open(engine, "self")
    sched = S.Scheduler(engine, n_slots=3, max_queue=8, drafter=drafter, draft_chunk=5)
    sched.start()
    try:
        prompts = [_prompt(1, 9), _prompt(2, 40), _prompt(3, 3)]  # 40 > PREFILL_CHUNK: scan pieces, then steps
        want = [_plain(engine, p, 23) for p in prompts]
        handles = [sched.submit(S.GenRequest(p, 23, GREEDY)) for p in prompts[:2]]
        sampled = sched.submit(S.GenRequest(_prompt(4, 6), 17, SamplingParams(temperature=0.8, seed=5)))
        handles.append(sched.submit(S.GenRequest(prompts[2], 23, GREEDY)))  # waits for a slot
        for h, w in zip(handles, want, strict=True):
            got, fin = _collect(h)
            assert got == w and fin.reason == "length" and fin.completion_tokens == 23
        toks, fin = _collect(sampled)
        assert fin.reason == "length" and len(toks) == 17
        assert sched.stats.draft_tokens_total > 0 and 0 <= sched.stats.draft_accepted_total <= \
            sched.stats.draft_tokens_total
        assert sched.stats.generation_tokens_total == 3 * 23 + 17

        # a stop id inside a drafted chunk ends the request there (the stop token is counted, not sent)
        stop = want[0][6]
        got, fin = _collect(sched.submit(S.GenRequest(prompts[0], 23, GREEDY, stop_ids=(stop,))))
        assert got == want[0][:want[0].index(stop)] and fin.reason == "stop"
        # logprobs need the logits, which the device loop does not keep: the batched lane serves it, same tokens
        # up to float rounding (batching.py), so only the shape of the answer is checked here
        toks, fin = _collect(sched.submit(S.GenRequest(prompts[1], 4, GREEDY, logprobs=2)))
        assert fin.reason == "length" and len(toks) == 4
    finally:
        sched.stop()
    assert not any(sched._slots) and sched.stats.running == 0


@pytest.mark.slow
def test_a_drafter_that_does_not_fit_the_decode_width_fails_at_load(model):
    engine = Engine.open(model, max_ctx=CTX, decode_width=3)  # the draft block verifies 4 rows
    with pytest.raises(Jds41Error, match="decodes at width 3"):
        S.Scheduler(engine, drafter=DSparkDrafter.open(engine, "self"))
