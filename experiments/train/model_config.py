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
                 noise_token_id: int = 7) -> ModelConfig:
    """`size` "small" (the shipped model) or "tiny" (CPU tests), with this vocab / token-map class count."""
    base = presets.preset("deepseek41", size)
    e = base.engram
    start = engram_bucket_start if engram_bucket_start is not None else (e.primes[0][0] - 1)
    engram = make_engram_config(e.layer_ids, e.n_heads, e.head_dim, e.max_ngram, start, n_classes, e.pad_id)
    d = base.dspark
    cfg = dataclasses.replace(base, vocab_size=vocab_size, engram=engram, alignment=32,
                              dspark=DSparkConfig(d.target_layer_ids, noise_token_id, d.block_size, d.markov_rank))
    ModelConfig.from_metadata({k: v for k, v, _ in cfg.to_metadata()}, path="<train config>")  # validates
    return cfg
