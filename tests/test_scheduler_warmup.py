"""Scheduler.warmup compiles every program serving runs: after it, prompts of any length (layer-major groups of 64,
128 and 256 tokens, the scan, single steps, prompts fed over several iterations) compile nothing, at decode width
1 and at width 2, with prompts read at prompt width 8,
and with tiered experts (whose prompt tails are groups of any length). XLA compilations are
counted with jax.monitoring's backend-compile event plus its persistent-cache-hit event (the suite shares one
compilation cache, so a program another test compiled arrives as a hit), so nothing about which functions are jitted
is assumed here.
The warmed server's tokens are checked by the serving tests."""

from __future__ import annotations

import json

import numpy as np
import pytest
from jax import monitoring

from jds41 import prompt_pieces as PP
from jds41 import scheduler as S
from jds41.engine import Engine

CTX = 320
COMPILES = [0]


def _on_compile(name: str, *_args, **_kw) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


def _on_cache_hit(name: str, *_args, **_kw) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_on_compile)
monitoring.register_event_listener(_on_cache_hit)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(8, 512, n).tolist()


SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("width,tiered,prompt_width", [(1, False, 0), (2, False, 0), (1, True, 0), (1, False, 8)])
def test_after_warmup_no_prompt_length_compiles(synthetic_model, tmp_path, width, tiered, prompt_width):
    """Tiered (chunk 128, so a 256-token feed is two groups): the rest after full chunks is a tail group of any
    length from 64 up (70, 64, 150's 22 tokens stay token-major), one program for every length. Prompt width 8
    (chunk 4096, longer than any feed): every run of whole 8-row blocks is a tail read by the group's program, and
    one rest program serves every n % 8, so the warm-up feeds one prompt per program."""
    profile = None
    if tiered:
        profile = tmp_path / "split3.json"
        profile.write_text(json.dumps(SPLIT))
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny")), max_ctx=CTX, decode_width=width,
                         prompt_width=prompt_width,
                         profile=None if profile is None else str(profile), prefill_chunk=128 if tiered else 4096)
    sched = S.Scheduler(engine, n_slots=2)
    if prompt_width:
        lengths = sched._prompt_lengths()
        pieces = {p for n in lengths for p in PP.prompt_pieces(n, width, engine.prefill_chunk, tiered, prompt_width)}
        assert {how for how, _ in pieces} == {PP.WIDE_TAIL, PP.WIDE_REST} and len(lengths) == 2
    sched.warmup()
    before = COMPILES[0]
    sched.start()
    try:
        # 300 tokens take two iterations (256-token budget); 5 + 70 share one; 150 and 64 stand alone
        lengths = (300, 5, 70, 150, 64, 33)
        handles = [sched.submit(S.GenRequest(_prompt(i, n), 3, S.SamplingParams())) for i, n in enumerate(lengths)]
        finished = [list(h.iter_events(timeout=300))[-1] for h in handles]
    finally:
        sched.stop()
    assert all(isinstance(f, S.Finished) for f in finished), finished
    assert [f.prompt_tokens for f in finished] == list(lengths)
    assert COMPILES[0] == before, f"{COMPILES[0] - before} compilations while serving at width {width}"
