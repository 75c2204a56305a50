"""The tensor directory a model file must have, derived from its `ModelConfig`.

One table, used by both sides: the validator checks a file against it (every tensor present, nothing unknown,
shape and type as implied) and the synthetic writer writes exactly it. Shapes are numpy (row-major) order, the
reverse of ggml's `ne` (LLAMACPP_DEEPSEEK4.md §2 gives both). Names follow llama.cpp's `deepseek4` loader;
`deepseek41` adds Engram and the shared-KV indexer key tensors (MODEL.md §5).

DSpark draft stages (MODEL.md §4; `draft_tensors`): when the config has DSpark keys and `nextn_predict_layers`
S > 0, the S trailing blocks are draft stages named `mtp.{s}.*` (ds4 calls its MTP sidecar `mtp.0.*`, MODEL.md §5)
instead of `blk.N.*`. Every stage is a full ratio-0 block: hc, attention and a MoE over the draft's own expert
pool (`{arch}.dspark.expert_count` / `.expert_used_count`, defaulting to the target's) with bias routing (the
draft is never hash-routed, §2.4). Stage 0 adds `main_proj` [D, n_targets*D] and `main_norm` (the target-feature
projection `main_x = main_norm(main_proj(features))`); the last stage adds its own `hc_head_{fn,base,scale}`, `norm`,
the Markov head `markov_embd` / `markov_head` [V, rank] and the confidence head `conf_proj` [1, D+rank]. The
embedding and output head are shared with the target. A separate draft file (`{arch}.dspark.standalone` = true)
holds exactly these tensors and the target's keys.
"""

from __future__ import annotations

import dataclasses
import enum

from gguf import GGMLQuantizationType as T

from jds41.config import ModelConfig


class Kind(enum.Enum):
    """What role a tensor plays; decides which storage types are allowed."""

    MATRIX = "matrix"  # dense projections: float or quantized rows
    EXPERTS = "experts"  # routed expert stacks [E, out, in]: float or quantized rows
    VECTOR = "vector"  # norms, sinks, biases, ape, hc base/scale, engram q/k: float
    HC = "hc"  # hyper-connection mixing matrices: float
    INDEX = "index"  # tid2eid: I32
    ROWS = "rows"  # Engram table: raw bytes per row (I8)
    SMALL_MATRIX = "small_matrix"  # draft Markov / confidence heads: rows too short for quant blocks, float only


FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
QUANT_TYPES = frozenset({T.Q8_0, T.Q4_K, T.Q2_K, T.IQ2_XXS, T.MXFP4})
ALLOWED = {
    Kind.MATRIX: FLOAT_TYPES | QUANT_TYPES,
    Kind.EXPERTS: FLOAT_TYPES | QUANT_TYPES,
    Kind.VECTOR: FLOAT_TYPES,
    Kind.HC: FLOAT_TYPES,
    Kind.INDEX: frozenset({T.I32}),
    Kind.ROWS: frozenset({T.I8}),
    Kind.SMALL_MATRIX: FLOAT_TYPES,
}
STANDALONE_DRAFT_KEY = "dspark.standalone"  # {arch}.dspark.standalone: a draft-only file (no target tensors)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order
    kind: Kind
    layer: int = -1  # -1 for global tensors

    @property
    def allowed_types(self) -> frozenset:
        return ALLOWED[self.kind]


def model_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a file of this config must contain, by name, in file order."""
    D, V = cfg.dim, cfg.vocab_size
    specs: list[TensorSpec] = [TensorSpec("token_embd.weight", (V, D), Kind.MATRIX)]
    for layer in range(cfg.n_layers if draft_stages(cfg) else cfg.n_blocks):
        specs += _block(cfg, layer)
    specs += [TensorSpec("output_norm.weight", (D,), Kind.VECTOR), TensorSpec("output.weight", (V, D), Kind.MATRIX)]
    if not cfg.hc_lag:
        hc = cfg.hc_mult
        specs += [TensorSpec("output_hc_fn.weight", (hc, hc * D), Kind.HC),
                  TensorSpec("output_hc_base.weight", (hc,), Kind.VECTOR),
                  TensorSpec("output_hc_scale.weight", (1,), Kind.VECTOR)]
    out = {s.name: s for s in specs}
    out.update(draft_tensors(cfg))
    return out


def draft_stages(cfg: ModelConfig) -> int:
    """DSpark draft stages a file of this config holds: its nextn blocks when it has DSpark keys, else 0."""
    return cfg.n_nextn if cfg.dspark is not None else 0


def draft_expert_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(experts, top-k) of the draft stages' MoE: the DSpark keys, defaulting to the target's."""
    d = cfg.dspark
    return (d.n_experts or cfg.n_experts, d.n_experts_used or cfg.n_experts_used)


def draft_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """The `mtp.{s}.*` tensors of the DSpark draft stages (empty without any), by name, in file order."""
    n = draft_stages(cfg)
    if not n:
        return {}
    D, V, hc, rank = cfg.dim, cfg.vocab_size, cfg.hc_mult, cfg.dspark.markov_rank
    E, _ = draft_expert_counts(cfg)
    specs: list[TensorSpec] = []
    for s in range(n):
        layer = cfg.n_layers + s
        p = f"mtp.{s}."

        def t(name: str, shape: tuple[int, ...], kind: Kind, p=p, layer=layer) -> TensorSpec:
            return TensorSpec(p + name, shape, kind, layer)

        if s == 0:
            specs += [t("main_proj.weight", (D, len(cfg.dspark.target_layer_ids) * D), Kind.MATRIX),
                      t("main_norm.weight", (D,), Kind.VECTOR)]
        specs += _attention_and_hc(cfg, t)
        specs += _moe(cfg, t, E, hashed=False)
        if s == n - 1:
            specs += [t("hc_head_fn.weight", (hc, hc * D), Kind.HC), t("hc_head_base.weight", (hc,), Kind.VECTOR),
                      t("hc_head_scale.weight", (1,), Kind.VECTOR), t("norm.weight", (D,), Kind.VECTOR),
                      t("markov_embd.weight", (V, rank), Kind.SMALL_MATRIX),
                      t("markov_head.weight", (V, rank), Kind.SMALL_MATRIX),
                      t("conf_proj.weight", (1, D + rank), Kind.SMALL_MATRIX)]
    return {s.name: s for s in specs}


def _block(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    D, E, hc = cfg.dim, cfg.n_experts, cfg.hc_mult
    p = f"blk.{i}."

    def t(name: str, shape: tuple[int, ...], kind: Kind) -> TensorSpec:
        return TensorSpec(p + name, shape, kind, i)

    out = _attention_and_hc(cfg, t)
    out += _compressor_and_indexer(cfg, i, t)
    out += _moe(cfg, t, E, hashed=cfg.is_hash_layer(i))
    if cfg.is_engram_layer(i):
        e = cfg.engram
        rows = e.rows[e.layer_ids.index(i)]
        out += [t("engram_embd.weight", (rows, e.row_bytes), Kind.ROWS),
                t("engram_wkv.weight", ((hc + 1) * D, e.embed_dim), Kind.MATRIX),
                t("engram_q.weight", (hc, D), Kind.VECTOR), t("engram_k.weight", (hc, D), Kind.VECTOR)]
    if i >= cfg.n_layers and cfg.arch == "deepseek4":
        out += [t("nextn.eh_proj.weight", (D, 2 * D), Kind.MATRIX), t("nextn.enorm.weight", (D,), Kind.VECTOR),
                t("nextn.hnorm.weight", (D,), Kind.VECTOR)]
    return out


def _attention_and_hc(cfg: ModelConfig, t) -> list[TensorSpec]:
    D, H, HD, QL, hc = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    out = [t("attn_norm.weight", (D,), Kind.VECTOR), t("attn_sinks.weight", (H,), Kind.VECTOR),
           t("attn_q_a.weight", (QL, D), Kind.MATRIX), t("attn_q_a_norm.weight", (QL,), Kind.VECTOR),
           t("attn_q_b.weight", (H * HD, QL), Kind.MATRIX), t("attn_kv.weight", (HD, D), Kind.MATRIX),
           t("attn_kv_a_norm.weight", (HD,), Kind.VECTOR),
           t("attn_output_a.weight", (cfg.o_groups * cfg.o_lora_rank, H * HD // cfg.o_groups), Kind.MATRIX),
           t("attn_output_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), Kind.MATRIX)]
    for branch in ("attn", "ffn"):
        out += [t(f"hc_{branch}_fn.weight", (cfg.hc_mix, hc * D), Kind.HC),
                t(f"hc_{branch}_base.weight", (cfg.hc_mix,), Kind.VECTOR),
                t(f"hc_{branch}_scale.weight", (3,), Kind.VECTOR)]
    return out


def _moe(cfg: ModelConfig, t, E: int, hashed: bool) -> list[TensorSpec]:
    D, F, S = cfg.dim, cfg.expert_ff, cfg.n_shared_experts
    out = [t("ffn_norm.weight", (D,), Kind.VECTOR), t("ffn_gate_inp.weight", (E, D), Kind.MATRIX)]
    if hashed:
        out.append(t("ffn_gate_tid2eid.weight", (cfg.vocab_size, cfg.n_experts_used), Kind.INDEX))
    else:
        out.append(t("exp_probs_b.bias", (E,), Kind.VECTOR))
    out += [t("ffn_gate_exps.weight", (E, F, D), Kind.EXPERTS), t("ffn_up_exps.weight", (E, F, D), Kind.EXPERTS),
            t("ffn_down_exps.weight", (E, D, F), Kind.EXPERTS)]
    if S:
        out += [t("ffn_gate_shexp.weight", (F * S, D), Kind.MATRIX), t("ffn_up_shexp.weight", (F * S, D), Kind.MATRIX),
                t("ffn_down_shexp.weight", (D, F * S), Kind.MATRIX)]
    return out


def _compressor_and_indexer(cfg: ModelConfig, i: int, t) -> list[TensorSpec]:
    D, HD, QL, r = cfg.dim, cfg.head_dim, cfg.q_lora_rank, cfg.ratio(i)
    IH, ID = cfg.index_n_heads, cfg.index_head_dim
    out: list[TensorSpec] = []
    if cfg.has_compressor(i):
        c = 2 if cfg.compressor_overlap(i) else 1
        out.append(t("attn_compressor_kv.weight", (c * HD, D), Kind.MATRIX))
        if r > 1:  # ratio 1 (V4.1) is projection + norm, no pooling gate
            out.append(t("attn_compressor_gate.weight", (c * HD, D), Kind.MATRIX))
        if not cfg.shared_kv:  # V4.1's ratio-2 pool has no position embedding
            out.append(t("attn_compressor_ape.weight", (r, c * HD), Kind.VECTOR))
        out.append(t("attn_compressor_norm.weight", (HD,), Kind.VECTOR))
    if cfg.shared_kv and cfg.has_compressor(i):
        # V4.1: index keys are derived from the shared compressed latent where it is made, so the key projection
        # lives on the kv-source layers (the checkpoint has 4 `wk` for 8 `wq_b`); index layers read their source's.
        out += [t("indexer.attn_k.weight", (ID, HD), Kind.MATRIX), t("indexer.k_norm.weight", (ID,), Kind.VECTOR)]
    if cfg.has_indexer(i):
        out += [t("indexer.proj.weight", (IH, D), Kind.MATRIX),
                t("indexer.attn_q_b.weight", (IH * ID, QL), Kind.MATRIX)]
        if not cfg.shared_kv:  # its own overlapped ratio-4 compressor
            out += [t("indexer_compressor_kv.weight", (2 * ID, D), Kind.MATRIX),
                    t("indexer_compressor_gate.weight", (2 * ID, D), Kind.MATRIX),
                    t("indexer_compressor_ape.weight", (4, 2 * ID), Kind.VECTOR),
                    t("indexer_compressor_norm.weight", (ID,), Kind.VECTOR)]
    return out
