"""Wiring only: the decode step and prefill of a DeepSeek V4-Flash / V4.1-Flash model over an explicit state.

`decode_step(params, state, token, engram_rows)` runs one token through every block and returns the next-token
logits and the advanced state; `prefill` scans the same step over a prompt, so prompt and decode positions get
identical arithmetic (the reference for the faster paths of later issues). Both are jitted with the config and
layer plan static and the state donated; token ids, positions and Engram rows are array inputs, so nothing
recompiles between steps.

State pytree (plain arrays, so the prefix cache can snapshot it):
  pos                           int32 scalar, the position the next token gets
  layers[i].ring                window ring: kv [window + slack, HD], pos [window + slack] (-1 = empty); the
                                slack (plan.ring_slack) is room for speculative rows, invisible to attention
  layers[i].cmp                 the layer's own KV compressor (compressor.py) when it has one
  layers[i].idx                 V4: the indexer's own compressor (its rows are the index keys);
                                V4.1 kv sources: {"keys": [n_rows, ID]} built from the rows they emit
Engram n-gram history lives with the host-side hasher (it is known from token ids before the step runs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds41.config import ModelConfig
from jds41.layers import attention, compressor, indexer, mhc_input_kernel, side_stream
from jds41.layers.compressor import CompressorSpec
from jds41.layers.engram import engram_combine
from jds41.layers.mhc import hc_collapse, hc_expand, hc_head, hc_mix, hc_onehot_pre, hc_split
from jds41.layers.moe import routed_and_shared, shared_expert
from jds41.layers.norm import rms_norm
from jds41.layers.rope import layer_rope_freqs
from jds41.layers.router import route
from jds41.quant import QTensor, co_launch, qmatvec, qtensor
from jds41.tiers.experts import prefetch_experts, select_experts, tiered_routed_experts


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one block computes, decided once from the config (static under jit)."""

    index: int
    ratio: int
    cmp: CompressorSpec | None  # own attention compressor (V4 layout, or a V4.1 kv source)
    idx_cmp: CompressorSpec | None  # V4 indexer's own compressor
    kv_source: int  # layer whose compressed rows this layer reads (-1: window only)
    index_source: int  # layer whose indexer top-k this layer uses (-1: all visible rows)
    runs_indexer: bool
    latent_index_keys: bool  # V4.1 kv source: derives index keys from the rows it emits
    candidate_source: bool  # V4.1: this layer picks the candidate blocks
    uses_candidates: bool  # V4.1: this layer's indexer is restricted to the candidate blocks
    engram_slot: int  # position in cfg.engram.layer_ids, -1 if none
    hash_layer: bool


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    cfg: ModelConfig
    max_ctx: int
    layers: tuple[LayerPlan, ...]
    # Router lean (DESIGN.md §3): within this margin of the k-th biased score, prefer experts in faster tiers.
    # None = off (the default, and always in the invariance tests); only layers whose experts are tiered lean.
    lean_margin: float | None = None
    # How SSD experts enter the graph: "on-miss" makes the host call only when a selected expert is on the SSD
    # (lax.cond); "always" calls on every step of layers with SSD experts, which is what works under vmap (JAX has no
    # IO effects in a vmapped cond), so the continuously batched step uses it.
    ssd_call: str = "on-miss"
    # Look-ahead (DESIGN.md §3): layer l predicts layer l+1's experts with layer l+1's router on its own FFN input and
    # asks the host to start reading the predicted SSD experts, so the reads overlap the rest of layer l.
    lookahead: bool = False
    # Extra window-ring rows so a speculative verify block never evicts a row still visible after a rollback
    # (attention.window_rows reads the same rows in the same order whatever the slack).
    ring_slack: int = 0
    # Decode row width (jds41/block_step.py): 1 = the one-token `step`; W > 1 = every decode step runs the W-row
    # batched pass with the token in row 0, the numerics a speculative verify of W rows shares bit for bit.
    decode_width: int = 1
    # Prompt row width (jds41/layer_major_rows.py, "wide"): 0 = prompts are read at the decode width with decode's
    # arithmetic; R >= 2 = prompts are read in R-row blocks, layer-major, with each group's routed experts computed
    # expert by expert (jds41/layers/grouped_experts.py, tiles of R rows). Its own numerics: the same bits however a
    # prompt is cut into pieces, not decode's bits.
    prompt_width: int = 0

    def n_rows(self, ratio: int) -> int:
        return -(-self.max_ctx // ratio)


def make_plan(cfg: ModelConfig, max_ctx: int, lean_margin: float | None = None, lookahead: bool = False,
              ring_slack: int = 0, decode_width: int = 1, prompt_width: int = 0) -> ModelPlan:
    if decode_width < 1:
        raise ValueError(f"decode_width must be >= 1, got {decode_width}")
    if prompt_width < 0 or prompt_width == 1:
        raise ValueError(f"prompt_width must be 0 (the decode width) or >= 2, got {prompt_width}")
    layers = []
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        n_rows = -(-max_ctx // r) if r else 0
        cmp = idx_cmp = None
        if cfg.has_compressor(i):
            cmp = CompressorSpec(ratio=r, width=cfg.head_dim, overlap=cfg.compressor_overlap(i), has_gate=r > 1,
                                 has_ape=not cfg.shared_kv, n_rows=n_rows)
        runs_indexer = cfg.has_indexer(i)
        if runs_indexer and not cfg.shared_kv:
            idx_cmp = CompressorSpec(ratio=4, width=cfg.index_head_dim, overlap=True, has_gate=True, has_ape=True,
                                     n_rows=n_rows)
        cand = cfg.candidate_source_layer_id
        layers.append(LayerPlan(
            index=i, ratio=r, cmp=cmp, idx_cmp=idx_cmp, kv_source=cfg.kv_source(i), index_source=cfg.index_source(i),
            runs_indexer=runs_indexer, latent_index_keys=cmp is not None and cfg.shared_kv,
            candidate_source=cfg.shared_kv and i == cand,
            uses_candidates=cfg.shared_kv and cand >= 0 and i > cand and runs_indexer,
            engram_slot=cfg.engram.layer_ids.index(i) if cfg.is_engram_layer(i) else -1,
            hash_layer=cfg.is_hash_layer(i)))
    return ModelPlan(cfg=cfg, max_ctx=max_ctx, layers=tuple(layers), lean_margin=lean_margin, lookahead=lookahead,
                     ring_slack=max(ring_slack, decode_width - 1, prompt_width - 1), decode_width=decode_width,
                     prompt_width=prompt_width)


def init_state(plan: ModelPlan) -> dict:
    cfg = plan.cfg
    layers = []
    for lp in plan.layers:
        st = {"ring": attention.init_ring(cfg, plan.ring_slack)}
        if lp.cmp is not None:
            st["cmp"] = compressor.init_state(lp.cmp)
        if lp.idx_cmp is not None:
            st["idx"] = compressor.init_state(lp.idx_cmp)
        elif lp.latent_index_keys:
            st["idx"] = {"keys": jnp.zeros((plan.n_rows(lp.ratio), cfg.index_head_dim), jnp.float32)}
        layers.append(st)
    return {"pos": jnp.zeros((), jnp.int32), "layers": layers}


def embed(w: QTensor, token: jax.Array) -> jax.Array:
    """One row of the (possibly quantized) embedding table as f32 [D]: only that row's bytes are read."""
    row = jax.lax.dynamic_index_in_dim(jnp.asarray(w.data), token, 0, keepdims=True)
    return w.with_rows(row, (1, w.shape[-1])).dequantize()[0]


def attention_products(lp: LayerPlan, w: dict, h_D, h_blocks: tuple | None = None) -> dict[str, jax.Array]:
    """The attention sublayer's products of its normed input h_D by tensor name (W_qa, W_kv, its compressors' W_kv
    and W_gate, the indexer's W_proj), one launch on CUDA where quant/co_launch.py is on, each with its own
    launch's bits. Why: each reads 0.3-4.5 MB and took 2-4.4 us as a launch of its own, mostly fixed cost (V4-Flash
    on an H100: seven such launches, ~21 us, in a layer with an indexer; results/profile_decode_mhc_v4_43_8L_h100
    .jsonl); together 16.8-17.0 us there, 10.1-10.2 in a ratio-128 layer, 7.5 and 6.8 where only W_qa and W_kv
    are (7.6 and 7.2 apart; results/profile_decode_attn_together43_8L_h100.jsonl).
    W_kv stays in `attention.latent` where the side stream's site "latent" runs it on a second stream. `h_blocks`:
    h's int8 blocks (q, d) where the sublayer input's launch wrote them (`rounds_attention_input`), which the
    products that read int8 blocks take instead of a rounding launch (the same bits)."""
    groups = [("attn_q_a",)] + ([] if "latent" in side_stream.SITES else [("attn_kv",)])
    for spec, prefix in ((lp.cmp, "attn_compressor"), (lp.idx_cmp, "indexer_compressor")):
        if spec is not None:  # a compressor's two products have one shape: one job (qtensor.share_a_launch)
            groups.append((f"{prefix}_kv", f"{prefix}_gate") if spec.has_gate else (f"{prefix}_kv",))
    if lp.runs_indexer:
        groups.append(("indexer.proj",))
    x = jnp.asarray(h_D, jnp.float32)
    if h_blocks is not None:
        x = qtensor.PreRounded(x, *h_blocks)
    made = co_launch.products(tuple(co_launch.Dense(x, tuple(w[n] for n in g)) for g in groups))
    return {name: y for g, ys in zip(groups, made) for name, y in zip(g, ys)}


def _attention_block(plan: ModelPlan, lp: LayerPlan, w: dict, st_all: list, new_st: list, h_D, pos, shared: dict,
                     together: bool = False, h_blocks: tuple | None = None):
    """Attention sublayer of layer lp.index on the normed input h_D; updates new_st[lp.index]; returns [D].
    `together`: h_D's products as `attention_products` makes them (decode's step; the other paths keep a launch a
    product, so the engine's equalities check the shared launch's bits), with h's int8 blocks `h_blocks` where
    the sublayer input's launch wrote them."""
    cfg = plan.cfg
    freqs = jnp.asarray(layer_rope_freqs(cfg, lp.index))
    st = dict(st_all[lp.index])
    made = attention_products(lp, w, h_D, h_blocks) if together and co_launch.ATTENTION else None
    q, qr = attention.query(cfg, w, h_D, made)
    st["ring"] = attention.push_ring(st["ring"], attention.latent(cfg, w, h_D, pos, freqs, made), pos)
    keys, valid = [], []  # past the window's rows, which `attend` reads from the ring
    if lp.cmp is not None:
        st["cmp"] = compressor.update(lp.cmp, st["cmp"], w, h_D, pos, freqs, cfg.rms_eps, made=made)[0]
    if lp.idx_cmp is not None:
        st["idx"], _, _ = compressor.update(lp.idx_cmp, st["idx"], w, h_D, pos, freqs, cfg.rms_eps,
                                            prefix="indexer_compressor", made=made)
    if lp.latent_index_keys:
        st["idx"] = _update_latent_keys(cfg, w, st["idx"], st["cmp"]["latent"], pos, lp.ratio, freqs)
    new_st[lp.index] = st  # before reading sources: a layer may be its own kv source
    if lp.ratio:
        src = new_st[lp.kv_source]["cmp"]["rows"]  # sources precede their users: this step's rows
        visible = compressor.visible_mask(src.shape[0], lp.ratio, pos)
        if lp.index_source < 0:  # HCA: every visible compressed row
            keys.append(src)
            valid.append(visible)
        else:
            if lp.runs_indexer:
                index_keys = st["idx"]["rows"] if lp.idx_cmp is not None else new_st[lp.kv_source]["idx"]["keys"]
                scores = indexer.index_scores(w, qr, h_D, index_keys, pos, freqs, cfg.index_n_heads,
                                              cfg.index_head_dim, made)
                allowed = visible
                if lp.uses_candidates:
                    allowed = allowed & shared["candidates"]
                if lp.candidate_source:
                    shared["candidates"] = indexer.candidate_block_mask(
                        scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                shared[("topk", lp.index)] = indexer.select_top_k(scores, allowed, cfg.index_topk)
            sel, sel_valid = shared[("topk", lp.index_source)]
            keys.append(src[sel])
            valid.append(sel_valid)
    o = attention.attend(cfg, w, q, jnp.concatenate(keys) if keys else None,
                         jnp.concatenate(valid) if valid else None, pos, freqs, ring=st["ring"])
    return attention.output(cfg, w, o)


def _update_latent_keys(cfg, w, idx_st, latent, pos, ratio, freqs):
    """V4.1: when the shared source emits row b at this position, derive its index key from the row's latent."""
    block = pos // ratio
    emitted = (pos + 1) % ratio == 0
    key = indexer.index_key_from_latent(w, latent, block * ratio, freqs, cfg.rms_eps)
    old = jax.lax.dynamic_index_in_dim(idx_st["keys"], block, 0, keepdims=False)
    return {"keys": jax.lax.dynamic_update_index_in_dim(idx_st["keys"], jnp.where(emitted, key, old), block, 0)}


def _predict_next(plan: ModelPlan, lp: LayerPlan, params: dict, h_D) -> jax.Array:
    """Layer l+1's likely experts from layer l's FFN input and layer l+1's router ([K], -1 when not predicted);
    the predicted SSD experts are handed to the host for prefetch (no result, so the graph never waits)."""
    k = plan.cfg.n_experts_used
    nxt = lp.index + 1
    if not plan.lookahead or nxt >= plan.cfg.n_layers or plan.layers[nxt].hash_layer:
        return jnp.full((k,), -1, jnp.int32)
    w_next = params["blocks"][nxt]
    guess = route(h_D, w_next["ffn_gate_inp"], w_next["exp_probs_b"], plan.cfg).idx_K
    if "routed" in w_next:
        prefetch_experts(w_next["routed"], guess)
    return guess


def route_layer(plan: ModelPlan, lp: LayerPlan, w: dict, h_D, token):
    """Layer lp's routing of one token (hash table, or scores with the router lean where the plan compiled it in)."""
    cfg = plan.cfg
    if lp.hash_layer:
        return route(h_D, w["ffn_gate_inp"], None, cfg, hash_ids_K=w["ffn_gate_tid2eid"][token])
    lean = None
    if plan.lean_margin is not None and "routed" in w:  # tier number doubles as the preference rank
        lean = (w["routed"].tier_E, w["routed"].lean_margin)  # a leaf: the guard may lower it
    return route(h_D, w["ffn_gate_inp"], w["exp_probs_b"], cfg, lean=lean)


def _ffn_block(plan: ModelPlan, lp: LayerPlan, w: dict, h_D, token, h_blocks=None):
    """(FFN output [D], the routed expert ids [K] that produced it, experts the router lean swapped in). `h_blocks`:
    h's int8 blocks (q, d) where the sublayer input's launch wrote them (`rounds_ffn_input`)."""
    cfg = plan.cfg
    r = route_layer(plan, lp, w, h_D, token)
    idx, weight = r.idx_K, r.weight_K
    if "routed" in w and plan.ssd_call == "on-miss":  # experts split across HBM / pinned host / SSD, each computed
        y = tiered_routed_experts(w["routed"], h_D, idx, weight, cfg.swiglu_limit[lp.index])  # where its rows are
        if cfg.n_shared_experts:
            y = y + shared_expert(h_D, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"],
                                  cfg.swiglu_limit_shexp[lp.index])
        return y, idx, r.swaps
    shared = (w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"]) if cfg.n_shared_experts else None
    if "routed" in w:  # vmapped (no IO inside a cond): the rows of all K experts gathered into [K, ...] stacks
        sel = select_experts(w["routed"], idx)
        # the selected stacks' own order, a constant: the products clamp their indices (quant/triton_matvec.Job),
        # which XLA folds for a constant; for an iota it was a launch of its own a routed FFN
        routed, at = (sel["gate"], sel["up"], sel["down"]), jnp.asarray(np.arange(idx.shape[0], dtype=np.int32))
    else:
        routed, at = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"]), idx
    # the shared expert's products share the routed ones' launches where quant/co_launch.py is on (same bits)
    y = routed_and_shared(h_D, routed, at, weight, cfg.swiglu_limit[lp.index], shared,
                          cfg.swiglu_limit_shexp[lp.index] if shared else None, x_blocks=h_blocks)
    return y, idx, r.swaps


def _sublayer_mix(cfg: ModelConfig, w: dict, branch: str, x_HD):
    mix = hc_mix(x_HD, w[f"hc_{branch}_fn"], cfg.rms_eps)
    return hc_split(mix, w[f"hc_{branch}_scale"], w[f"hc_{branch}_base"], cfg.hc_eps, cfg.hc_sinkhorn_iters)


def sublayer_input(cfg: ModelConfig, w: dict, branch: str, x_HD, pre_prev_H, round_h: bool = False):
    """One row's sublayer input from the stream x [H, D]: (h [D] its normed input, pre, post, comb), every path's
    (decode, prefill, layer-major groups, verify rows). The collapse takes the handed-over `pre_prev_H` (V4.1's lag)
    or this sublayer's own pre (V4). (Two fused Triton forms of this chain ran slower than XLA's ten kernels on the
    H200: experiments/README.md, twenty-fourth session; under the lag, layers/mhc_input_kernel.py's two launches
    won on an H100 in the thirty-sixth and run on CUDA unless JDS41_MHC_KERNEL=0; V4's three launches, unlagged,
    built in the forty-second session, won on an H100 in the forty-third and run unless JDS41_MHC_KERNEL_V4=0.)
    `round_h` (decode's FFN, where `rounds_ffn_input`) appends h's int8 blocks (q, d), written by h's own launch."""
    def xla(x_HD, pre_prev_H):
        pre, post, comb = _sublayer_mix(cfg, w, branch, x_HD)
        h = rms_norm(hc_collapse(x_HD, pre_prev_H if cfg.hc_lag else pre), w[f"{branch}_norm"], cfg.rms_eps)
        return h, pre, post, comb

    if mhc_input_kernel.applies(cfg.hc_mult, cfg.dim, cfg.hc_mix, lagged=cfg.hc_lag):
        return mhc_input_kernel.sublayer_input(
            x_HD, pre_prev_H if cfg.hc_lag else None, w[f"hc_{branch}_fn"], w[f"hc_{branch}_scale"],
            w[f"hc_{branch}_base"], w[f"{branch}_norm"], rms_eps=cfg.rms_eps, hc_eps=cfg.hc_eps,
            iters=cfg.hc_sinkhorn_iters, default=xla, round_h=round_h)
    if round_h:
        raise ValueError("sublayer_input: round_h where the sublayer input's kernels do not run (rounds_ffn_input)")
    return xla(x_HD, pre_prev_H)


def _input_launch_rounds(cfg: ModelConfig) -> bool:
    """Whether the sublayer input's kernels run and can write h's int8 blocks (`sublayer_input`'s round_h)."""
    return (mhc_input_kernel.ROUND_FFN_INPUT and mhc_input_kernel.applies(cfg.hc_mult, cfg.dim, cfg.hc_mix,
                                                                          lagged=cfg.hc_lag)
            and mhc_input_kernel.rounds(cfg.dim))


def rounds_attention_input(plan: ModelPlan, w: dict) -> bool:
    """Whether decode's attention input comes with its int8 blocks (`sublayer_input`'s round_h): the sublayer
    input's kernels can round, its products share a launch (`attention_products`) and W_qa reads int8 blocks in
    their plain order (Q8_0 under the "int8" numerics with JDS41_INT8_Q8_0=1): the launch that writes h then
    rounds it, not a launch of its own."""
    return co_launch.ENABLED and co_launch.ATTENTION and _input_launch_rounds(plan.cfg) \
        and qtensor.reads_plain_int8(w["attn_q_a"])


def rounds_ffn_input(plan: ModelPlan, w: dict) -> bool:
    """Whether decode's FFN input comes with its int8 blocks (`sublayer_input`'s round_h): the sublayer input's
    kernels run and can round, and the routed gate/up products read int8 blocks in their plain order (the "int8"
    numerics' two-bit and MXFP4 experts), computed by `routed_and_shared` (not the on-miss tiers' branches, whose
    pieces round their own x: the same bits). The blocks then come from the launch that writes h, not a rounding
    launch of their own."""
    cfg = plan.cfg
    if "routed" in w and plan.ssd_call == "on-miss":  # _ffn_block's tiered branches
        return False
    gate = w["routed"].hbm["gate"] if "routed" in w else w.get("ffn_gate_exps")
    if gate is None:
        return False
    if not (co_launch.ENABLED and cfg.n_shared_experts):
        return False  # (routed_and_shared's co-launch is what reads them)
    return _input_launch_rounds(cfg) and qtensor.reads_plain_int8(gate)


def step(plan: ModelPlan, params: dict, state: dict, token: jax.Array, engram_rows: jax.Array | None,
         trace_routing: bool = False, feature_layers: tuple[int, ...] = ()):
    """One token through the model: (logits [V], new state). `engram_rows` [n_engram_layers, n_buckets, bytes].

    `trace_routing=True` (static) also returns {"experts": int32 [n_layers, K], "swaps": int32 [n_layers],
    "predicted_next": int32 [n_layers, K]}: the routed expert ids of every layer (usage profiling, per-tier
    statistics), how many the router lean swapped in, and layer l's look-ahead guess for layer l+1 (-1: none);
    values the step computes anyway, so the logits and state are the same.

    `feature_layers` (static, e.g. the DSpark target layers) also returns, last, float32 [len, D]: each listed
    layer's block input (after Engram, before hc_pre) averaged over the hc copies (MODEL.md §4 target features).
    """
    cfg = plan.cfg
    pos = state["pos"]
    x = jnp.broadcast_to(embed(params["token_embd"], token), (cfg.hc_mult, cfg.dim))
    new_layers: list = list(state["layers"])
    shared: dict = {}
    # V4.1 lag: each sublayer collapses with the `pre` handed over by the previous sublayer.
    pre_prev = hc_onehot_pre(cfg.hc_mult)
    routing, swaps, predicted = [], [], []  # per layer; dead code for XLA unless trace_routing returns them
    features = {}
    for lp in plan.layers:
        w = params["blocks"][lp.index]
        if lp.engram_slot >= 0:
            with jax.named_scope("engram"):  # scopes name the model part in profiles (experiments/profile_decode.py)
                x = engram_combine(x, engram_rows[lp.engram_slot], w["engram_wkv"], w["engram_q"], w["engram_k"],
                                   cfg.rms_eps)
        if lp.index in feature_layers:
            features[lp.index] = jnp.mean(x, axis=0)
        for branch in ("attn", "ffn"):
            with jax.named_scope(branch):
                round_h = (rounds_ffn_input if branch == "ffn" else rounds_attention_input)(plan, w)
                h, pre, post, comb, *h_blocks = sublayer_input(cfg, w, branch, x, pre_prev, round_h)
                if branch == "attn":
                    out = _attention_block(plan, lp, w, state["layers"], new_layers, h, pos, shared, together=True,
                                           h_blocks=tuple(h_blocks) or None)
                else:
                    predicted.append(_predict_next(plan, lp, params, h))
                    out, idx, n_swaps = _ffn_block(plan, lp, w, h, token, tuple(h_blocks) or None)
                    routing.append(idx)
                    swaps.append(n_swaps)
                x = hc_expand(x, out, post, comb)
            pre_prev = pre
    with jax.named_scope("head"):
        logits = output_head(cfg, params, x, pre_prev)
    out = (logits, {"pos": pos + 1, "layers": new_layers})
    if trace_routing:
        out += ({"experts": jnp.stack(routing), "swaps": jnp.stack(swaps), "predicted_next": jnp.stack(predicted)},)
    if feature_layers:
        out += (jnp.stack([features[i] for i in feature_layers]),)
    return out


def output_head(cfg: ModelConfig, params: dict, x_HD, pre_H) -> jax.Array:
    """Logits [V] of one position's final stream: the hc collapse (V4.1: with the lagged `pre`; V4: the head's own
    mHC), the output norm and the output matrix."""
    if cfg.hc_lag:
        y = hc_collapse(x_HD, pre_H)
    else:
        y = hc_head(x_HD, params["output_hc_fn"], params["output_hc_scale"], params["output_hc_base"], cfg.hc_eps,
                    cfg.rms_eps)
    return qmatvec(rms_norm(y, params["output_norm"], cfg.rms_eps), params["output"])


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=2)
def decode_step(plan: ModelPlan, params: dict, state: dict, token: jax.Array, engram_rows=None,
                trace_routing: bool = False, feature_layers: tuple[int, ...] = ()):
    return step(plan, params, state, token, engram_rows, trace_routing, feature_layers)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=2)
def prefill(plan: ModelPlan, params: dict, state: dict, tokens: jax.Array, engram_rows=None,
            trace_routing: bool = False, feature_layers: tuple[int, ...] = ()):
    """All prompt positions through `step` (lax.scan): (logits [T, V], state[, routing][, features], each of the
    per-token outputs with a leading T axis)."""
    def body(st, xs):
        tok, rows = xs
        out = step(plan, params, st, tok, rows, trace_routing, feature_layers)
        return out[1], (out[0], *out[2:])

    state, ys = jax.lax.scan(body, state, (tokens, engram_rows))
    return (ys[0], state, *ys[1:])
