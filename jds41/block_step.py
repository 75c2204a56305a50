"""Decode at a row width: W consecutive positions through the model in ONE pass, each row's arithmetic batched
over the rows, so a block costs one step's kernel launches instead of W steps'.

Why (experiments/README.md, bench_draft section): on the H200 a decode step of the trained small model is bound by
kernel launches, not bytes, and bit-identity made every speculative verify row run the one-token step in a scan,
so a 5-token verify block cost 5.2 plain steps. `step_rows` is the same model with a leading row axis: every
per-token function of `model.step` (embedding, Engram, mHC, query / latent / compressor projections, indexer,
attention, router, experts, head) runs once for all W rows under `jax.vmap`; only what is sequential by nature runs
row by row: pushing the rows into the window ring, and the compressors' ring buffers and pooling (`compressor.absorb`,
each row an island so every row compiles to the same kernels).

Bit-identity, and to what. A row's values here are NOT bit-identical to `model.step` (a matvec batched over rows is
a matmul, which XLA may sum in another order). They are identical to the same row in any other call of
`step_rows` of the same width: rows are computed uniformly (the batched kernels treat every row alike, whatever the
other rows hold) and a row only reads state of positions <= its own (window rows and compressed rows are masked by
position, as in `model.step` and the layer-major prefill). So a decode that runs every step at width W (row 0 the
real token, the others padding, the state rolled back to one position: `decode_rows`) and a speculative verify of
W real rows (speculative.verify_block(how="batched")) give the same logits and states. The engine's decode width
is therefore one numerics setting shared by plain decode and drafting (tests/test_block_step.py).

Rows past the valid ones write ring slots and compressor state of later positions; the caller rolls them back with
`speculative.rollback` (the verify contract: logits, state, per-row small compressor leaves), exactly as for a
rejected draft. The ring needs plan.ring_slack >= W - 1 for that (the speculative plan already has it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jds41 import model as M
from jds41 import prefill as PF
from jds41.layers import attention, compressor, indexer
from jds41.layers.engram import engram_combine
from jds41.layers.mhc import hc_expand, hc_onehot_pre
from jds41.layers.moe import routed_experts, shared_expert
from jds41.layers.rope import layer_rope_freqs
from jds41.layers.rowwise import island
from jds41.tiers.experts import prefetch_experts

SMALL_LEAVES = ("kv_buf", "score_buf", "latent")  # the compressor leaves a rollback takes per position


def _absorb_rows(spec, st: dict, w: dict, kv_W, sc_W, pos_W, freqs, eps: float, prefix: str):
    """The compressor's sequential part for each row in order: (state after the last row, [state after row i])."""
    after = []
    for i in range(kv_W.shape[0]):
        sc = None if sc_W is None else sc_W[i]
        # islands: every row's absorb compiles to the same kernels, whatever the rows around it
        st_i, kv, sc, pos = island((st, kv_W[i], sc, pos_W[i]))
        st = island(compressor.absorb(spec, st_i, w, kv, sc, pos, freqs, eps, prefix)[0])
        after.append(st)
    return st, after


def _attention_rows(plan: M.ModelPlan, lp: M.LayerPlan, w: dict, new_st: list, h_W, pos_W, shared: dict):
    """Attention sublayer of layer lp for W rows -> (out [W, D], small leaves per row {name: {leaf: [W, ...]}})."""
    cfg = plan.cfg
    W = h_W.shape[0]
    freqs = jnp.asarray(layer_rope_freqs(cfg, lp.index))
    st = dict(new_st[lp.index])
    q, qr = jax.vmap(lambda h: attention.query(cfg, w, h))(h_W)
    kv = jax.vmap(lambda h, p: attention.latent(cfg, w, h, p, freqs))(h_W, pos_W)
    ring = st["ring"]
    for i in range(W):
        ring = attention.push_ring(ring, kv[i], pos_W[i])
    st["ring"] = ring
    small = {}
    latents = None
    for name, spec, prefix in (("cmp", lp.cmp, "attn_compressor"), ("idx", lp.idx_cmp, "indexer_compressor")):
        if spec is None:
            continue
        kv_W, sc_W = jax.vmap(lambda h, s=spec, pf=prefix: compressor.project(s, w, h, pf))(h_W)
        st[name], after = _absorb_rows(spec, st[name], w, kv_W, sc_W, pos_W, freqs, cfg.rms_eps, prefix)
        small[name] = {k: jnp.stack([a[k] for a in after]) for k in SMALL_LEAVES}
        if name == "cmp":
            latents = jnp.stack([a["latent"] for a in after])
    if lp.latent_index_keys:  # V4.1: the index key of each row a position emits, from that position's latent
        r = lp.ratio
        block_W = pos_W // r
        key_W = jax.vmap(lambda lat, b: indexer.index_key_from_latent(w, lat, b * r, freqs, cfg.rms_eps))(
            latents, block_W)
        keys = st["idx"]["keys"]
        for i in range(W):
            old = jax.lax.dynamic_index_in_dim(keys, block_W[i], 0, keepdims=False)
            keys = jax.lax.dynamic_update_index_in_dim(keys, jnp.where((pos_W[i] + 1) % r == 0, key_W[i], old),
                                                       block_W[i], 0)
        st["idx"] = {"keys": keys}
    new_st[lp.index] = st  # before reading sources: a layer may be its own kv source
    extra_kv, extra_valid, batched = None, None, False  # past the window's rows, which `attend` reads from the ring
    if lp.ratio:
        src = new_st[lp.kv_source]["cmp"]["rows"]  # after every row: later rows' blocks are masked by position
        visible = jax.vmap(lambda p: compressor.visible_mask(src.shape[0], lp.ratio, p))(pos_W)
        if lp.index_source < 0:  # HCA: every visible compressed row
            extra_kv, extra_valid = src, visible
        else:
            if lp.runs_indexer:
                index_keys = st["idx"]["rows"] if lp.idx_cmp is not None else new_st[lp.kv_source]["idx"]["keys"]
                scores = jax.vmap(lambda a, h, p: indexer.index_scores(
                    w, a, h, index_keys, p, freqs, cfg.index_n_heads, cfg.index_head_dim))(qr, h_W, pos_W)
                allowed = visible
                if lp.uses_candidates:
                    allowed = allowed & shared["candidates"]
                if lp.candidate_source:
                    shared["candidates"] = jax.vmap(lambda s, v: indexer.candidate_block_mask(
                        s, v, cfg.candidate_block_size, cfg.candidate_topk_blocks))(scores, visible)
                shared[("topk", lp.index)] = jax.vmap(lambda s, a: indexer.select_top_k(s, a, cfg.index_topk))(
                    scores, allowed)
            sel, sel_valid = shared[("topk", lp.index_source)]
            extra_kv, extra_valid, batched = src[sel], sel_valid, True

    def attend(q_HK, pos, ekv, evalid):
        return attention.attend(cfg, w, q_HK, ekv, evalid, pos, freqs, ring=st["ring"])

    in_axes = (0, 0, 0 if batched else None, 0 if extra_valid is not None else None)
    o = jax.vmap(attend, in_axes=in_axes)(q, pos_W, extra_kv, extra_valid)
    return jax.vmap(lambda o_HK: attention.output(cfg, w, o_HK))(o), small


def _first_rows(a_n, width: int):
    """The n rows of a_n followed by copies of its row 0 up to `width` rows: padding rows then use a live row's
    values (a row's own bits never depend on another row's)."""
    return jnp.concatenate([a_n, jnp.broadcast_to(a_n[:1], (width - a_n.shape[0], *a_n.shape[1:]))])


def _ffn_rows(plan: M.ModelPlan, lp: M.LayerPlan, w: dict, h_W, tokens_W, live: int | None = None):
    """(FFN output [W, D], routed expert ids [W, K], lean swaps [W]); tiered experts come as the union of the
    live rows' experts, each moved from its tier once (prefill.routed_stacks); padding rows compute with row 0's.
    The union is sized for the live rows only (static), so a width-W decode step (one live row) moves and
    returns K experts' rows per layer, as the one-token step does, not W*K."""
    cfg = plan.cfg
    limit = cfg.swiglu_limit[lp.index]
    r = jax.vmap(lambda h, t: M.route_layer(plan, lp, w, h, t))(h_W, tokens_W)
    if "routed" in w:
        n = h_W.shape[0] if live is None else live
        stacks, idx_LK = PF.routed_stacks(w["routed"], r.idx_K[:n])
        idx_WK = _first_rows(idx_LK, h_W.shape[0])
    else:
        stacks, idx_WK = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"]), r.idx_K
    y = jax.vmap(lambda h, i, wt: routed_experts(h, *stacks, i, wt, limit))(h_W, idx_WK, r.weight_K)
    if cfg.n_shared_experts:
        y = y + jax.vmap(lambda h: shared_expert(h, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"],
                                                 cfg.swiglu_limit_shexp[lp.index]))(h_W)
    return y, r.idx_K, r.swaps


def step_rows(plan: M.ModelPlan, params: dict, state: dict, tokens_W: jax.Array, engram_rows_W=None,
              trace_routing: bool = False, feature_layers: tuple[int, ...] = (), live: int | None = None):
    """W positions from state["pos"] on: (logits [W, V], state after all W, small leaves per layer and row[,
    routing {"experts" [W, L, K], "swaps" [W, L], "predicted_next" [W, L, K]}][, features [W, n, D]]).
    `live` (static; None = all W) is the number of leading rows whose outputs the caller keeps: the others are
    padding and move no expert of their own (their routing entries are then meaningless)."""
    cfg = plan.cfg
    W = tokens_W.shape[0]
    pos_W = state["pos"] + jnp.arange(W, dtype=jnp.int32)
    x = jax.vmap(lambda t: jnp.broadcast_to(M.embed(params["token_embd"], t), (cfg.hc_mult, cfg.dim)))(tokens_W)
    new_layers: list = list(state["layers"])
    shared: dict = {}
    pre_prev = jnp.broadcast_to(hc_onehot_pre(cfg.hc_mult), (W, cfg.hc_mult))
    small, routing, swaps, predicted, features = [], [], [], [], {}
    for lp in plan.layers:
        w = params["blocks"][lp.index]
        if lp.engram_slot >= 0:
            rows_W = engram_rows_W[:, lp.engram_slot]
            x = jax.vmap(lambda x_HD, rows, w=w: engram_combine(x_HD, rows, w["engram_wkv"], w["engram_q"],
                                                               w["engram_k"], cfg.rms_eps))(x, rows_W)
        if lp.index in feature_layers:
            features[lp.index] = jnp.mean(x, axis=1)
        for branch in ("attn", "ffn"):
            h, pre, post, comb = jax.vmap(lambda x_HD, p, b=branch, w=w: M.sublayer_input(cfg, w, b, x_HD, p))(
                x, pre_prev)
            if branch == "attn":
                out, sm = _attention_rows(plan, lp, w, new_layers, h, pos_W, shared)
                small.append(sm)
            else:
                guess = jax.vmap(lambda h_D, lp=lp: PF._guess_next(plan, lp, params, h_D))(h)
                nxt = lp.index + 1
                if plan.lookahead and nxt < cfg.n_layers and "routed" in params["blocks"][nxt]:
                    prefetch_experts(params["blocks"][nxt]["routed"], guess[:live].reshape(-1))
                predicted.append(guess)
                out, idx, n_swaps = _ffn_rows(plan, lp, w, h, tokens_W, live)
                routing.append(idx)
                swaps.append(n_swaps)
            x = jax.vmap(hc_expand)(x, out, post, comb)
            pre_prev = pre

    logits = jax.vmap(lambda x_HD, p: M.output_head(cfg, params, x_HD, p))(x, pre_prev)
    out = (logits, {"pos": state["pos"] + W, "layers": new_layers}, small)
    if trace_routing:
        out += ({"experts": jnp.stack(routing, axis=1), "swaps": jnp.stack(swaps, axis=1),
                 "predicted_next": jnp.stack(predicted, axis=1)},)
    if feature_layers:
        out += (jnp.stack([features[i] for i in feature_layers], axis=1),)
    return out


def step_at_width(plan: M.ModelPlan, params: dict, state: dict, token: jax.Array, engram_rows=None,
                  trace_routing: bool = False, feature_layers: tuple[int, ...] = (), width: int | None = None):
    """`model.step`'s contract at the plan's decode width (or `width`): 1 is `model.step` itself; W > 1 runs the
    W-row pass with the token in row 0 and padding after it, and rolls the state back to one position. Row 0 is
    bit-identical to row 0 of a verify block of the same width (tests/test_block_step.py)."""
    from jds41.speculative import _undo, rollback

    W = plan.decode_width if width is None else width
    if W == 1:
        return M.step(plan, params, state, token, engram_rows, trace_routing, feature_layers)
    tokens = jnp.zeros((W,), jnp.int32).at[0].set(token)
    rows = None
    if engram_rows is not None:
        rows = jnp.zeros((W, *engram_rows.shape), engram_rows.dtype).at[0].set(engram_rows)
    undo = _undo(plan, state, state["pos"] + jnp.arange(W, dtype=jnp.int32))
    logits, st, small, *extra = step_rows(plan, params, state, tokens, rows, trace_routing, feature_layers, 1)
    st = rollback(plan, st, undo, small, jnp.int32(1))
    return (logits[0], st, *(jax.tree.map(lambda a: a[0], e) for e in extra))


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7), donate_argnums=2)
def decode_rows(plan: M.ModelPlan, params: dict, state: dict, token: jax.Array, engram_rows=None,
                trace_routing: bool = False, feature_layers: tuple[int, ...] = (), width: int | None = None):
    """`model.decode_step` at the plan's decode width (or `width`): (logits [V], state[, routing][, features])."""
    return step_at_width(plan, params, state, token, engram_rows, trace_routing, feature_layers, width)


def decode_step_for(plan: M.ModelPlan):
    """The jitted one-position decode of this plan: `model.decode_step` at width 1, else `decode_rows`."""
    return M.decode_step if plan.decode_width == 1 else decode_rows


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=2)
def prefill_rows(plan: M.ModelPlan, params: dict, state: dict, tokens_NW: jax.Array, engram_rows_NW=None,
                 trace_routing: bool = False, feature_layers: tuple[int, ...] = ()):
    """A prompt piece at the decode width: N consecutive blocks of W real rows [N, W], one `step_rows` each
    (a scan over the blocks): (logits [N*W, V], state[, routing][, features], each with a leading N*W axis).

    Every row is live and kept, so no rollback: this is a speculative verify that accepts every row, and by row
    uniformity each position's logits and state equal those of feeding the prompt one token at a time through
    `decode_rows` at width W (tests/test_block_step.py), at 1/W of the passes. With tiered experts each block moves
    the union of its W rows' experts once."""
    def body(st, xs):
        toks, rows = xs
        logits, st, _small, *extra = step_rows(plan, params, st, toks, rows, trace_routing, feature_layers)
        return st, (logits, *extra)

    state, ys = jax.lax.scan(body, state, (tokens_NW, engram_rows_NW))
    flat = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), ys)
    return (flat[0], state, *flat[1:])
