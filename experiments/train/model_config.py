"""The trained model's config: MODEL.md §6 `small` deepseek41 (V4 per-layer layout), fitted to a real tokenizer.

The preset's Engram multipliers and vocab belong to the synthetic tokenizer; a trained tokenizer has its own
vocab size and its own number of Engram token-map classes (the multipliers' bound depends on it), so both are
rebuilt here. The bucket start (rows per Engram table / n_buckets) is chosen by the caller to fit the size budget.
Alignment is 32: the writer pads every shard of a split set to the file alignment, but only the first shard
carries `general.alignment`, so readers take 32 for the others.
"""

from __future__ import annotations

import dataclasses

from jds41.checkpoints import presets
from jds41.config import DSparkConfig, ModelConfig
from jds41.engram_hash import make_engram_config


def build_config(size: str, vocab_size: int, n_classes: int, engram_bucket_start: int | None = None,
                 noise_token_id: int = 7, expert_ff: int | None = None) -> ModelConfig:
    """`size` "small" (the shipped model) or "tiny" (CPU tests), with this vocab / token-map class count;
    `expert_ff` overrides the routed/shared expert width I (a multiple of 32 for MXFP4 rows)."""
    base = presets.preset("deepseek41", size)
    if expert_ff is not None:
        base = dataclasses.replace(base, expert_ff=expert_ff)
    e = base.engram
    start = engram_bucket_start if engram_bucket_start is not None else (e.primes[0][0] - 1)
    engram = make_engram_config(e.layer_ids, e.n_heads, e.head_dim, e.max_ngram, start, n_classes, e.pad_id)
    d = base.dspark
    cfg = dataclasses.replace(base, vocab_size=vocab_size, engram=engram, alignment=32,
                              dspark=DSparkConfig(d.target_layer_ids, noise_token_id, d.block_size, d.markov_rank))
    ModelConfig.from_metadata({k: v for k, v, _ in cfg.to_metadata()}, path="<train config>")  # validates
    return cfg


def fit_engram(size: str, vocab_size: int, n_classes: int, budget_bytes: int, experts: str = "mxfp4",
               expert_ff: int | None = None, max_bucket_start: int = 20000, min_bucket_start: int = 500) -> ModelConfig:
    """The config whose Engram tables take what `budget_bytes` leaves after every other tensor (bucket start
    capped at the preset's 20000, MODEL.md §6); raises ValueError when even `min_bucket_start` does not fit."""
    from experiments.train.export import plan_bytes

    def total(start: int) -> int:
        return plan_bytes(build_config(size, vocab_size, n_classes, start, expert_ff=expert_ff), experts)["total"]

    lo, hi = min_bucket_start, max_bucket_start
    if total(lo) > budget_bytes:
        raise ValueError(f"the model needs {total(lo) / 2**20:.1f} MiB with the smallest Engram tables, over the "
                         f"{budget_bytes / 2**20:.1f} MiB budget")
    while lo < hi:  # largest start that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= budget_bytes else (lo, mid - 1)
    return build_config(size, vocab_size, n_classes, lo, expert_ff=expert_ff)
