"""Attention half of the float64 numpy reference: RoPE (+YaRN), KV compressors, the indexer, candidate blocks and the
sparse sink attention with its grouped output projection. Test oracle only; obviously-right rather than fast.

Every query position builds its key set explicitly: window rows max(0, p-window+1)..p, then the compressed rows it
may see (row j visible iff j < (p+1)//ratio): all of them for HCA layers, the indexer's top-k for CSA / V4.1 indexed
layers. No KV cache, no decode state: one pass over the whole sequence.

Readings of the spec (MODEL.md §2.2-2.3, LLAMACPP_DEEPSEEK4.md §3), where it leaves room:
- RoPE is ggml mode 0: adjacent pairs (2k, 2k+1) of the LAST rope_dim dims, theta_k = pos * base^(-2k/R). Ratio-0
  layers use rope_base without scaling; ratio>0 layers (window keys, queries, compressed rows, indexer q/k) use
  compress_rope_base and, with rope_scaling "yarn", llama.cpp's YaRN: freq_scale = 1/factor, ext_factor 1,
  corr dims = [max(0, floor(d(beta_fast))), min(R-1, ceil(d(beta_slow)))] with d(b) = R*ln(orig_ctx/(2*pi*b))/(2 ln
  base), ramp_k = 1 - clip((k - lo)/max(0.001, hi - lo), 0, 1), theta = theta/factor*(1-ramp) + theta*ramp. The
  magnitude factor is cancelled (cos/sin unscaled), as llama.cpp's deepseek4 does.
- The compressed row of block b sits at position ratio*b (its first token), for both the KV rows and index keys.
- V4 ratio-4 overlap: block b pools 2*ratio candidates, the previous block's tokens through columns [0:W] and its
  own through [W:2W]; block 0's previous half is kv 0 / score -inf. ape[t mod ratio] is added to the whole 2W-wide
  score row. Other ratios (128, or any HCA ratio of a deepseek41 V4-layout file) pool their own block plainly.
- V4.1 shared layout: ratio 2 = plain per-feature softmax of the gate scores over the block's 2 tokens (no ape, no
  overlap); ratio 1 = projection + norm (one row per token). Later layers with the same ratio reuse the newest
  source's rows (cfg.kv_source). Index keys k = RoPE(k_norm(latent @ indexer.attn_k.T)) where latent is the
  source's compressed row AFTER the compressor norm and BEFORE its RoPE (a public V4.1 port computes them there).
  The schema gives every index-source layer its own attn_k/k_norm, so a layer uses its own when the weights dict
  has them and its kv source's otherwise (the real checkpoint keeps wk only on kv-source layers).
- Candidate blocks (V4.1): at cfg.candidate_source_layer_id the indexer score of every visible row is grouped in
  blocks of candidate_block_size rows (row j in block j // size; the newest block may be partial), a block scores
  the max of its visible rows, and the top candidate_topk_blocks blocks per query are kept (all when fewer). Index
  source layers AFTER that layer score only rows inside those blocks, then take top index_topk; the candidate
  source layer itself uses plain top-k. Layers that reuse another layer's top-k inherit its filtering. A public
  port also always keeps the newest (partial) block; MODEL.md does not say so and this reference does not.
- Top-k tie-breaking everywhere (indexer rows, candidate blocks, experts): on exactly equal scores the LOWER index
  wins (a stable sort of the negated scores). Selected rows are returned in ascending order; the attention result
  does not depend on order.
- Attention: scores over all head_dim dims, scale 1/sqrt(head_dim), one per-head sink logit in the denominator only,
  V = K (the same rows), inverse RoPE on the output's last rope_dim dims at the query position, then head group g
  (heads g*H/OG .. (g+1)*H/OG-1, concatenated) times rows g*OL:(g+1)*OL of attn_output_a, then attn_output_b.
"""

from __future__ import annotations

import math

import numpy as np

from jds41.config import ModelConfig


# ---- small helpers ---------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; `weight=None` is the weightless per-head q norm."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of a 1-D array, best first; exact ties go to the lower index."""
    order = np.argsort(-scores, kind="stable")
    return order[:k]


# ---- RoPE ------------------------------------------------------------------------------------------------------
def yarn_corr_dims(n_dims: int, orig_ctx: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """llama.cpp's YaRN correction range (in rotary-pair units) over n_dims rope dims."""

    def dim(beta: float) -> float:
        return n_dims * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def rope_freqs(cfg: ModelConfig, layer: int) -> np.ndarray:
    """Angular frequency of each rotary pair k = 0..R/2-1 for this layer (theta = position * freq)."""
    R = cfg.rope_dim
    k = np.arange(R // 2, dtype=np.float64)
    compressed_layer = cfg.ratio(layer) > 0
    base = cfg.compress_rope_base if compressed_layer else cfg.rope_base
    freq = base ** (-2.0 * k / R)
    if compressed_layer and cfg.rope_scaling == "yarn":
        lo, hi = yarn_corr_dims(R, cfg.rope_orig_ctx, base, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        # ramp 1 keeps the original (extrapolated) frequency, ramp 0 fully interpolates by 1/factor.
        ramp = 1.0 - np.clip((k - lo) / max(0.001, hi - lo), 0.0, 1.0)
        freq = freq / cfg.rope_factor * (1.0 - ramp) + freq * ramp
    return freq


def apply_rope(x: np.ndarray, positions: np.ndarray, freq: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate adjacent pairs of the last 2*len(freq) dims of x[N, ..., W] at positions[N]; returns a copy."""
    R = 2 * freq.shape[0]
    theta = np.asarray(positions, dtype=np.float64)[:, None] * freq[None, :]  # [N, R/2]
    theta = theta.reshape(theta.shape[:1] + (1,) * (x.ndim - 2) + theta.shape[1:])
    cos, sin = np.cos(theta), np.sin(theta)
    if inverse:
        sin = -sin
    out = np.array(x, dtype=np.float64, copy=True)
    a, b = x[..., -R::2], x[..., -R + 1::2]
    out[..., -R::2] = a * cos - b * sin
    out[..., -R + 1::2] = a * sin + b * cos
    return out


# ---- KV compression --------------------------------------------------------------------------------------------
def pool_blocks(kv: np.ndarray, score: np.ndarray, ratio: int, overlap: bool) -> np.ndarray:
    """Per-feature softmax pooling of complete blocks: kv, score [T, c*W] -> rows [T // ratio, W] (before norm)."""
    T = kv.shape[0]
    n_blocks = T // ratio
    W = kv.shape[1] // 2 if overlap else kv.shape[1]
    rows = np.zeros((n_blocks, W))
    for b in range(n_blocks):
        cur = slice(b * ratio, (b + 1) * ratio)
        if overlap:
            if b == 0:
                prev_kv, prev_score = np.zeros((ratio, W)), np.full((ratio, W), -np.inf)
            else:
                prev = slice((b - 1) * ratio, b * ratio)
                prev_kv, prev_score = kv[prev, :W], score[prev, :W]
            cand_kv = np.concatenate([prev_kv, kv[cur, W:]])
            cand_score = np.concatenate([prev_score, score[cur, W:]])
        else:
            cand_kv, cand_score = kv[cur], score[cur]
        rows[b] = np.sum(softmax(cand_score, axis=0) * cand_kv, axis=0)
    return rows


def compress(cfg: ModelConfig, x_n: np.ndarray, w: dict, prefix: str, ratio: int, overlap: bool) -> np.ndarray:
    """One compressor (`{prefix}_kv/_gate/_ape/_norm`) on the normed sublayer input: normed rows before RoPE."""
    kv = x_n @ w[f"{prefix}_kv.weight"].T
    if ratio == 1:  # V4.1 ratio 1: projection + norm, every token is its own row
        rows = kv
    else:
        score = x_n @ w[f"{prefix}_gate.weight"].T
        ape = w.get(f"{prefix}_ape.weight")
        if ape is not None:
            score = score + ape[np.arange(x_n.shape[0]) % ratio]
        rows = pool_blocks(kv, score, ratio, overlap)
    return rms_norm(rows, w[f"{prefix}_norm.weight"], cfg.rms_eps)


def block_positions(n_rows: int, ratio: int) -> np.ndarray:
    return np.arange(n_rows) * ratio


# ---- indexer ---------------------------------------------------------------------------------------------------
def indexer_scores(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, qr: np.ndarray,
                   keys: np.ndarray) -> np.ndarray:
    """score[p, j] = sum_h w_h(p) * relu(q_h(p) . k_j) for every (query, row) pair; visibility is applied later.

    keys [N, ID] already carry their RoPE. Returns [T, N].
    """
    p = f"blk.{layer}."
    T, IH, ID = x_n.shape[0], cfg.index_n_heads, cfg.index_head_dim
    q = (qr @ w[p + "indexer.attn_q_b.weight"].T).reshape(T, IH, ID)
    q = apply_rope(q, np.arange(T), rope_freqs(cfg, layer))
    weights = (x_n @ w[p + "indexer.proj.weight"].T) / math.sqrt(ID * IH)  # [T, IH]
    dots = np.maximum(np.einsum("thd,nd->thn", q, keys), 0.0)
    return np.einsum("th,thn->tn", weights, dots)


def candidate_blocks(scores: np.ndarray, ratio: int, block: int, n_keep: int) -> list[np.ndarray]:
    """Per query p: the kept candidate block ids (ascending), scored by the max over their visible rows."""
    out = []
    for p in range(scores.shape[0]):
        n_vis = (p + 1) // ratio
        n_blk = -(-n_vis // block)
        blk_score = np.array([scores[p, b * block:min((b + 1) * block, n_vis)].max() for b in range(n_blk)])
        out.append(np.sort(top_k(blk_score, n_keep)) if n_blk else np.zeros(0, dtype=np.int64))
    return out


def select_rows(scores: np.ndarray, ratio: int, k: int, allowed_blocks: list[np.ndarray] | None = None,
                block: int = 0) -> list[np.ndarray]:
    """Per query p: the top-k visible rows (ascending), optionally only inside allowed_blocks[p]."""
    out = []
    for p in range(scores.shape[0]):
        rows = np.arange((p + 1) // ratio)
        if allowed_blocks is not None:
            rows = rows[np.isin(rows // block, allowed_blocks[p])]
        chosen = rows[top_k(scores[p, rows], k)] if rows.size else rows
        out.append(np.sort(chosen))
    return out


# ---- attention -------------------------------------------------------------------------------------------------
class SharedKV:
    """What one forward pass hands between layers: compressed rows per kv source, top-k per index source."""

    def __init__(self) -> None:
        self.latent: dict[int, np.ndarray] = {}  # kv source layer -> normed rows before RoPE [N, HD]
        self.rows: dict[int, np.ndarray] = {}  # kv source layer -> attention rows with RoPE [N, HD]
        self.selected: dict[int, list[np.ndarray] | None] = {}  # index source layer -> rows per query
        self.candidates: list[np.ndarray] | None = None  # blocks per query picked at the candidate source


def sink_attention(q: np.ndarray, keys_per_query: list[np.ndarray], sinks: np.ndarray, scale: float) -> np.ndarray:
    """q [T, H, HD]; keys_per_query[p] [n_p, HD] (also the values). Softmax with the sink in the denominator."""
    out = np.zeros_like(q)
    for p, keys in enumerate(keys_per_query):
        s = (q[p] @ keys.T) * scale  # [H, n_p]
        m = np.maximum(s.max(axis=1), sinks)
        e = np.exp(s - m[:, None])
        den = e.sum(axis=1) + np.exp(sinks - m)
        out[p] = (e / den[:, None]) @ keys
    return out


def grouped_output(cfg: ModelConfig, w: dict, layer: int, o: np.ndarray) -> np.ndarray:
    """o [T, H, HD] -> [T, D] through the per-group attn_output_a blocks and attn_output_b."""
    p = f"blk.{layer}."
    T, G, OL = o.shape[0], cfg.o_groups, cfg.o_lora_rank
    wo_a, wo_b = w[p + "attn_output_a.weight"], w[p + "attn_output_b.weight"]
    groups = o.reshape(T, G, -1)  # heads of group g are contiguous
    z = np.concatenate([groups[:, g] @ wo_a[g * OL:(g + 1) * OL].T for g in range(G)], axis=1)
    return z @ wo_b.T


def _compressed_for_layer(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, state: SharedKV) -> None:
    """Run this layer's own KV compressor, if it has one, and publish its rows."""
    if not cfg.has_compressor(layer):
        return
    r = cfg.ratio(layer)
    latent = compress(cfg, x_n, w, f"blk.{layer}.attn_compressor", r, cfg.compressor_overlap(layer))
    state.latent[layer] = latent
    state.rows[layer] = apply_rope(latent, block_positions(len(latent), r), rope_freqs(cfg, layer))


def _index_keys(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, state: SharedKV) -> np.ndarray:
    r, freq = cfg.ratio(layer), rope_freqs(cfg, layer)
    if not cfg.shared_kv:  # V4: the indexer's own overlapped ratio-4 compressor
        raw = compress(cfg, x_n, w, f"blk.{layer}.indexer_compressor", r, overlap=True)
    else:
        src = cfg.kv_source(layer)
        owner = layer if f"blk.{layer}.indexer.attn_k.weight" in w else src
        raw = rms_norm(state.latent[src] @ w[f"blk.{owner}.indexer.attn_k.weight"].T,
                       w[f"blk.{owner}.indexer.k_norm.weight"], cfg.rms_eps)
    return apply_rope(raw, block_positions(len(raw), r), freq)


def _select(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, qr: np.ndarray, state: SharedKV,
            trace: dict | None) -> list[np.ndarray] | None:
    """Compressed rows per query for this layer; None means every visible row (HCA)."""
    isrc = cfg.index_source(layer)
    if isrc < 0:
        return None
    if isrc != layer:
        return state.selected[isrc]
    r = cfg.ratio(layer)
    keys = _index_keys(cfg, layer, w, x_n, state)
    scores = indexer_scores(cfg, layer, w, x_n, qr, keys)
    allowed, csrc = None, cfg.candidate_source_layer_id
    if cfg.shared_kv and csrc >= 0 and layer > csrc:
        if cfg.ratio(csrc) != r:
            raise NotImplementedError(f"layer {layer}: candidate blocks from layer {csrc} of another ratio")
        allowed = state.candidates
    selected = select_rows(scores, r, cfg.index_topk, allowed, cfg.candidate_block_size)
    if cfg.shared_kv and layer == csrc:
        state.candidates = candidate_blocks(scores, r, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        if trace is not None:
            trace[f"blk.{layer}.candidate_blocks"] = state.candidates
    if trace is not None:
        trace[f"blk.{layer}.index_keys"] = keys
        trace[f"blk.{layer}.index_scores"] = scores
    state.selected[layer] = selected
    return selected


def attention(cfg: ModelConfig, layer: int, w: dict, x_n: np.ndarray, state: SharedKV,
              trace: dict | None = None) -> np.ndarray:
    """The attention branch on its normed input x_n [T, D]; returns [T, D] before hc_post."""
    p = f"blk.{layer}."
    T, H, HD = x_n.shape[0], cfg.n_heads, cfg.head_dim
    pos, freq = np.arange(T), rope_freqs(cfg, layer)

    qr = rms_norm(x_n @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"], cfg.rms_eps)
    q = (qr @ w[p + "attn_q_b.weight"].T).reshape(T, H, HD)
    if cfg.q_head_norm:
        q = rms_norm(q, None, cfg.rms_eps)
    q = apply_rope(q, pos, freq)
    kv = rms_norm(x_n @ w[p + "attn_kv.weight"].T, w[p + "attn_kv_a_norm.weight"], cfg.rms_eps)
    kv = apply_rope(kv, pos, freq)

    comp, selected = None, None
    if cfg.ratio(layer) > 0:
        _compressed_for_layer(cfg, layer, w, x_n, state)
        comp = state.rows[cfg.kv_source(layer)]
        selected = _select(cfg, layer, w, x_n, qr, state, trace)
        if selected is None:
            selected = [np.arange((t + 1) // cfg.ratio(layer)) for t in range(T)]

    keys_per_query = []
    for t in range(T):
        keys = kv[max(0, t - cfg.window + 1):t + 1]
        if comp is not None and len(selected[t]):
            keys = np.concatenate([keys, comp[selected[t]]])
        keys_per_query.append(keys)
    o = sink_attention(q, keys_per_query, w[p + "attn_sinks.weight"], 1.0 / math.sqrt(HD))
    o = apply_rope(o, pos, freq, inverse=True)
    out = grouped_output(cfg, w, layer, o)

    if trace is not None:
        trace[p + "q"], trace[p + "kv"] = q, kv
        if comp is not None:
            trace[p + "compressed"] = comp
            trace[p + "selected"] = selected
        trace[p + "attn_out"] = out
    return out
