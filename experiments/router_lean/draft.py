"""Draft acceptance under the router lean (issue #11): sweep.py's `--draft` option.

The lean changes the target model's routing, so its greedy tokens change; the DSpark drafter was trained against the
unbiased model, so it may guess them less often. Per margin, on the same engine, placement and fixed margin as the
sweep's other measures: greedy speculative decoding (temperature 0) of `n_new` tokens from each prompt, its
acceptance rate and tokens per verify step (bench_draft.draft_summary, as bench_draft counts them), and whether its
tokens equal plain greedy decode's under the SAME margin (drafting never changes the output: a correctness check
that must hold at every margin). Prompts: bench_draft's `--texts` selection (the first `length` tokens of the first
held-out documents at least that long), or random ids without texts.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_draft import _prompts, draft_summary  # noqa: E402  (sibling script)
from heldout import text_prompts  # noqa: E402

from jds41.decode_loop import greedy_generate  # noqa: E402
from jds41.speculative import SpeculativeSession  # noqa: E402
from jds41.tiers.experts import with_lean_margin  # noqa: E402


def greedy_continuation(engine, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decode of `n` tokens after `prompt` (the first is the prompt's argmax), as one device loop."""
    s = engine.session()
    return greedy_generate(s, int(np.argmax(s.feed(prompt))), n)


def draft_prompts(engine, texts: str | None, kind: str | None, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """bench_draft's prompts: held-out documents of `kind` (code by default) when `texts` is given, else random."""
    if texts:
        return text_prompts(engine.tokenizer, texts, n, length, kind or "code")
    return _prompts(engine.vocab_size, n, length, seed)


def measure_draft(engine, drafter, margin: float, prompts: list[list[int]], n_new: int,
                  reference: dict | None = None) -> dict:
    """The `draft_*` fields of one margin's row. With `reference` (margin 0's result), also how many of the plain
    greedy tokens the lean left unchanged (`draft_plain_agreement`): what the drafter has to follow. The returned
    `_plain` (the plain outputs) is for that comparison, not for the row."""
    engine.params = with_lean_margin(engine.params, margin)
    plain, stats, tokens, identical, first_diff = [], [], 0, True, None
    for i, prompt in enumerate(prompts):
        want = greedy_continuation(engine, prompt, n_new)
        drafter.reset()
        s = SpeculativeSession(engine, drafter)
        got = list(s.generate(prompt, n_new))
        if got != want and identical:
            identical = False
            first_diff = [i, next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))]
        plain.append(want)
        stats.append(s.stats.to_dict())
        tokens += len(got) - 1
    summary = draft_summary(stats, tokens)
    row = {"draft_acceptance_rate": summary["acceptance_rate"], "draft_tokens_per_step": summary["tokens_per_step"],
           "draft_identical_to_plain": identical, "draft_verify_steps": summary["verify_steps"],
           "draft_verify": s.verify_mode if prompts else None, "_plain": plain}
    if first_diff is not None:
        row["draft_first_difference"] = first_diff  # [prompt, position]
    if reference is not None:
        same = np.concatenate([np.asarray(a[:min(len(a), len(b))]) == np.asarray(b[:min(len(a), len(b))])
                               for a, b in zip(reference["_plain"], plain)] or [np.ones(0, bool)])
        row["draft_plain_agreement"] = round(float(same.mean()), 5) if same.size else None
    return row
