"""`ModelConfig`: the frozen description of a DeepSeek V4-Flash / V4.1-Flash model, built only from GGUF metadata.

One constructor (`ModelConfig.from_metadata`) reads every key of MODEL.md §5, applies a default only where
llama.cpp has one (LLAMACPP_DEEPSEEK4.md §1), and validates the whole config once; everything downstream
(tensor schema, layers, tiers) trusts it. `to_metadata` is the exact inverse, used by the synthetic writer,
so the key table lives in this one file.

Architectures:
- `deepseek4`: V4-Flash. Per-layer compressors (ratio 4 = overlapped CSA with indexer, 128 = HCA), hash layers,
  `output_hc_*` head collapse, per-head q RMS norm.
- `deepseek41`: V4.1-Flash. Engram layers, the one-sublayer mHC lag with the final collapse by the last FFN's
  `pre`, no per-head q norm. With `kv_source_layer_ids` set, only those layers compress (ratio 2 = plain pool,
  1 = projection + norm) and later layers share them; with it empty the V4 per-layer layout is used (the
  small and tiny configs of MODEL.md §6 do this, with HCA ratios other than 128, which only jds41 runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jds41.errors import ConfigError

ARCHITECTURES = ("deepseek4", "deepseek41")
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values.
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}
ENGRAM_ENCODINGS = ("e4m3_e8m0_32",)
HC_MIX_WIDTH = lambda hc: (2 + hc) * hc  # noqa: E731  pre | post | comb, MODEL.md §2.1


@dataclasses.dataclass(frozen=True)
class EngramConfig:
    """Engram conditional memory (MODEL.md §3). Hash parameters are stored in the file, per Engram layer."""

    layer_ids: tuple[int, ...]
    n_heads: int
    head_dim: int
    max_ngram: int
    pad_id: int
    encoding: str
    multipliers: tuple[tuple[int, ...], ...]  # [layer][max_ngram], odd int64
    primes: tuple[tuple[int, ...], ...]  # [layer][(max_ngram-1)*n_heads], order-major (n, head)
    offsets: tuple[tuple[int, ...], ...]  # [layer][(max_ngram-1)*n_heads], cumulative row offsets
    rows: tuple[int, ...]  # [layer] table rows = sum(primes)

    @property
    def n_buckets(self) -> int:
        """Rows read per token and layer: one per (n-gram order, head)."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def row_bytes(self) -> int:
        """One table row: head_dim E4M3 bytes plus one E8M0 scale per 32 values (264 B for V4.1)."""
        return self.head_dim + self.head_dim // 32

    @property
    def embed_dim(self) -> int:
        """Width of the concatenated rows of one token (6144 for V4.1)."""
        return self.n_buckets * self.head_dim


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """DSpark drafter settings carried by the target file (MODEL.md §4).

    The draft stages themselves are the file's `nextn_predict_layers` trailing blocks (tensors `mtp.{s}.*`,
    schema.draft_tensors). Their MoE has its own expert pool (V4.1: 128 experts top-3, MODEL.md §4): keys
    `{arch}.dspark.expert_count` / `.expert_used_count`, None when absent (then the stages use the target's).
    """

    target_layer_ids: tuple[int, ...]
    noise_token_id: int
    block_size: int
    markov_rank: int
    n_experts: int | None = None
    n_experts_used: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int  # main blocks, without trailing MTP / draft blocks
    n_nextn: int  # trailing MTP / DSpark blocks in block_count
    context_length: int
    n_heads: int
    head_dim: int  # K = V latent width (512 in the real models)
    rope_dim: int  # RoPE on the last rope_dim dims
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int
    compress_ratios: tuple[int, ...]  # per block incl. nextn blocks
    rope_base: float  # ratio-0 layers, no YaRN
    compress_rope_base: float  # ratio>0 layers (+ YaRN when rope_scaling == "yarn")
    rope_scaling: str  # "none" | "yarn"
    rope_factor: float
    rope_orig_ctx: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    n_experts_used: int
    n_shared_experts: int
    expert_ff: int
    expert_weights_scale: float
    expert_weights_norm: bool
    gating_func: str  # "sqrtsoftplus" | "sigmoid" | "softmax"
    n_hash_layers: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: tuple[float, ...]  # per block, routed experts (0 = off)
    swiglu_limit_shexp: tuple[float, ...]  # per block, shared expert
    rms_eps: float
    alignment: int
    # V4.1 shared compression / indexing (empty: V4 per-layer layout)
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_block_size: int = 0
    candidate_topk_blocks: int = 0
    engram: EngramConfig | None = None
    dspark: DSparkConfig | None = None

    # ---- derived properties ------------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return self.n_layers + self.n_nextn

    @property
    def hc_mix(self) -> int:
        return HC_MIX_WIDTH(self.hc_mult)

    @property
    def shared_kv(self) -> bool:
        """V4.1 layout: only kv_source layers compress, the others reuse them."""
        return bool(self.kv_source_layer_ids)

    @property
    def hc_lag(self) -> bool:
        """V4.1: each sublayer's `pre` is consumed by the next sublayer; no output_hc_* head."""
        return self.arch == "deepseek41"

    @property
    def q_head_norm(self) -> bool:
        """V4 RMS-normalises each q head without a weight; V4.1 dropped it (MODEL.md §2.3)."""
        return self.arch == "deepseek4"

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers and layer < self.n_layers

    def has_compressor(self, layer: int) -> bool:
        if self.ratio(layer) == 0:
            return False
        return layer in self.kv_source_layer_ids if self.shared_kv else True

    def compressor_overlap(self, layer: int) -> bool:
        """Ratio 4 in the V4 layout pools 8 tokens over two groups (2x wide projections)."""
        return not self.shared_kv and self.ratio(layer) == 4

    def has_indexer(self, layer: int) -> bool:
        if self.ratio(layer) == 0:
            return False
        if self.shared_kv:
            return layer in self.index_source_layer_ids
        return self.ratio(layer) == 4

    def is_engram_layer(self, layer: int) -> bool:
        return self.engram is not None and layer in self.engram.layer_ids

    def kv_source(self, layer: int) -> int:
        """The layer whose compressed KV this layer attends to (itself in the V4 layout), -1 for ratio 0."""
        if self.ratio(layer) == 0:
            return -1
        if not self.shared_kv:
            return layer
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int:
        """The layer whose indexer top-k this layer uses, -1 when it attends to every compressed row."""
        if self.ratio(layer) == 0:
            return -1
        if not self.shared_kv:
            return layer if self.ratio(layer) == 4 else -1
        return max(s for s in self.index_source_layer_ids if s <= layer)

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], path: str = "<metadata>") -> ModelConfig:
        """Build and validate the config from GGUF key/value metadata (plain Python values)."""
        return _build(meta, str(path))

    def to_metadata(self) -> list[tuple[str, Any, str]]:
        """(key, value, gguf value type) for every key `from_metadata` reads; the writer's key table."""
        return _to_metadata(self)


# ======================================================================================================
# Reading


class _Keys:
    """Typed access to `{arch}.*` keys with file-naming errors."""

    def __init__(self, meta: Mapping[str, Any], path: str, arch: str):
        self.meta, self.path, self.arch = meta, path, arch

    def _full(self, key: str) -> str:
        return key if key.startswith("general.") or key.startswith("tokenizer.") else f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self._full(key) in self.meta

    def raw(self, key: str, default: Any = ...) -> Any:
        full = self._full(key)
        if full not in self.meta:
            if default is ...:
                raise ConfigError(self.path, full, "required key not found")
            return default
        return self.meta[full]

    def int(self, key: str, default: Any = ..., lo: int = 0, hi: int = 1 << 40) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(self.path, self._full(key), f"expected an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ConfigError(self.path, self._full(key), f"value {v} outside [{lo}, {hi}]")
        return v

    def float(self, key: str, default: Any = ...) -> float:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(self.path, self._full(key), f"expected a number, got {type(v).__name__}")
        v = float(v)
        if v != v or v in (float("inf"), float("-inf")):
            raise ConfigError(self.path, self._full(key), "not finite")
        return v

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, (bool, int)):
            raise ConfigError(self.path, self._full(key), f"expected a bool, got {type(v).__name__}")
        return bool(v)

    def str(self, key: str, default: Any = ...) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str):
            raise ConfigError(self.path, self._full(key), f"expected a string, got {type(v).__name__}")
        return v

    def int_list(self, key: str, default: Any = ..., lo: int = 0, hi: int = 1 << 62) -> tuple[int, ...]:
        v = self.raw(key, default)
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise ConfigError(self.path, self._full(key), "expected an array of integers")
        if any(not lo <= x <= hi for x in v):
            raise ConfigError(self.path, self._full(key), f"array value outside [{lo}, {hi}]")
        return tuple(int(x) for x in v)

    def float_per_block(self, key: str, n: int, default: Any = ...) -> tuple[float, ...]:
        """A scalar applied to every block, or an array with one value per block (swiglu clamps)."""
        v = self.raw(key, default)
        if isinstance(v, (list, tuple)):
            if len(v) < n or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
                raise ConfigError(self.path, self._full(key), f"expected {n} numbers, got {len(v)}")
            return tuple(float(x) for x in v[:n])
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(self.path, self._full(key), "expected a number or an array of numbers")
        return (float(v),) * n


def _build(meta: Mapping[str, Any], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(path, "general.architecture", f"unsupported architecture {arch!r}; expected one of "
                          f"{', '.join(ARCHITECTURES)}")
    k = _Keys(meta, path, arch)
    n_blocks = k.int("block_count", lo=1, hi=4096)
    n_nextn = k.int("nextn_predict_layers", 0, hi=n_blocks - 1)
    dim = k.int("embedding_length", lo=1, hi=1 << 20)
    n_heads = k.int("attention.head_count", lo=1, hi=4096)
    if k.int("attention.head_count_kv", lo=1, hi=4096) != 1:
        raise ConfigError(path, f"{arch}.attention.head_count_kv", "must be 1 (one shared K=V latent head)")
    head_dim = k.int("attention.key_length", dim // n_heads, lo=1, hi=1 << 16)
    if k.int("attention.value_length", head_dim, lo=1, hi=1 << 16) != head_dim:
        raise ConfigError(path, f"{arch}.attention.value_length", "must equal attention.key_length (K = V)")
    ratios = k.int_list("attention.compress_ratios", hi=1 << 20)
    if len(ratios) < n_blocks:
        raise ConfigError(path, f"{arch}.attention.compress_ratios", f"has {len(ratios)} entries, shorter than "
                          f"block_count {n_blocks}")
    ratios = ratios[:n_blocks]
    scaling = k.str("rope.scaling.type", "none")
    if scaling not in ("none", "yarn"):
        raise ConfigError(path, f"{arch}.rope.scaling.type", f"unsupported {scaling!r} (none or yarn)")
    ctx = k.int("context_length", lo=1, hi=1 << 30)
    gating = k.int("expert_gating_func", lo=0, hi=16)
    if gating not in GATING_FUNCS:
        raise ConfigError(path, f"{arch}.expert_gating_func", f"unsupported gating function {gating}")
    limit = k.float_per_block("swiglu_clamp_exp", n_blocks)
    n_layers = n_blocks - n_nextn
    hc = k.int("hyper_connection.count", lo=1, hi=64)
    if hc != 4:
        raise ConfigError(path, f"{arch}.hyper_connection.count", f"must be 4, got {hc}")
    fields = dict(
        arch=arch, vocab_size=k.int("vocab_size", lo=1, hi=1 << 24), dim=dim, n_layers=n_layers,
        n_nextn=n_nextn, context_length=ctx, n_heads=n_heads, head_dim=head_dim,
        rope_dim=k.int("rope.dimension_count", head_dim, lo=2, hi=1 << 16),
        q_lora_rank=k.int("attention.q_lora_rank", lo=1, hi=1 << 20),
        o_lora_rank=k.int("attention.output_lora_rank", lo=1, hi=1 << 20),
        o_groups=k.int("attention.output_group_count", lo=1, hi=4096),
        window=k.int("attention.sliding_window", lo=1, hi=1 << 20), compress_ratios=ratios,
        rope_base=k.float("rope.freq_base", 10000.0),
        compress_rope_base=k.float("attention.compress_rope_freq_base"),
        rope_scaling=scaling, rope_factor=k.float("rope.scaling.factor", 1.0),
        rope_orig_ctx=k.int("rope.scaling.original_context_length", ctx, lo=1, hi=1 << 30),
        # llama.cpp takes the YaRN betas from its context params (32 / 1), not the file; read them if written.
        yarn_beta_fast=k.float("rope.scaling.yarn_beta_fast", 32.0),
        yarn_beta_slow=k.float("rope.scaling.yarn_beta_slow", 1.0),
        index_n_heads=k.int("attention.indexer.head_count", lo=1, hi=4096),
        index_head_dim=k.int("attention.indexer.key_length", lo=1, hi=1 << 16),
        index_topk=k.int("attention.indexer.top_k", lo=1, hi=1 << 24),
        n_experts=k.int("expert_count", lo=1, hi=1 << 16),
        n_experts_used=k.int("expert_used_count", lo=1, hi=1 << 16),
        n_shared_experts=k.int("expert_shared_count", lo=0, hi=64),
        expert_ff=k.int("expert_feed_forward_length", lo=1, hi=1 << 20),
        expert_weights_scale=k.float("expert_weights_scale"), expert_weights_norm=k.bool("expert_weights_norm"),
        gating_func=GATING_FUNCS[gating], n_hash_layers=k.int("hash_layer_count", lo=0, hi=n_blocks),
        hc_mult=hc, hc_sinkhorn_iters=k.int("hyper_connection.sinkhorn_iterations", lo=1, hi=1000),
        hc_eps=k.float("hyper_connection.epsilon"), swiglu_limit=limit,
        swiglu_limit_shexp=k.float_per_block("swiglu_clamp_shexp", n_blocks, list(limit)),
        rms_eps=k.float("attention.layer_norm_rms_epsilon"),
        alignment=k.int("general.alignment", 32, lo=1, hi=1 << 24),
    )
    if arch == "deepseek41":
        fields.update(
            kv_source_layer_ids=k.int_list("attention.kv_source_layer_ids", [], hi=n_blocks - 1),
            index_source_layer_ids=k.int_list("attention.indexer.source_layer_ids", [], hi=n_blocks - 1),
            candidate_source_layer_id=k.int("attention.candidate_source_layer_id", -1, lo=-1, hi=n_blocks - 1),
            candidate_block_size=k.int("attention.candidate_block_size", 0, hi=1 << 20),
            candidate_topk_blocks=k.int("attention.candidate_topk_blocks", 0, hi=1 << 24),
            engram=_read_engram(k, n_layers),
        )
    if k.has("dspark.block_size"):
        fields["dspark"] = DSparkConfig(
            target_layer_ids=k.int_list("dspark.target_layer_ids", hi=n_layers - 1),
            noise_token_id=k.int("dspark.noise_token_id", hi=fields["vocab_size"] - 1),
            block_size=k.int("dspark.block_size", lo=1, hi=64), markov_rank=k.int("dspark.markov_rank", lo=1),
            n_experts=k.int("dspark.expert_count", lo=1, hi=1 << 16) if k.has("dspark.expert_count") else None,
            n_experts_used=(k.int("dspark.expert_used_count", lo=1, hi=1 << 16)
                            if k.has("dspark.expert_used_count") else None),
        )
    cfg = ModelConfig(**fields)
    _validate(cfg, path)
    return cfg


def _read_engram(k: _Keys, n_layers: int) -> EngramConfig | None:
    if not k.has("engram.layer_ids"):
        return None
    layers = k.int_list("engram.layer_ids", hi=n_layers - 1)
    heads = k.int("engram.head_count", lo=1, hi=1024)
    max_ngram = k.int("engram.max_ngram_size", lo=2, hi=16)
    nb = (max_ngram - 1) * heads

    def per_layer(key: str, width: int, hi: int) -> tuple[tuple[int, ...], ...]:
        flat = k.int_list(key, hi=hi)
        if len(flat) != width * len(layers):
            raise ConfigError(k.path, f"{k.arch}.{key}", f"expected {width * len(layers)} values, got {len(flat)}")
        return tuple(flat[i * width:(i + 1) * width] for i in range(len(layers)))

    primes = per_layer("engram.primes", nb, 1 << 40)
    offsets = per_layer("engram.offsets", nb, 1 << 44)
    rows = k.int_list("engram.rows", hi=1 << 44)
    encoding = k.str("engram.encoding")
    if encoding not in ENGRAM_ENCODINGS:
        raise ConfigError(k.path, f"{k.arch}.engram.encoding", f"unsupported encoding {encoding!r}")
    return EngramConfig(
        layer_ids=layers, n_heads=heads, head_dim=k.int("engram.key_length", lo=32, hi=1 << 14),
        max_ngram=max_ngram, pad_id=k.int("engram.pad_id", lo=0, hi=1 << 31), encoding=encoding,
        multipliers=per_layer("engram.multipliers", max_ngram, (1 << 63) - 1), primes=primes, offsets=offsets,
        rows=rows,
    )


def _fail(path: str, key: str, msg: str) -> None:
    raise ConfigError(path, key, msg)


def _validate(c: ModelConfig, path: str) -> None:
    a = c.arch
    if c.head_dim % 2 or c.rope_dim % 2 or c.rope_dim > c.head_dim or c.rope_dim > c.index_head_dim:
        _fail(path, f"{a}.rope.dimension_count", f"rope dims {c.rope_dim} must be even and fit head_dim "
              f"{c.head_dim} and indexer key_length {c.index_head_dim}")
    if c.n_heads % c.o_groups:
        _fail(path, f"{a}.attention.output_group_count", f"{c.o_groups} does not divide {c.n_heads} heads")
    if c.n_experts_used > c.n_experts:
        _fail(path, f"{a}.expert_used_count", f"{c.n_experts_used} > expert_count {c.n_experts}")
    if c.dspark is not None:
        d = c.dspark
        if (d.n_experts_used or c.n_experts_used) > (d.n_experts or c.n_experts):
            _fail(path, f"{a}.dspark.expert_used_count", f"{d.n_experts_used} > the draft's expert count")
    for i, r in enumerate(c.compress_ratios):
        if i >= c.n_layers and r != 0:
            _fail(path, f"{a}.attention.compress_ratios", f"draft/MTP block {i} must have ratio 0, got {r}")
        if a == "deepseek4" and r not in (0, 4, 128):
            _fail(path, f"{a}.attention.compress_ratios", f"layer {i}: ratio {r} (deepseek4 allows 0, 4, 128)")
        if c.shared_kv and r not in (0, 1, 2):
            _fail(path, f"{a}.attention.compress_ratios", f"layer {i}: ratio {r} (shared KV layout allows 0, 1, 2)")
        if not c.shared_kv and r == 1:
            _fail(path, f"{a}.attention.compress_ratios", f"layer {i}: ratio 1 needs kv_source_layer_ids")
    if c.shared_kv:
        _validate_sources(c, path)
    if c.engram is not None:
        e = c.engram
        for li, layer in enumerate(e.layer_ids):
            if any(p < 2 for p in e.primes[li]) or e.rows[li] != sum(e.primes[li]):
                _fail(path, f"{a}.engram.rows", f"layer {layer}: rows {e.rows[li]} != sum of primes")
            expect = [sum(e.primes[li][:j]) for j in range(e.n_buckets)]
            if list(e.offsets[li]) != expect:
                _fail(path, f"{a}.engram.offsets", f"layer {layer}: not the cumulative sum of the primes")
            if any(m % 2 == 0 for m in e.multipliers[li]):
                _fail(path, f"{a}.engram.multipliers", f"layer {layer}: multipliers must be odd")
        if len(e.rows) != len(e.layer_ids):
            _fail(path, f"{a}.engram.rows", "one row count per Engram layer expected")
        if e.head_dim % 32:
            _fail(path, f"{a}.engram.key_length", "must be a multiple of 32 (one E8M0 scale per 32 values)")


def _validate_sources(c: ModelConfig, path: str) -> None:
    a = c.arch
    first = min((i for i in range(c.n_layers) if c.compress_ratios[i]), default=None)
    for key, ids in (("attention.kv_source_layer_ids", c.kv_source_layer_ids),
                     ("attention.indexer.source_layer_ids", c.index_source_layer_ids)):
        if list(ids) != sorted(set(ids)) or any(c.compress_ratios[i] == 0 for i in ids):
            _fail(path, f"{a}.{key}", "must be increasing layers with a non-zero compress ratio")
        if first is not None and (not ids or ids[0] != first):
            _fail(path, f"{a}.{key}", f"the first compressed layer ({first}) must be a source")
    for i in range(c.n_layers):
        src = c.kv_source(i)
        if src >= 0 and c.compress_ratios[src] != c.compress_ratios[i]:
            _fail(path, f"{a}.attention.kv_source_layer_ids", f"layer {i} (ratio {c.compress_ratios[i]}) would "
                  f"share layer {src}'s ratio-{c.compress_ratios[src]} rows")
    if c.candidate_source_layer_id >= 0 and c.candidate_source_layer_id not in c.index_source_layer_ids:
        _fail(path, f"{a}.attention.candidate_source_layer_id", "must be an indexer source layer")


# ======================================================================================================
# Writing (inverse of reading)


def _to_metadata(c: ModelConfig) -> list[tuple[str, Any, str]]:
    a = c.arch
    inv_gating = {v: k for k, v in GATING_FUNCS.items()}
    out: list[tuple[str, Any, str]] = [
        ("general.architecture", a, "str"), ("general.alignment", c.alignment, "u32"),
        (f"{a}.vocab_size", c.vocab_size, "u32"), (f"{a}.context_length", c.context_length, "u32"),
        (f"{a}.embedding_length", c.dim, "u32"), (f"{a}.block_count", c.n_blocks, "u32"),
        (f"{a}.nextn_predict_layers", c.n_nextn, "u32"),
        (f"{a}.attention.head_count", c.n_heads, "u32"), (f"{a}.attention.head_count_kv", 1, "u32"),
        (f"{a}.attention.key_length", c.head_dim, "u32"), (f"{a}.attention.value_length", c.head_dim, "u32"),
        (f"{a}.rope.dimension_count", c.rope_dim, "u32"),
        (f"{a}.attention.q_lora_rank", c.q_lora_rank, "u32"),
        (f"{a}.attention.output_lora_rank", c.o_lora_rank, "u32"),
        (f"{a}.attention.output_group_count", c.o_groups, "u32"),
        (f"{a}.attention.sliding_window", c.window, "u32"),
        (f"{a}.attention.compress_ratios", list(c.compress_ratios), "u32[]"),
        (f"{a}.attention.compress_rope_freq_base", c.compress_rope_base, "f32"),
        (f"{a}.rope.freq_base", c.rope_base, "f32"),
        (f"{a}.attention.indexer.head_count", c.index_n_heads, "u32"),
        (f"{a}.attention.indexer.key_length", c.index_head_dim, "u32"),
        (f"{a}.attention.indexer.top_k", c.index_topk, "u32"),
        (f"{a}.expert_count", c.n_experts, "u32"), (f"{a}.expert_used_count", c.n_experts_used, "u32"),
        (f"{a}.expert_shared_count", c.n_shared_experts, "u32"),
        (f"{a}.expert_feed_forward_length", c.expert_ff, "u32"),
        (f"{a}.expert_weights_scale", c.expert_weights_scale, "f32"),
        (f"{a}.expert_weights_norm", c.expert_weights_norm, "bool"),
        (f"{a}.expert_gating_func", inv_gating[c.gating_func], "u32"),
        (f"{a}.hash_layer_count", c.n_hash_layers, "u32"),
        (f"{a}.hyper_connection.count", c.hc_mult, "u32"),
        (f"{a}.hyper_connection.sinkhorn_iterations", c.hc_sinkhorn_iters, "u32"),
        (f"{a}.hyper_connection.epsilon", c.hc_eps, "f32"),
        (f"{a}.swiglu_clamp_exp", list(c.swiglu_limit), "f32[]"),
        (f"{a}.swiglu_clamp_shexp", list(c.swiglu_limit_shexp), "f32[]"),
        (f"{a}.attention.layer_norm_rms_epsilon", c.rms_eps, "f32"),
    ]
    if c.rope_scaling == "yarn":
        out += [(f"{a}.rope.scaling.type", "yarn", "str"), (f"{a}.rope.scaling.factor", c.rope_factor, "f32"),
                (f"{a}.rope.scaling.original_context_length", c.rope_orig_ctx, "u32"),
                (f"{a}.rope.scaling.yarn_beta_fast", c.yarn_beta_fast, "f32"),
                (f"{a}.rope.scaling.yarn_beta_slow", c.yarn_beta_slow, "f32")]
    if c.shared_kv:
        out += [(f"{a}.attention.kv_source_layer_ids", list(c.kv_source_layer_ids), "u32[]"),
                (f"{a}.attention.indexer.source_layer_ids", list(c.index_source_layer_ids), "u32[]")]
        if c.candidate_source_layer_id >= 0:
            out += [(f"{a}.attention.candidate_source_layer_id", c.candidate_source_layer_id, "u32"),
                    (f"{a}.attention.candidate_block_size", c.candidate_block_size, "u32"),
                    (f"{a}.attention.candidate_topk_blocks", c.candidate_topk_blocks, "u32")]
    if c.engram is not None:
        e = c.engram
        out += [(f"{a}.engram.layer_ids", list(e.layer_ids), "u32[]"),
                (f"{a}.engram.head_count", e.n_heads, "u32"), (f"{a}.engram.key_length", e.head_dim, "u32"),
                (f"{a}.engram.max_ngram_size", e.max_ngram, "u32"), (f"{a}.engram.pad_id", e.pad_id, "u32"),
                (f"{a}.engram.encoding", e.encoding, "str"),
                (f"{a}.engram.multipliers", [m for ms in e.multipliers for m in ms], "i64[]"),
                (f"{a}.engram.primes", [p for ps in e.primes for p in ps], "u64[]"),
                (f"{a}.engram.offsets", [o for os_ in e.offsets for o in os_], "u64[]"),
                (f"{a}.engram.rows", list(e.rows), "u64[]")]
    if c.dspark is not None:
        d = c.dspark
        out += [(f"{a}.dspark.target_layer_ids", list(d.target_layer_ids), "u32[]"),
                (f"{a}.dspark.noise_token_id", d.noise_token_id, "u32"),
                (f"{a}.dspark.block_size", d.block_size, "u32"), (f"{a}.dspark.markov_rank", d.markov_rank, "u32")]
        if d.n_experts is not None:
            out.append((f"{a}.dspark.expert_count", d.n_experts, "u32"))
        if d.n_experts_used is not None:
            out.append((f"{a}.dspark.expert_used_count", d.n_experts_used, "u32"))
    return out
