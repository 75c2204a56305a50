"""The teacher-forced, full-sequence training forward of a `deepseek41` model in the V4 per-layer layout.

It computes, for every position of a batch of sequences at once, what `jds41.model.step` computes one token at a
time from a fresh state (MODEL.md §2-3; the engine is the specification, tests/test_train_forward.py checks the
logits against `jds41.model.prefill`):
- mHC with the V4.1 lag: each sublayer mixes its own input stream, collapses with the previous sublayer's `pre`
  (layer 0's attention with the one-hot on copy 0), expands with its own post/comb; the output collapses with the
  last FFN's `pre`;
- Engram at the entry of its layers, from rows gathered by the host hash (`jds41.layers.engram_rows`) out of a
  float table (the engine reads the same table quantized to e4m3/e8m0, export.py);
- attention: causal sliding window with a sink, computed in chunks of `window` queries against the previous and
  current chunk; compressed rows by parallel group pooling (ratio 4 overlapping two groups); HCA layers read every
  visible row (row j visible at position p iff j < (p+1)//ratio), CSA layers the indexer's top-k of the visible
  rows, selected with `lax.top_k` on the same masked scores as `indexer.select_top_k`;
- MoE: sqrt-softplus router, bias-only top-k selection (hash layers: tid2eid[token]), weights renormalised
  (sum clamped at 2^-14) and scaled, applied before W_down; routed experts by a sort-and-block dispatch
  (`moe_dispatch.py`) that drops no token; the shared expert always on.

Numerics: matrix products take their inputs in `compute_dtype` (bf16 for training, f32 for the exactness tests)
and accumulate in f32; norms, softmaxes, RoPE, mHC and routing scores are f32.

Parameters are float arrays named and shaped exactly as the GGUF schema (`jds41.checkpoints.schema`), numpy order
[out, in]: `params["blocks"][i]["attn_q_a"]`, `params["token_embd"]`, ...; the per-layer Engram table is
`engram_embd` as float [rows, head_dim]. Non-trained buffers (router bias, tid2eid) live in `buffers` with the
same layout. Besides the logits, `forward` returns per-layer routing counts (for the bias update), the sequence-
wise balance loss of DeepSeek-V3 and the indexer's distillation loss (DeepSeek-V3.2: KL from the heads' summed
attention over the compressed rows to the indexer's softmax, indexer inputs detached), which is the indexer's
only training signal since its top-k selection has no gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments.train.mixed import dot
from experiments.train.moe_dispatch import routed_experts_dispatch
from jds41.config import ModelConfig
from jds41.layers.moe import swiglu
from jds41.layers.norm import rms_norm
from jds41.layers.rope import apply_rope, layer_rope_freqs
from jds41.layers.router import WEIGHT_SUM_MIN, gate_scores

F32 = jnp.float32


def mm(x, w, dtype):
    """x [..., in] @ w[out, in].T with inputs in `dtype`, f32 accumulation."""
    return dot("...i,oi->...o", x, w, dtype)


# ---- mHC (same math as jds41.layers.mhc, for any leading axes, without the decode fusion islands) ----------------


def hc_mix(x_BTHD, fn, eps):
    flat = x_BTHD.reshape(*x_BTHD.shape[:-2], -1).astype(F32)
    xn = rms_norm(flat, None, eps)
    return jnp.einsum("...k,mk->...m", xn, fn.astype(F32), precision=jax.lax.Precision.HIGHEST)


def hc_split(mix, scale, base, hc_eps, iters, H, loop: bool = False):
    """`loop` runs the Sinkhorn iterations as a fori_loop (as jds41.layers.mhc does) instead of unrolled: the same
    arithmetic, a graph with one iteration instead of `iters` (half the drafter step's compile time on a CPU)."""
    pre = jax.nn.sigmoid(mix[..., :H] * scale[0] + base[:H]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., H:2 * H] * scale[1] + base[H:2 * H])
    logits = (mix[..., 2 * H:] * scale[2] + base[2 * H:]).reshape(*mix.shape[:-1], H, H)
    c = jax.nn.softmax(logits, axis=-1) + hc_eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    if loop:
        return pre, post, jax.lax.fori_loop(0, iters - 1, body, c)
    for i in range(iters - 1):
        c = body(i, c)
    return pre, post, c


def hc_collapse(x_BTHD, pre_BTH):
    return jnp.einsum("...hd,...h->...d", x_BTHD, pre_BTH, precision=jax.lax.Precision.HIGHEST)


def hc_expand(x_BTHD, out_BTD, post_BTH, comb_BTSD):
    carried = jnp.einsum("...sd,...sk->...dk", comb_BTSD, x_BTHD, precision=jax.lax.Precision.HIGHEST)
    return post_BTH[..., :, None] * out_BTD[..., None, :] + carried


# ---- Engram ------------------------------------------------------------------------------------------------------


def engram_combine(x_BTHD, table, ids_BTN, wkv, q_w, k_w, eps, dtype):
    """MODEL.md §3 combine; rows gathered from the float table [rows, head_dim] by host-hashed ids [B, T, NB]."""
    H, D = x_BTHD.shape[-2:]
    e = table[ids_BTN].reshape(*ids_BTN.shape[:-1], -1)
    kv = mm(e, wkv, dtype)
    k = kv[..., :H * D].reshape(*kv.shape[:-1], H, D)
    v = kv[..., H * D:]
    x = x_BTHD.astype(F32)
    dot = jnp.sum(x * (q_w * k_w) * k, axis=-1)
    r_x = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)
    r_k = jax.lax.rsqrt(jnp.mean(k * k, axis=-1) + eps)
    dot = dot * r_x * r_k / math.sqrt(D)
    g = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
    return x + g[..., None] * v[..., None, :]


# ---- compressor / indexer ----------------------------------------------------------------------------------------


def compress(w, prefix, h_BTD, ratio, width, overlap, freqs, eps, dtype):
    """Every complete group's compressed row, normalised and rotated: [B, T//ratio, width] (and the pre-RoPE)."""
    B, T, _ = h_BTD.shape
    nb = T // ratio
    kv = mm(h_BTD, w[f"{prefix}_kv"], dtype)[:, :nb * ratio]
    sc = mm(h_BTD, w[f"{prefix}_gate"], dtype)[:, :nb * ratio]
    kv = kv.reshape(B, nb, ratio, -1)
    sc = sc.reshape(B, nb, ratio, -1) + w[f"{prefix}_ape"].astype(F32)[None, None]
    if overlap:  # block b pools the previous block via features [0:W] and itself via [W:2W]; block 0: kv 0, -inf
        kv_prev = jnp.pad(kv[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)))
        sc_prev = jnp.pad(sc[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([kv_prev, kv[..., width:]], axis=2)
        sc = jnp.concatenate([sc_prev, sc[..., width:]], axis=2)
    pooled = jnp.sum(jax.nn.softmax(sc, axis=2) * kv, axis=2)
    latent = rms_norm(pooled, w[f"{prefix}_norm"], eps)
    return apply_rope(latent, (jnp.arange(nb) * ratio)[None, :], freqs)


def visible(T, n_rows, ratio):
    """[T, n_rows]: row j visible to position p iff j < (p+1)//ratio."""
    return jnp.arange(n_rows)[None, :] < ((jnp.arange(T) + 1) // ratio)[:, None]


def index_scores(w, qr_BTQ, h_BTD, keys_BRK, freqs, n_heads, head_dim, dtype):
    """[B, T, R] raw indexer scores (visibility not applied)."""
    B, T, _ = h_BTD.shape
    q = mm(qr_BTQ, w["indexer.attn_q_b"], dtype).reshape(B, T, n_heads, head_dim)
    q = apply_rope(q, jnp.arange(T)[None, :], freqs)
    weights = mm(h_BTD, w["indexer.proj"], dtype) * (head_dim * n_heads) ** -0.5
    dots = dot("bthk,brk->bthr", q, keys_BRK, dtype)
    return jnp.einsum("bth,bthr->btr", weights, jax.nn.relu(dots))


def top_k_mask(scores_BTR, allowed_TR, k):
    """Rows `indexer.select_top_k` keeps: top-k of the allowed scores (lax.top_k order), as a mask."""
    k = min(k, scores_BTR.shape[-1])
    masked = jnp.where(allowed_TR, scores_BTR, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    hit = jnp.zeros(scores_BTR.shape, bool)
    hit = jax.vmap(jax.vmap(lambda m, i: m.at[i].set(True)))(hit, idx)
    return hit & allowed_TR


# ---- attention ---------------------------------------------------------------------------------------------------


def attention(cfg: ModelConfig, layer: int, w, h_BTD, dtype, rows=None):
    """Attention sublayer over the whole sequence -> ([B, T, D], indexer loss scalar)."""
    B, T, _ = h_BTD.shape
    H, HD, W = cfg.n_heads, cfg.head_dim, cfg.window
    freqs = jnp.asarray(layer_rope_freqs(cfg, layer))
    pos = jnp.arange(T)[None, :]
    qr = rms_norm(mm(h_BTD, w["attn_q_a"], dtype), w["attn_q_a_norm"], cfg.rms_eps)
    q = mm(qr, w["attn_q_b"], dtype).reshape(B, T, H, HD)
    if cfg.q_head_norm:
        q = rms_norm(q, None, cfg.rms_eps)
    q = apply_rope(q, pos, freqs)
    kv = apply_rope(rms_norm(mm(h_BTD, w["attn_kv"], dtype), w["attn_kv_a_norm"], cfg.rms_eps), pos, freqs)

    # window keys: chunk n of W queries sees chunks n-1 and n, masked to 0 <= p - k < W
    if T % W:
        raise ValueError(f"sequence length {T} must be a multiple of the window {W}")
    nC = T // W
    qc = q.reshape(B, nC, W, H, HD)
    kc = kv.reshape(B, nC, W, HD)
    k2 = jnp.concatenate([jnp.pad(kc[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), kc], axis=2)  # [B, nC, 2W, HD]
    qpos = jnp.arange(T).reshape(nC, W)
    kpos = qpos[:, :1] - W + jnp.arange(2 * W)[None, :]
    win_ok = (qpos[:, :, None] - kpos[:, None, :] < W) & (qpos[:, :, None] >= kpos[:, None, :]) & (kpos[:, None] >= 0)
    scale = HD ** -0.5
    s_win = dot("bnqhk,bnjk->bnhqj", qc, k2, dtype) * scale
    s_win = jnp.where(win_ok[None, :, None], s_win, -jnp.inf)
    logits, values = [s_win], None
    idx_loss = jnp.zeros((), F32)
    r = cfg.ratio(layer)
    if r:
        cr = compress(w, "attn_compressor", h_BTD, r, HD, cfg.compressor_overlap(layer), freqs, cfg.rms_eps, dtype)
        n_rows = cr.shape[1]
        vis = visible(T, n_rows, r)  # [T, R]
        s_cmp = dot("bthk,brk->bhtr", q, cr, dtype) * scale
        allowed = jnp.broadcast_to(vis, (B, T, n_rows))
        if cfg.has_indexer(layer):
            keys = compress(w, "indexer_compressor", jax.lax.stop_gradient(h_BTD), 4, cfg.index_head_dim, True,
                            freqs, cfg.rms_eps, dtype)
            scores = index_scores(w, jax.lax.stop_gradient(qr), jax.lax.stop_gradient(h_BTD), keys, freqs,
                                  cfg.index_n_heads, cfg.index_head_dim, dtype)
            allowed = top_k_mask(jax.lax.stop_gradient(scores), vis, cfg.index_topk)
            idx_loss = _indexer_loss(scores, jax.lax.stop_gradient(s_cmp), vis)
        s_cmp = jnp.where(allowed[:, None], s_cmp, -jnp.inf)  # [B, H, T, R]
        logits.append(s_cmp.reshape(B, H, nC, W, n_rows).transpose(0, 2, 1, 3, 4))
        values = cr
    all_logits = jnp.concatenate(logits, axis=-1)  # [B, nC, H, W, 2W (+R)]
    sink = w["attn_sinks"].astype(F32)[None, None, :, None]
    top = jnp.maximum(jnp.max(all_logits, axis=-1), sink)
    e = jnp.exp(all_logits - top[..., None])
    p = e / (jnp.sum(e, axis=-1) + jnp.exp(sink - top))[..., None]
    o = dot("bnhqj,bnjk->bnqhk", p[..., :2 * W], k2, dtype)
    if values is not None:
        o = o + dot("bnhqr,brk->bnqhk", p[..., 2 * W:], values, dtype)
    o = apply_rope(o.reshape(B, T, H, HD), pos, freqs, inverse=True)
    G, L = cfg.o_groups, cfg.o_lora_rank
    o_G = o.reshape(B, T, G, H * HD // G)
    wo_a = w["attn_output_a"].reshape(G, L, -1)
    o_GL = dot("btgx,glx->btgl", o_G, wo_a, dtype)
    return mm(o_GL.reshape(B, T, G * L), w["attn_output_b"], dtype), idx_loss


def _indexer_loss(scores_BTR, s_cmp_BHTR, vis_TR):
    """KL(target || indexer) per query over the visible rows, averaged over queries that see any row."""
    masked = jnp.where(vis_TR[None, None], s_cmp_BHTR, -jnp.inf)
    any_row = jnp.any(vis_TR, axis=-1)  # [T]
    att = jax.nn.softmax(jnp.where(any_row[None, None, :, None], masked, 0.0), axis=-1)
    target = jnp.sum(att, axis=1)
    target = target / jnp.maximum(jnp.sum(target, axis=-1, keepdims=True), 1e-9)
    logp = jax.nn.log_softmax(jnp.where(vis_TR[None] & any_row[None, :, None], scores_BTR, -1e30), axis=-1)
    kl = jnp.sum(jnp.where(vis_TR[None], target * (jnp.log(jnp.maximum(target, 1e-9)) - logp), 0.0), axis=-1)
    return jnp.sum(kl * any_row[None]) / jnp.maximum(jnp.sum(any_row) * scores_BTR.shape[0], 1)


# ---- FFN ---------------------------------------------------------------------------------------------------------


def route(cfg: ModelConfig, w, buf, h_ND, tokens_N, hash_layer):
    """(idx [N, K], weights [N, K], scores [N, E]) exactly as `jds41.layers.router.route` per token."""
    logits = jnp.einsum("nd,ed->ne", h_ND, w["ffn_gate_inp"].astype(F32), precision=jax.lax.Precision.HIGHEST)
    scores = gate_scores(logits, cfg.gating_func)
    if hash_layer:
        idx = buf["ffn_gate_tid2eid"][tokens_N]
    else:
        idx = jax.lax.top_k(jax.lax.stop_gradient(scores) + buf["exp_probs_b"], cfg.n_experts_used)[1]
    wts = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.expert_weights_norm:
        wts = wts / jnp.maximum(jnp.sum(wts, axis=-1, keepdims=True), WEIGHT_SUM_MIN)
    return idx.astype(jnp.int32), wts * cfg.expert_weights_scale, scores


def balance_loss(cfg: ModelConfig, idx_BTK, scores_BTE):
    """DeepSeek-V3's sequence-wise balance loss sum_i f_i P_i (without its alpha), averaged over sequences."""
    E, K = cfg.n_experts, cfg.n_experts_used
    T = idx_BTK.shape[1]
    counts = jnp.sum(jax.nn.one_hot(idx_BTK, E, dtype=F32), axis=(1, 2))  # [B, E]
    f = counts * E / (K * T)
    s = scores_BTE / jnp.maximum(jnp.sum(scores_BTE, axis=-1, keepdims=True), 1e-9)
    return jnp.mean(jnp.sum(f * jnp.mean(s, axis=1), axis=-1))


def ffn(cfg: ModelConfig, layer: int, w, buf, h_BTD, tokens_BT, dtype, block, count_mask=None):
    B, T, D = h_BTD.shape
    h = h_BTD.reshape(B * T, D)
    hash_layer = cfg.is_hash_layer(layer)
    idx, wts, scores = route(cfg, w, buf, h, tokens_BT.reshape(-1), hash_layer)
    y = routed_experts_dispatch(h, idx, wts, w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"],
                                cfg.swiglu_limit[layer], dtype, block)
    if cfg.n_shared_experts:
        sh = swiglu(mm(h, w["ffn_gate_shexp"], dtype), mm(h, w["ffn_up_shexp"], dtype), cfg.swiglu_limit_shexp[layer])
        y = y + mm(sh, w["ffn_down_shexp"], dtype)
    weight = jnp.ones(idx.shape, F32) if count_mask is None else jnp.broadcast_to(
        count_mask.reshape(-1, 1).astype(F32), idx.shape)
    counts = jnp.zeros((cfg.n_experts,), F32).at[idx.reshape(-1)].add(weight.reshape(-1))
    bal = jnp.zeros((), F32) if hash_layer else balance_loss(cfg, idx.reshape(B, T, -1), scores.reshape(B, T, -1))
    return y.reshape(B, T, D), counts, bal


# ---- the model ---------------------------------------------------------------------------------------------------


def forward(cfg: ModelConfig, params: dict, buffers: dict, tokens_BT, engram_ids=None, dtype=F32, block: int = 256,
            remat: bool = False, count_mask=None, feature_layers: tuple[int, ...] = (), sinkhorn_loop: bool = False):
    """Logits [B, T, V] f32 and aux {"counts" [n_layers, E], "balance" [n_layers], "indexer" scalar}.

    `engram_ids` int32 [B, T, n_engram_layers, n_buckets] (host hash, each sequence starting fresh);
    `count_mask` [B, T] (optional) weights each position's expert selections in "counts" (0 = padding).
    `feature_layers` (static; e.g. the DSpark target layers) adds aux["features"] f32 [B, T, len, D]: each listed
    layer's block input (after Engram, before hc_pre) averaged over the hc copies, what `jds41.model.step` reports
    as its features, so the drafter (draft_forward.py) trains on the engine's features. `sinkhorn_loop`: see
    hc_split (the drafter's frozen-target forward uses it to compile faster).
    """
    if not cfg.hc_lag or cfg.shared_kv:
        raise ValueError("the training forward implements deepseek41 in the V4 per-layer layout only")
    Hc = cfg.hc_mult
    B, T = tokens_BT.shape
    x = jnp.broadcast_to(params["token_embd"].astype(F32)[tokens_BT][:, :, None, :], (B, T, Hc, cfg.dim))
    pre_prev = jnp.broadcast_to(jnp.zeros((Hc,), F32).at[0].set(1.0), (B, T, Hc))
    counts, bals, idx_losses, features = [], [], [], {}
    for layer in range(cfg.n_layers):
        w, buf = params["blocks"][layer], buffers["blocks"][layer]
        ids = None
        if cfg.is_engram_layer(layer):
            ids = engram_ids[:, :, cfg.engram.layer_ids.index(layer)]

        def block_fn(x, pre_prev, w, ids, layer=layer, buf=buf):
            if ids is not None:
                x = engram_combine(x, w["engram_embd"], ids, w["engram_wkv"], w["engram_q"], w["engram_k"],
                                   cfg.rms_eps, dtype)
            feat = jnp.mean(x.astype(F32), axis=-2) if layer in feature_layers else None
            aux = []
            for branch in ("attn", "ffn"):
                mix = hc_mix(x, w[f"hc_{branch}_fn"], cfg.rms_eps)
                pre, post, comb = hc_split(mix, w[f"hc_{branch}_scale"].astype(F32),
                                           w[f"hc_{branch}_base"].astype(F32), cfg.hc_eps, cfg.hc_sinkhorn_iters, Hc,
                                           sinkhorn_loop)
                h = rms_norm(hc_collapse(x, pre_prev), w[f"{branch}_norm"], cfg.rms_eps)
                if branch == "attn":
                    out, idx_loss = attention(cfg, layer, w, h, dtype)
                    aux.append(idx_loss)
                else:
                    out, cnt, bal = ffn(cfg, layer, w, buf, h, tokens_BT, dtype, block, count_mask)
                    aux += [cnt, bal]
                x = hc_expand(x, out, post, comb)
                pre_prev = pre
            return x, pre_prev, aux, feat

        fn = jax.checkpoint(block_fn) if remat else block_fn
        x, pre_prev, (idx_loss, cnt, bal), feat = fn(x, pre_prev, w, ids)
        if feat is not None:
            features[layer] = feat
        counts.append(cnt)
        bals.append(bal)
        idx_losses.append(idx_loss)
    y = rms_norm(hc_collapse(x, pre_prev), params["output_norm"], cfg.rms_eps)
    logits = mm(y, params["output"], dtype)
    aux = {"counts": jnp.stack(counts), "balance": jnp.stack(bals), "indexer": sum(idx_losses)}
    if feature_layers:
        aux["features"] = jnp.stack([features[i] for i in feature_layers], axis=2)
    return logits, aux


def engram_ids_batch(hasher, tokens_BT: np.ndarray) -> np.ndarray:
    """Host hash of every position of every sequence, each sequence starting fresh: int32 [B, T, L, NB]."""
    tok = np.asarray(tokens_BT, np.int64)
    B, T = tok.shape
    n = hasher.n
    cid = hasher.token_map[tok]  # [B, T] uint64
    ctx = np.full((B, T, n), hasher.pad_cid, np.uint64)
    for k in range(n):
        ctx[:, k:, k] = cid[:, :T - k]
    rows = hasher.hash_context(ctx.reshape(B * T, n))
    return rows.reshape(B, T, *rows.shape[1:]).astype(np.int32)
