"""MoE router: which K experts a token uses and with what weights (MODEL.md §2.4, LLAMACPP_DEEPSEEK4.md §3 FFN).

Owns `route` (one token) and `route_rows` (T tokens):
- logits_E = gate_w [E, D] @ x (f32, via `qmatvec`, so a quantized gate is read as stored);
- scores_E = sqrt(softplus(l)) | sigmoid(l) | softmax(l) by `cfg.gating_func`;
- selection: top-K of scores + bias (the noaux_tc bias changes selection only); hash layers take the caller's
  ids (tid2eid[token]) and have no bias;
- weights_K = scores[idx] (unbiased, hash layers too); if `cfg.expert_weights_norm`: divided by their sum clamped
  at >= 2^-14 = 6.103515625e-5 (llama.cpp's clamp); then times `cfg.expert_weights_scale`.
  The file's flag decides the normalisation for every gating function, as in llama.cpp's build_moe_ffn (the
  DeepSeek reference normalises exactly for non-softmax scoring, which its files express by setting the flag).
- Ties: `jax.lax.top_k` puts the lower index first on equal values, so on an exact tie the lower expert index
  wins (ggml's order may differ; only exact ties are affected). idx_K comes out by descending selection score.
  On CUDA the plain selection is layers/topk_kernel.py's one-program top-K, the same picks in the same order.

Lean hook (`lean = (tier_rank_E, margin)`, None = off): a selection-only preference for experts in faster tiers.
Eligible = the plain top-K plus every other expert whose selection score is strictly within `margin` of the
K-th score (kth - s < margin). Of the eligible, K are kept by (lower tier rank, higher selection score, lower
index), then ordered like top-K (descending score, lower index first). Weights still come from the unbiased
scores of the kept experts. `swaps` counts kept experts outside the plain top-K; margin 0 keeps the plain top-K
exactly (same ids, same order). Hash layers ignore `lean`: their experts are fixed by the token.

`route_rows` maps the one-token computation over rows (rowwise.map_rows) and `route` is a fusion island, so
every row is bit-identical to decode whatever T is (needed for bit-identical speculative verification).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jds41.config import ModelConfig
from jds41.layers import topk_kernel
from jds41.layers.rowwise import island, map_rows
from jds41.quant import qmatvec

WEIGHT_SUM_MIN = topk_kernel.WEIGHT_SUM_MIN  # llama.cpp clamps the routed-weight sum at 2^-14 before dividing


class Routing(NamedTuple):
    idx_K: jax.Array  # int32 [K] expert ids, by descending selection score
    weight_K: jax.Array  # f32 [K] routing weights (normalised and scaled)
    scores_E: jax.Array  # f32 [E] unbiased gating scores
    swaps: jax.Array  # int32 scalar: experts the lean hook swapped in (0 without lean)


def gate_scores(logits_E: jax.Array, gating_func: str) -> jax.Array:
    """Gating scores from router logits (f32)."""
    if gating_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits_E))
    if gating_func == "sigmoid":
        return jax.nn.sigmoid(logits_E)
    if gating_func == "softmax":
        return jax.nn.softmax(logits_E)
    raise ValueError(f"unknown gating function {gating_func!r}")


def _lean_select(sel_E: jax.Array, k: int, tier_rank_E: jax.Array, margin) -> tuple[jax.Array, jax.Array]:
    """(idx_K, swaps) under the lean preference; see the module docstring."""
    E = sel_E.shape[0]
    vals, top_idx = jax.lax.top_k(sel_E, k)
    in_top = jnp.zeros((E,), bool).at[top_idx].set(True)
    eligible = in_top | (vals[k - 1] - sel_E < jnp.asarray(margin, jnp.float32))
    # lexsort: last key primary; stable, so equal keys keep the lower expert index first
    order = jnp.lexsort((-sel_E, jnp.asarray(tier_rank_E, jnp.int32), (~eligible).astype(jnp.int32)))
    kept = jnp.zeros((E,), bool).at[order[:k]].set(True)
    _, idx = jax.lax.top_k(jnp.where(kept, sel_E, -jnp.inf), k)
    swaps = jnp.int32(k) - jnp.sum(kept & in_top, dtype=jnp.int32)
    return idx.astype(jnp.int32), swaps


def route(x_D: jax.Array, gate_w, bias_E: jax.Array | None, cfg: ModelConfig, hash_ids_K: jax.Array | None = None,
          lean: tuple[jax.Array, float] | None = None) -> Routing:
    """Route one token: `gate_w` a QTensor [E, D]; `bias_E` the selection bias (None on hash layers);
    `hash_ids_K` tid2eid[token] on hash layers; `lean` (tier_rank_E, margin) or None."""
    k = cfg.n_experts_used
    logits_E = qmatvec(island(jnp.asarray(x_D, jnp.float32)), gate_w)
    if hash_ids_K is None and lean is None and topk_kernel.route_applies(logits_E.shape[-1], k):
        idx_K, w_K, scores_E = topk_kernel.route(  # scores, top-K and weights in one program on CUDA
            logits_E, None if bias_E is None else jnp.asarray(bias_E, jnp.float32), k, cfg.gating_func,
            cfg.expert_weights_norm, cfg.expert_weights_scale, default=lambda lg: _plain_selection(lg, bias_E, cfg))
        return island(Routing(idx_K, w_K, scores_E, jnp.int32(0)))
    scores_E = gate_scores(logits_E, cfg.gating_func)
    swaps = jnp.int32(0)
    if hash_ids_K is not None:
        if bias_E is not None:
            raise ValueError("route: hash layers have no selection bias (pass bias_E=None with hash_ids_K)")
        idx_K = island(jnp.asarray(hash_ids_K, jnp.int32).reshape(k))
    else:
        sel_E = scores_E if bias_E is None else scores_E + jnp.asarray(bias_E, jnp.float32)
        if lean is None:
            idx_K = topk_kernel.top_k(sel_E, k)[1]  # lax.top_k's picks and order (the kernel only where switched on)
        else:
            idx_K, swaps = _lean_select(sel_E, k, lean[0], lean[1])
    return island(Routing(idx_K, _weights(scores_E, idx_K, cfg), scores_E, swaps))


def _weights(scores_E: jax.Array, idx_K: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The chosen experts' unbiased scores, normalised where the file says (sum clamped at 2^-14), scaled."""
    w_K = scores_E[idx_K]
    if cfg.expert_weights_norm:
        w_K = w_K / jnp.maximum(jnp.sum(w_K), jnp.float32(WEIGHT_SUM_MIN))
    return w_K * jnp.float32(cfg.expert_weights_scale)


def _plain_selection(logits_E: jax.Array, bias_E: jax.Array | None, cfg: ModelConfig):
    """(idx, weights, scores) of the plain top-K in XLA's ops: the reference of topk_kernel.route."""
    scores_E = gate_scores(logits_E, cfg.gating_func)
    sel_E = scores_E if bias_E is None else scores_E + jnp.asarray(bias_E, jnp.float32)
    idx_K = jax.lax.top_k(sel_E, cfg.n_experts_used)[1].astype(jnp.int32)
    return idx_K, _weights(scores_E, idx_K, cfg), scores_E


def route_rows(x_TD: jax.Array, gate_w, bias_E: jax.Array | None, cfg: ModelConfig,
               hash_ids_TK: jax.Array | None = None, lean: tuple[jax.Array, float] | None = None) -> Routing:
    """`route` for T tokens (Routing fields gain a leading T axis); row t is bit-identical to route(x_TD[t], ...)."""
    x_TD = jnp.asarray(x_TD, jnp.float32)
    if hash_ids_TK is None:
        return map_rows(lambda x_D: route(x_D, gate_w, bias_E, cfg, None, lean), x_TD)
    return map_rows(lambda x_D, h_K: route(x_D, gate_w, bias_E, cfg, h_K, lean), x_TD,
                    jnp.asarray(hash_ids_TK, jnp.int32))
