"""Named model configs: `preset(arch, size, layers=None)` for the tiny / small / full families of MODEL.md §6.

Owns the numbers; `ModelConfig` owns their meaning. Every preset is validated by a metadata round trip through
`ModelConfig.from_metadata`, so a preset is exactly what a file written from it will read back as.

- `deepseek4` presets must load in llama.cpp's DEEPSEEK4 loader (LLAMACPP_DEEPSEEK4.md §5): ratios 0/4/128 only,
  hc 4, one KV head, indexer key length a multiple of 64, >= 16 indexer heads (exact-tie avoidance, §4).
- Widths are multiples of 32 so Q8_0 / MXFP4 apply everywhere; K-quants / IQ2_XXS need rows of 256, so the
  ds4-q2 layout only takes them where a row allows (full shapes), the synthetic writer falls back to Q8_0.
- `tiny` vocab / compressed-vocab sizes are those the synthetic tokenizer is built to (synth_tokenizer.py); the
  Engram multipliers depend on the compressed vocab, so the two must agree.
- `size="tiny-shared"` (deepseek41) is the tiny model in the V4.1 shared KV/indexer layout, so both layouts get
  tested at tiny size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jds41.config import DSparkConfig, ModelConfig
from jds41.engram_hash import make_engram_config, vocab_for_rows

SIZES = ("tiny", "tiny-shared", "small", "full")
# Token count and number of distinct Engram keys of the synthetic tokenizer per size. The full pair is the real
# V4 tokenizer's (129280 ids, 99092 compressed ids), so full-size multipliers equal the real model's.
VOCAB = {"tiny": 512, "small": 8192, "full": 129280}
COMPRESSED_VOCAB = {"tiny": 400, "small": 6400, "full": 99092}



def compressed_vocab(vocab_size: int) -> int:
    """Engram token-map classes of the synthetic tokenizer with this many ids: the preset pairs above, otherwise
    the real tokenizer's ratio (99092 / 129280)."""
    for size, v in VOCAB.items():
        if v == vocab_size:
            return COMPRESSED_VOCAB[size]
    return max(1, round(vocab_size * COMPRESSED_VOCAB["full"] / VOCAB["full"]))


_COMMON = {
    "n_nextn": 0, "rope_base": 10000.0, "compress_rope_base": 160000.0, "rope_scaling": "yarn",
    "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "expert_weights_scale": 1.5, "expert_weights_norm": True,
    "gating_func": "sqrtsoftplus", "hc_mult": 4, "hc_eps": 1e-6, "alignment": 4096,
}


def _tiny(arch: str) -> dict:
    if arch == "deepseek4":
        # 16 indexer heads x 64: llama.cpp's Hadamard needs 64-wide keys and few heads give exact score ties.
        attn = {"n_heads": 2, "head_dim": 64, "rope_dim": 16, "index_n_heads": 16, "index_head_dim": 64,
                "compress_ratios": (0, 4, 128, 0)}
    else:
        attn = {"n_heads": 2, "head_dim": 32, "rope_dim": 8, "index_n_heads": 8, "index_head_dim": 32,
                "compress_ratios": (0, 4, 16, 0)}
    return {"vocab_size": VOCAB["tiny"], "dim": 64, "n_layers": 4, "context_length": 4096, "q_lora_rank": 32,
            "o_lora_rank": 32, "o_groups": 2, "window": 8, "rope_factor": 16.0, "rope_orig_ctx": 1024,
            "index_topk": 4, "n_experts": 8, "n_experts_used": 2, "n_shared_experts": 1, "expert_ff": 32,
            "n_hash_layers": 1, "hc_sinkhorn_iters": 3, "rms_eps": 1e-6, **attn}


def _small(arch: str) -> dict:
    # deepseek4 must stay llama.cpp-loadable: HCA ratio 128 and 64-wide indexer keys; deepseek41 uses ratio 32 so
    # HCA sees >= 32 rows at 1-2k context (MODEL.md §6).
    if arch == "deepseek4":
        hca, index = 128, {"index_n_heads": 16, "index_head_dim": 64}
    else:
        hca, index = 32, {"index_n_heads": 4, "index_head_dim": 32}
    return {"vocab_size": VOCAB["small"], "dim": 512, "n_layers": 8, "context_length": 8192, "n_heads": 8,
            "head_dim": 64, "rope_dim": 16, "q_lora_rank": 192, "o_lora_rank": 128, "o_groups": 4, "window": 64,
            "compress_ratios": (0, 0, 4, hca, 4, hca, 4, 0), "rope_factor": 16.0, "rope_orig_ctx": 1024,
            "index_topk": 64, "n_experts": 64, "n_experts_used": 4, "n_shared_experts": 1, "expert_ff": 96,
            "n_hash_layers": 2, "hc_sinkhorn_iters": 20, "rms_eps": 1e-6, **index}


def _full(arch: str) -> dict:
    if arch == "deepseek4":  # V4-Flash, MODEL.md §1
        return {"vocab_size": VOCAB["full"], "dim": 4096, "n_layers": 43, "context_length": 1048576,
                "n_heads": 64, "head_dim": 512, "rope_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024,
                "o_groups": 8, "window": 128,
                "compress_ratios": (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43)),
                "rope_factor": 16.0, "rope_orig_ctx": 65536, "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 512, "n_experts": 256, "n_experts_used": 6, "n_shared_experts": 1, "expert_ff": 2048,
                "n_hash_layers": 3, "hc_sinkhorn_iters": 20, "rms_eps": 1e-6}
    # V4.1-Flash shapes (MODEL.md §1), shared KV / indexer layout with candidate blocks.
    return {"vocab_size": VOCAB["full"], "dim": 5120, "n_layers": 40, "context_length": 1048576, "n_heads": 64,
            "head_dim": 512, "rope_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8,
            "window": 128, "compress_ratios": (0, 0) + (2,) * 18 + (1,) * 20, "rope_factor": 16.0,
            "rope_orig_ctx": 65536, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
            "n_experts": 384, "n_experts_used": 6, "n_shared_experts": 1, "expert_ff": 2304, "n_hash_layers": 0,
            "hc_sinkhorn_iters": 20, "rms_eps": 1e-20, "kv_source_layer_ids": (2, 8, 14, 20),
            "index_source_layer_ids": (2, 8, 14, 20, 24, 28, 32, 36), "candidate_source_layer_id": 20,
            "candidate_block_size": 8, "candidate_topk_blocks": 2048}


# Engram: (layer ids, heads, head_dim, max_ngram, bucket start) per size; DSpark: (block, markov rank, noise id).
_ENGRAM = {"tiny": ((1,), 2, 32, 3, 64), "small": ((1, 4), 4, 32, 4, 20000), "full": ((1, 14), 8, 256, 4, 16_000_000)}
_DSPARK = {"tiny": (3, 8, 7), "small": (4, 64, 7), "full": (5, 256, 128799)}
# Draft stages' own expert pool (experts, top-k) per size when drafts are written (MODEL.md §4 / §6): V4.1 128e
# top-3, V4-Flash-0731 keeps the target's 256e top-6; small 16e top-2, tiny 4e top-2.
_DRAFT_EXPERTS = {("tiny", "deepseek4"): (4, 2), ("tiny", "deepseek41"): (4, 2), ("small", "deepseek4"): (16, 2),
                  ("small", "deepseek41"): (16, 2), ("full", "deepseek4"): (256, 6), ("full", "deepseek41"): (128, 3)}
DRAFT_STAGES = {"tiny": 2, "small": 2, "full": 3}  # the draft stage count of each size (MODEL.md §6)


def _shared_tiny() -> dict:
    """Tiny V4.1 layout: ratio-2 sources at 1 and 3 (4 and 5 reuse 3), ratio-1 source 6, indexer sources 1, 4, 6
    and candidate blocks from 6, so every sharing rule has a layer that exercises it."""
    return {"n_layers": 8, "compress_ratios": (0, 2, 2, 2, 2, 2, 1, 1), "kv_source_layer_ids": (1, 3, 6),
            "index_source_layer_ids": (1, 4, 6), "candidate_source_layer_id": 6, "candidate_block_size": 2,
            "candidate_topk_blocks": 4}


def preset(arch: str, size: str, layers: int | None = None, nextn: int = 0, draft_stages: int = 0) -> ModelConfig:
    """The named config, optionally truncated to the first `layers` main layers.

    Truncation keeps every per-layer list consistent: ratios[:N], source / Engram / DSpark layer ids < N (a
    candidate source >= N drops candidate selection), hash layers min(original, N). `nextn` appends that many
    MTP blocks (deepseek4 only: V4.1's DSpark drafter is a separate `dflash` file). `draft_stages` appends that
    many DSpark draft stages (`mtp.{s}.*` tensors, both architectures) with the draft's own expert pool; the
    DSpark keys of deepseek41 presets are there either way (they describe the drafter a separate file brings).
    """
    if arch not in ("deepseek4", "deepseek41"):
        raise ValueError(f"unknown architecture {arch!r}")
    if size not in SIZES or (size == "tiny-shared" and arch != "deepseek41"):
        raise ValueError(f"unknown size {size!r} for {arch} (sizes: {', '.join(SIZES)}; tiny-shared is deepseek41)")
    if nextn and arch != "deepseek4":
        raise ValueError("MTP blocks (nextn) exist only in deepseek4 files")
    if nextn and draft_stages:
        raise ValueError("a file has MTP blocks (nextn) or DSpark draft stages, not both")
    base = "tiny" if size == "tiny-shared" else size
    f = {"tiny": _tiny, "small": _small, "full": _full}[base](arch)
    if size == "tiny-shared":
        f.update(_shared_tiny())
    n = f["n_layers"] if layers is None else layers
    if not 1 <= n <= f["n_layers"]:
        raise ValueError(f"layers={layers}: {arch} {size} has {f['n_layers']} layers")
    f["n_layers"] = n
    nextn = nextn or draft_stages  # draft stages are the trailing nextn blocks (ratio 0)
    f["compress_ratios"] = tuple(f["compress_ratios"][:n]) + (0,) * nextn
    f["n_hash_layers"] = min(f["n_hash_layers"], n)
    if f.get("kv_source_layer_ids"):
        f["kv_source_layer_ids"] = tuple(i for i in f["kv_source_layer_ids"] if i < n)
        f["index_source_layer_ids"] = tuple(i for i in f["index_source_layer_ids"] if i < n)
        if f["candidate_source_layer_id"] >= n or not f["kv_source_layer_ids"]:
            f.update(candidate_source_layer_id=-1, candidate_block_size=0, candidate_topk_blocks=0)
    limit = (10.0,) * (n + nextn)
    cfg = ModelConfig(arch=arch, swiglu_limit=limit, swiglu_limit_shexp=limit, **{**_COMMON, **f, "n_nextn": nextn})
    if arch == "deepseek41":
        ids, heads, hdim, max_ngram, start = _ENGRAM[base]
        ids = tuple(i for i in ids if i < n)
        engram = None
        if ids:
            engram = make_engram_config(ids, heads, hdim, max_ngram, start, compressed_vocab(f["vocab_size"]))
        cfg = dataclasses.replace(cfg, engram=engram)
    if arch == "deepseek41" or draft_stages:
        block, rank, noise = _DSPARK[base]
        targets = tuple(range(max(0, n - (3 if base == "full" else 2)), n))
        experts, used = _DRAFT_EXPERTS[(base, arch)] if draft_stages else (None, None)
        cfg = dataclasses.replace(cfg, dspark=DSparkConfig(targets, noise, block, rank, experts, used))
    return _checked(cfg)


def with_engram_rows(cfg: ModelConfig, rows: int) -> ModelConfig:
    """The same model with Engram tables shrunk (or grown) so the first Engram layer has about `rows` rows: the
    bucket start is chosen so the primes sum to ~rows. Multipliers (which depend only on the token map) stay."""
    e = cfg.engram
    if e is None:
        return cfg
    if rows < 2 * e.n_buckets:
        raise ValueError(f"--engram-rows {rows}: at least 2 rows per bucket ({2 * e.n_buckets}) are needed")
    new = make_engram_config(e.layer_ids, e.n_heads, e.head_dim, e.max_ngram, vocab_for_rows(rows, e.n_buckets), 2,
                             e.pad_id)
    new = dataclasses.replace(new, multipliers=e.multipliers)
    return _checked(dataclasses.replace(cfg, engram=new))


def _f32(x):
    """GGUF stores these floats as f32: keep the config at the value a file will read back (1e-6 is not one)."""
    if isinstance(x, float):
        return float(np.float32(x))
    if isinstance(x, tuple) and x and all(isinstance(v, float) for v in x):
        return tuple(float(np.float32(v)) for v in x)
    return x


def _checked(cfg: ModelConfig) -> ModelConfig:
    """Round floats to f32, then validate through the one constructor: a metadata round trip with f32 storage
    must give the same config back."""
    cfg = dataclasses.replace(cfg, **{f.name: _f32(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
    meta = {k: _f32(v) if t == "f32" else (tuple(_f32(tuple(v))) if t == "f32[]" else v)
            for k, v, t in cfg.to_metadata()}
    back = ModelConfig.from_metadata(meta, path=f"<preset {cfg.arch}>")
    if back != cfg:
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(back, f.name)]
        raise AssertionError(f"preset does not round-trip through metadata: {diff}")
    return cfg
