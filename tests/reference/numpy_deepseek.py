"""Float64 numpy reference of the full-sequence forward pass of `deepseek4` and `deepseek41` models; a test oracle.

Owns `forward` (embedding, hyper-connections with Sinkhorn, the block loop, MoE, the output head) and the trace of
intermediates; the attention branch lives in numpy_attention.py and Engram in numpy_engram.py. It is written from
MODEL.md and LLAMACPP_DEEPSEEK4.md §3 only and shares no code with jds41's JAX layers, so the two can check each
other; for `deepseek4` llama.cpp is the outside oracle and this file follows its computation.

    forward(cfg, w, tokens, engram_rows=None, token_map=None, trace=None) -> float64 logits [T, V]

`w` maps the schema's tensor names (jds41/checkpoints/schema.py) to numpy arrays in numpy shape: floats dequantized
by the caller (float64 preferred), `ffn_gate_tid2eid` as integers [V, K], `engram_embd` as raw uint8 rows.
Only the main layers run (MTP / DSpark blocks are ignored). Every position is computed causally in one pass.

Readings of the spec, where it leaves room:
- mHC mix (per sublayer): r = rsqrt(mean(h_flat^2) + rms_eps) over all hc*D values, mix = (h_flat @ fn.T) * r;
  pre = sigmoid(mix[:hc]*scale[0] + base[:hc]) + hc_eps; post = 2*sigmoid(mix[hc:2hc]*scale[1] + base[hc:2hc]);
  comb = (mix[2hc:]*scale[2] + base[2hc:]) reshaped row-major as comb[src][dst], softmax over dst, + hc_eps, divide
  by column sums (sum over src) + hc_eps, then (iters-1) x [divide by row sums + hc_eps, then by column sums +
  hc_eps]. Branch input y = sum_src pre_src h_src; hc_post: h'_dst = post_dst*out + sum_src comb[src][dst]*h_src.
- deepseek41 hc lag: each sublayer still computes (pre, post, comb) from the stream entering it (after Engram, for
  an attention sublayer of an Engram layer) and uses its own post/comb, but its branch input is collapsed with the
  `pre` of the PREVIOUS sublayer (layer l's attention uses layer l-1's FFN pre, layer l's FFN uses layer l's
  attention pre); layer 0's attention uses the exact one-hot e_0 (no hc_eps). The final collapse uses the last
  FFN's pre, then output_norm and output; there is no output_hc_*. (A public V4.1 port computes it this way.)
- deepseek4 head: pre = sigmoid(mix*scale[0] + base) + hc_eps with the same RMS-scaled mix, no post / Sinkhorn.
- Router: scores s = sqrt(softplus(l)) | sigmoid(l) | softmax(l over experts) by cfg.gating_func. Hash layers take
  experts tid2eid[token]; other layers the top-K of s + exp_probs_b (bias for selection only; ties to the lower
  expert id). Weights are the unbiased s at the chosen experts, divided by max(sum, 6.1e-5) when
  expert_weights_norm (for every gating function, as llama.cpp), then times expert_weights_scale.
- Experts: g = x@gate.T, u = x@up.T; when limit > 1e-6: g = min(g, limit), u = clip(u, -limit, limit); the routed
  weight multiplies silu(g)*u BEFORE down (MODEL.md §2.5). Shared expert: same with swiglu_limit_shexp, weight 1.
- Engram runs on the 4-copy stream at the entry of its layer, before the attention sublayer's mix.

Trace (when a dict is passed), per layer L under "blk.L.<name>": stream_in [T,hc,D] (before Engram), engram_rows,
engram_gate, attn_pre/attn_post/attn_comb and ffn_* (this sublayer's own coefficients), attn_in / ffn_in (normed
branch inputs [T,D]), q, kv, compressed (rows with RoPE), selected (rows per query, ascending), index_keys,
index_scores [T,N], candidate_blocks, attn_out, router_scores [T,E], experts [T,K] (selection order), expert_weights
[T,K], ffn_out, stream_out. Globals: "embed" [T,D], "head_pre" [T,hc], "head_in" [T,D] (after output_norm).
"""

from __future__ import annotations

import numpy as np

from jds41.config import ModelConfig

from .numpy_attention import SharedKV, attention, rms_norm, softmax, top_k
from .numpy_engram import engram_apply, engram_row_ids

ROUTE_NORM_MIN = 6.1e-5  # llama.cpp clamps the routed-weight sum from below before dividing


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


# ---- hyper-connections -----------------------------------------------------------------------------------------
def sinkhorn(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """logits [..., src, dst] -> near doubly stochastic comb (columns sum to 1 up to eps after the last step)."""
    c = softmax(logits, axis=-1) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c


def hc_mix(cfg: ModelConfig, h: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray):
    """(pre [T,hc], post [T,hc], comb [T,hc(src),hc(dst)]) of one sublayer from the stream h [T,hc,D]."""
    T, hc, _ = h.shape
    flat = h.reshape(T, -1)
    mix = (flat @ fn.T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_eps)
    pre = sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2.0 * sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(T, hc, hc)
    return pre, post, sinkhorn(comb_logits, cfg.hc_sinkhorn_iters, cfg.hc_eps)


def hc_collapse(pre: np.ndarray, h: np.ndarray) -> np.ndarray:
    return np.einsum("tc,tcd->td", pre, h)


def hc_post(h: np.ndarray, out: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    return post[:, :, None] * out[:, None, :] + np.einsum("tsx,tsd->txd", comb, h)


# ---- MoE -------------------------------------------------------------------------------------------------------
def gate_scores(cfg: ModelConfig, logits: np.ndarray) -> np.ndarray:
    if cfg.gating_func == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, logits))
    if cfg.gating_func == "sigmoid":
        return sigmoid(logits)
    if cfg.gating_func == "softmax":
        return softmax(logits, axis=-1)
    raise ValueError(f"unknown gating function {cfg.gating_func!r}")


def swiglu(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, limit: float) -> np.ndarray:
    g, u = x @ gate_w.T, x @ up_w.T
    if limit > 1e-6:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return silu(g) * u


def route(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, tokens: np.ndarray):
    """(experts [T,K] in selection order, weights [T,K], scores [T,E]) of one MoE layer."""
    p = f"blk.{layer}."
    scores = gate_scores(cfg, x_n @ w[p + "ffn_gate_inp.weight"].T)
    if cfg.is_hash_layer(layer):
        experts = np.asarray(w[p + "ffn_gate_tid2eid.weight"])[tokens].astype(np.int64)
    else:
        biased = scores + w[p + "exp_probs_b.bias"]
        experts = np.stack([top_k(row, cfg.n_experts_used) for row in biased])
    weights = np.take_along_axis(scores, experts, axis=1)
    if cfg.expert_weights_norm:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), ROUTE_NORM_MIN)
    return experts, weights * cfg.expert_weights_scale, scores


def moe(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, tokens: np.ndarray,
        trace: dict | None = None) -> np.ndarray:
    p = f"blk.{layer}."
    experts, weights, scores = route(cfg, layer, w, x_n, tokens)
    gate_w, up_w, down_w = w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"]
    limit = cfg.swiglu_limit[layer]
    out = np.zeros_like(x_n)
    for t in range(x_n.shape[0]):
        for e, wt in zip(experts[t], weights[t]):
            act = swiglu(x_n[t], gate_w[e], up_w[e], limit)
            out[t] += (act * wt) @ down_w[e].T
    if cfg.n_shared_experts:
        act = swiglu(x_n, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], cfg.swiglu_limit_shexp[layer])
        out = out + act @ w[p + "ffn_down_shexp.weight"].T
    if trace is not None:
        trace[p + "router_scores"], trace[p + "experts"], trace[p + "expert_weights"] = scores, experts, weights
        trace[p + "ffn_out"] = out
    return out


# ---- the whole model -------------------------------------------------------------------------------------------
def _engram_rows(cfg: ModelConfig, layer: int, tokens: np.ndarray, engram_rows, token_map) -> np.ndarray:
    if engram_rows is not None and layer in engram_rows:
        return np.asarray(engram_rows[layer], dtype=np.int64)
    if token_map is None:
        raise ValueError(f"Engram layer {layer} needs token_map (or its row ids in engram_rows)")
    return engram_row_ids(cfg.engram, layer, tokens, token_map)


def forward(cfg: ModelConfig, w: dict, tokens, engram_rows: dict | None = None, token_map=None,
            trace: dict | None = None) -> np.ndarray:
    """Float64 logits [T, V] of every position of `tokens`.

    engram_rows: optional {layer: int row ids [T, n_buckets]} that replaces the n-gram hash of that Engram layer
    (to test the gate apart from the hash). token_map: int array [V] token id -> compressed id, needed by Engram
    layers whose rows are not given. trace: optional dict filled with intermediates (see the module docstring).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    hc, T = cfg.hc_mult, tokens.size
    emb = np.asarray(w["token_embd.weight"], dtype=np.float64)[tokens]
    h = np.repeat(emb[:, None, :], hc, axis=1)
    state = SharedKV()
    lag_pre = np.zeros((T, hc))
    lag_pre[:, 0] = 1.0  # deepseek41: layer 0's attention collapses copy 0 exactly
    if trace is not None:
        trace["embed"] = emb

    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        if trace is not None:
            trace[p + "stream_in"] = h
        if cfg.is_engram_layer(layer):
            rows = _engram_rows(cfg, layer, tokens, engram_rows, token_map)
            h = engram_apply(cfg.engram, layer, w, h, rows, cfg.rms_eps, trace)
        for branch in ("attn", "ffn"):
            pre, post, comb = hc_mix(cfg, h, w[f"{p}hc_{branch}_fn.weight"], w[f"{p}hc_{branch}_scale.weight"],
                                     w[f"{p}hc_{branch}_base.weight"])
            y = hc_collapse(lag_pre if cfg.hc_lag else pre, h)
            x_n = rms_norm(y, w[f"{p}{branch}_norm.weight"], cfg.rms_eps)
            if branch == "attn":
                out = attention(cfg, layer, w, x_n, state, trace)
            else:
                out = moe(cfg, layer, w, x_n, tokens, trace)
            h = hc_post(h, out, post, comb)
            lag_pre = pre
            if trace is not None:
                trace[f"{p}{branch}_pre"], trace[f"{p}{branch}_post"], trace[f"{p}{branch}_comb"] = pre, post, comb
                trace[f"{p}{branch}_in"] = x_n
        if trace is not None:
            trace[p + "stream_out"] = h

    if cfg.hc_lag:
        head_pre = lag_pre
    else:
        flat = h.reshape(T, -1)
        mix = (flat @ w["output_hc_fn.weight"].T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_eps)
        head_pre = sigmoid(mix * w["output_hc_scale.weight"][0] + w["output_hc_base.weight"]) + cfg.hc_eps
    x = rms_norm(hc_collapse(head_pre, h), w["output_norm.weight"], cfg.rms_eps)
    if trace is not None:
        trace["head_pre"], trace["head_in"], trace["final_stream"] = head_pre, x, h
    return x @ w["output.weight"].T
