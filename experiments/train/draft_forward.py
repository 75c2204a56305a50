"""The parallel (training) forward of the DSpark drafter: every anchor position of a teacher-forced sequence at
once, computing what `jds41.layers.dspark` computes for one proposal (inject, then propose; its docstring is the
specification, tests/test_train_draft.py checks the logits against it).

Which rows a proposal sees (jds41/speculative.py): the engine injects the target features of every committed
position, and proposes with `propose(last, p)` when positions 0 .. p-1 are committed and `last` is the token at
position p (fed to the target only by the next verify step). Each stage's ring has `window` slots and counts every
filled slot as a key, so the proposal at p attends to the injected rows of positions max(0, p-W) .. p-1 (W =
window; fewer while p < W) plus its own B block rows. In a teacher-forced sequence x_0 .. x_{T-1} with target
features F_q of every position q (forward.py's `feature_layers`), anchor p is therefore:
- injected rows (per stage s): kv_s(q) = RoPE_q(kv_norm_s(W_kv,s main_x_q)), main_x_q = main_norm(main_proj
  concat(F_q)), for p-W <= q <= p-1, q >= 0;
- block [x_p, noise x (B-1)] at positions p .. p+B-1, embedded with the target's embedding and expanded to the hc
  copies; each stage is a full ratio-0 block (its own hc_pre, no V4.1 lag; attention with the sink over the
  injected rows plus all B block latents, non-causal within the block; MoE over the draft's own experts with bias
  routing; shared expert), the last one collapses with hc_head, `norm` and the target's output head;
- Markov head: logits_i += markov_head markov_embd[tok_i], where the engine uses tok_0 = last and its own
  previous argmax; training uses the true tokens tok_i = x_{p+i} (a proposal row only counts when the drafts
  before it were accepted, i.e. equal the committed tokens, and the distillation targets are the target's
  predictions given exactly those tokens); the caller passes the tokens, so the test can pass the engine's;
- confidence: conf_proj . [hidden_i ; markov_embd[tok_i]] (a logit; the engine applies the sigmoid).

Layout: anchors run in chunks of W (T must be a multiple of W); chunk n's injected keys are chunks n-1 and n
of the injected rows (every anchor of chunk n needs rows from nW-W .. nW+W-2), masked to p-W <= q < p. Matrix
products take bf16 (or f32) inputs and accumulate in f32 (mixed.dot), as the main model's training forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.train.forward import hc_collapse, hc_expand, hc_mix, hc_split, mm, route
from experiments.train.mixed import dot
from experiments.train.moe_dispatch import routed_experts_dispatch
from jds41.config import ModelConfig
from jds41.layers.moe import swiglu
from jds41.layers.norm import rms_norm
from jds41.layers.rope import apply_rope, layer_rope_freqs

F32 = jnp.float32


def stage_layer(dcfg: ModelConfig, s: int) -> int:
    """Block index of draft stage s (its RoPE and swiglu clamps come from there), as DraftPlan.layer."""
    return dcfg.n_layers + s


def moe_config(dcfg: ModelConfig) -> ModelConfig:
    """dcfg with the draft's expert count and top-k, for the router (as dspark.make_draft_plan)."""
    import dataclasses

    from jds41.checkpoints.schema import draft_expert_counts

    e, k = draft_expert_counts(dcfg)
    return dataclasses.replace(dcfg, n_experts=e, n_experts_used=k)


def _freqs(dcfg: ModelConfig, s: int) -> jax.Array:
    return jnp.asarray(layer_rope_freqs(dcfg, stage_layer(dcfg, s)))


def injected_rows(dcfg: ModelConfig, stages: list, feats_BTND, dtype=F32) -> list:
    """Per stage, the rows `dspark.inject` writes for every position: [B, T, head_dim] (rotated at q)."""
    B, T = feats_BTND.shape[:2]
    w0 = stages[0]
    main_x = rms_norm(mm(feats_BTND.reshape(B, T, -1).astype(F32), w0["main_proj"], dtype), w0["main_norm"],
                      dcfg.rms_eps)
    pos = jnp.arange(T)[None, :]
    return [apply_rope(rms_norm(mm(main_x, w["attn_kv"], dtype), w["attn_kv_a_norm"], dcfg.rms_eps), pos,
                       _freqs(dcfg, s)) for s, w in enumerate(stages)]


def _attention(dcfg: ModelConfig, s: int, w: dict, h, inj_BTK, pos_TK, dtype):
    """Block rows h [B, T, K, D] attending to the injected window of their anchor and their own block."""
    B, T, K, _ = h.shape
    H, HD, W = dcfg.n_heads, dcfg.head_dim, dcfg.window
    freqs = _freqs(dcfg, s)
    qr = rms_norm(mm(h, w["attn_q_a"], dtype), w["attn_q_a_norm"], dcfg.rms_eps)
    q = mm(qr, w["attn_q_b"], dtype).reshape(B, T, K, H, HD)
    if dcfg.q_head_norm:
        q = rms_norm(q, None, dcfg.rms_eps)
    q = apply_rope(q, pos_TK[None], freqs)
    kv = apply_rope(rms_norm(mm(h, w["attn_kv"], dtype), w["attn_kv_a_norm"], dcfg.rms_eps), pos_TK[None], freqs)

    if T % W:
        raise ValueError(f"sequence length {T} must be a multiple of the window {W}")
    nC = T // W
    qc = q.reshape(B, nC, W, K, H, HD)
    kc = inj_BTK.reshape(B, nC, W, HD)
    k2 = jnp.concatenate([jnp.pad(kc[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), kc], axis=2)  # [B, nC, 2W, HD]
    anchor = jnp.arange(T).reshape(nC, W)
    kpos = anchor[:, :1] - W + jnp.arange(2 * W)[None, :]  # [nC, 2W]
    ok = (kpos[:, None, :] >= anchor[:, :, None] - W) & (kpos[:, None, :] < anchor[:, :, None]) & \
        (kpos[:, None, :] >= 0)  # [nC, W, 2W]: the ring's rows at the proposal
    scale = HD ** -0.5
    s_inj = dot("bnakhd,bnjd->bnakhj", qc, k2, dtype) * scale
    s_inj = jnp.where(ok[None, :, :, None, None, :], s_inj, -jnp.inf)
    kvc = kv.reshape(B, nC, W, K, HD)
    s_blk = dot("bnakhd,bnajd->bnakhj", qc, kvc, dtype) * scale  # non-causal: every row sees all K
    logits = jnp.concatenate([s_inj, s_blk], axis=-1)  # [B, nC, W, K, H, 2W + K]
    sink = w["attn_sinks"].astype(F32)[:, None]  # [H, 1]
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    e = jnp.exp(logits - top)
    p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    o = dot("bnakhj,bnjd->bnakhd", p[..., :2 * W], k2, dtype) + dot("bnakhj,bnajd->bnakhd", p[..., 2 * W:], kvc, dtype)
    o = apply_rope(o.reshape(B, T, K, H, HD), pos_TK[None], freqs, inverse=True)
    G, L = dcfg.o_groups, dcfg.o_lora_rank
    o_G = o.reshape(B, T, K, G, H * HD // G)
    o_GL = dot("btkgx,glx->btkgl", o_G, w["attn_output_a"].reshape(G, L, -1), dtype)
    return mm(o_GL.reshape(B, T, K, G * L), w["attn_output_b"], dtype)


def _ffn(dcfg: ModelConfig, s: int, w: dict, buf: dict, h, dtype, block: int):
    """MoE over the draft's own experts (bias routing, never hashed) plus the shared expert; (out, counts [E])."""
    shape = h.shape
    mcfg = moe_config(dcfg)
    layer = stage_layer(dcfg, s)
    x = h.reshape(-1, shape[-1])
    idx, wts, _ = route(mcfg, w, buf, x, None, False)
    y = routed_experts_dispatch(x, idx, wts, w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"],
                                dcfg.swiglu_limit[layer], dtype, block)
    if dcfg.n_shared_experts:
        sh = swiglu(mm(x, w["ffn_gate_shexp"], dtype), mm(x, w["ffn_up_shexp"], dtype), dcfg.swiglu_limit_shexp[layer])
        y = y + mm(sh, w["ffn_down_shexp"], dtype)
    counts = jnp.zeros((mcfg.n_experts,), F32).at[idx.reshape(-1)].add(1.0)
    return y.reshape(shape), counts


def draft_forward(dcfg: ModelConfig, params: dict, buffers: dict, shared: dict, tokens_BT, feats_BTND,
                  markov_BTK, dtype=F32, block: int = 256, detach_conf: bool = True):
    """Every anchor of the sequences at once: (logits [B, T, K, V] with the Markov term, confidence logits
    [B, T, K], expert counts [n_stages, E]).

    `tokens_BT`: the anchors' tokens x_p; `feats_BTND` [B, T, n_targets, D]: the target's features of every
    position; `markov_BTK`: tok_i of row i of anchor p; `shared`: the target's float `token_embd` and `output`;
    `params` / `buffers`: {"stages": [{short name: array}]} (draft_train.py's layout).
    `detach_conf`: the confidence head learns on detached inputs, so its loss never moves the drafting trunk.
    """
    B, T = tokens_BT.shape
    K, Hc, D = dcfg.dspark.block_size, dcfg.hc_mult, dcfg.dim
    stages, bufs = params["stages"], buffers["stages"]
    inj = injected_rows(dcfg, stages, feats_BTND, dtype)
    ids = jnp.concatenate([tokens_BT[..., None].astype(jnp.int32),
                           jnp.full((B, T, K - 1), dcfg.dspark.noise_token_id, jnp.int32)], axis=-1)
    pos_TK = jnp.arange(T)[:, None] + jnp.arange(K)[None, :]
    e = shared["token_embd"].astype(F32)[ids]  # [B, T, K, D]
    x = jnp.broadcast_to(e[..., None, :], (B, T, K, Hc, D))
    counts = []
    for s, (w, buf) in enumerate(zip(stages, bufs, strict=True)):
        for branch in ("attn", "ffn"):
            mix = hc_mix(x, w[f"hc_{branch}_fn"], dcfg.rms_eps)
            pre, post, comb = hc_split(mix, w[f"hc_{branch}_scale"].astype(F32), w[f"hc_{branch}_base"].astype(F32),
                                       dcfg.hc_eps, dcfg.hc_sinkhorn_iters, Hc, loop=True)
            h = rms_norm(hc_collapse(x, pre), w[f"{branch}_norm"], dcfg.rms_eps)
            if branch == "attn":
                out = _attention(dcfg, s, w, h, inj[s], pos_TK, dtype)
            else:
                out, cnt = _ffn(dcfg, s, w, buf, h, dtype, block)
                counts.append(cnt)
            x = hc_expand(x, out, post, comb)
    w = stages[-1]
    mix = hc_mix(x, w["hc_head_fn"], dcfg.rms_eps)
    pre = jax.nn.sigmoid(mix * w["hc_head_scale"].astype(F32)[0] + w["hc_head_base"].astype(F32)) + dcfg.hc_eps
    hidden = rms_norm(hc_collapse(x, pre), w["norm"], dcfg.rms_eps)  # [B, T, K, D]: the row the head reads
    m = w["markov_embd"].astype(F32)[markov_BTK]  # [B, T, K, rank]
    logits = mm(hidden, shared["output"], dtype) + mm(m, w["markov_head"], dtype)
    feat = jnp.concatenate([hidden, m], axis=-1)
    if detach_conf:
        feat = jax.lax.stop_gradient(feat)
    conf = jnp.einsum("...k,k->...", feat, w["conf_proj"][0].astype(F32), precision=jax.lax.Precision.HIGHEST)
    return logits, conf, jnp.stack(counts)
