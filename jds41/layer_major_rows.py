"""The layer-major prefill at a row width: a prompt group of N blocks of W rows read layer by layer, so that with
tiered experts each layer's experts move once per group instead of once per W-row block.

`block_step.prefill_rows` reads a group block after block (a scan of `step_rows`): every block brings the union of
its own W rows' experts from the host and the SSD, which under lucebox costs more than the width-1 layer-major
group (jds41/prefill.py) saves. This pass reorders the same per-row arithmetic the way prefill.layer_major reorders
the one-token step: for layer l, a scan over the N blocks runs the attention sublayer of `step_rows` for W rows at a
time (`block_step._attention_rows`, carrying layer l's state), then routes every row, takes the union of the whole
group's experts, moves it once (prefill.union_stack), and a second scan over the blocks runs `step_rows`' FFN rows
from that union stack. Values that cross layers per row go from one layer pass to the next with a leading [N, W]:
the residual stream, the V4.1 `pre` lag, the index source's top-k and the candidate blocks.

Bit-identical to `prefill_rows` (and so to decoding the prompt one token at a time at width W) for the reasons
prefill.layer_major is bit-identical to the token-major scan: every row goes through the same batched functions
over W rows; a layer whose kv source is an earlier layer reads that source's compressed rows after the whole group,
where rows of later positions are masked by position; and a row's experts are gathered by position from a larger
union stack holding the same raw bytes (tests/test_block_step.py checks logits, routing, features and state).

A group shorter than its program (`n_valid`, traced: the wide pass's tail, jds41/prompt_pieces.py WIDE_TAIL) runs
the same block bodies for its first n_valid blocks only (prefill.row_loop), so the layer state advances by those
rows alone; the blocks after them are replaced by block 0 in the routing the union and the look-ahead read, and
their (token, expert) pairs go to no grouped tile, so they move no expert and cost no expert product. Each read row
gets the bits it gets in a group of exactly its blocks (tests/test_wide_tail.py): every product it goes through is
row-local (rows of a `dot`, a union stack of the same bytes, a tile whatever its other pairs).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jds41 import model as M
from jds41 import prefill as PF
from jds41.block_step import _attention_rows
from jds41.layers.engram import engram_combine
from jds41.layers.grouped_experts import grouped_routed_experts
from jds41.layers.mhc import hc_expand, hc_onehot_pre
from jds41.layers.moe import routed_experts, shared_expert
from jds41.layers.rowwise import island
from jds41.quant.qtensor import rows_as_dots
from jds41.tiers.experts import prefetch_experts


def _attention_blocks(plan: M.ModelPlan, lp: M.LayerPlan, params: dict, layers: list, xs: dict, shared_in: dict,
                      feature: bool, keep_small: bool = False, n_valid=None):
    """Layer lp over the N blocks in order (the first n_valid of them when given, a traced count: the layer state
    advances by those blocks' rows only, the outputs of the others are zero): Engram, the attention sublayer for W
    rows at a time, the FFN's input and routing. Returns (layer state after the group, per-block outputs
    [N, W, ...]; with `keep_small` also the compressor leaves after each row, "small", that a rollback takes)."""
    cfg = plan.cfg
    w = params["blocks"][lp.index]
    source_st = layers[lp.kv_source] if 0 <= lp.kv_source != lp.index else None

    def sublayer_input(x, pre_prev, branch):
        return jax.vmap(lambda x_HD, p_H: M.sublayer_input(cfg, w, branch, x_HD, p_H))(x, pre_prev)

    def body(st, b):
        x = b["x"]
        if lp.engram_slot >= 0:
            x = jax.vmap(lambda x_HD, rows: engram_combine(x_HD, rows, w["engram_wkv"], w["engram_q"], w["engram_k"],
                                                           cfg.rms_eps))(x, b["engram"])
        extra = {"feature": jnp.mean(x, axis=1)} if feature else {}
        new_st = [None] * cfg.n_layers
        new_st[lp.index] = st
        if source_st is not None:
            new_st[lp.kv_source] = source_st  # read only where visible: rows of later positions are masked
        shared = {PF._step_key(k): v for k, v in b["shared"].items()}
        h, pre, post, comb = sublayer_input(x, b["pre_prev"], "attn")
        out, small = _attention_rows(plan, lp, w, new_st, h, b["pos"], shared)
        if keep_small:
            extra["small"] = small
        x = jax.vmap(hc_expand)(x, out, post, comb)
        h_f, pre_f, post_f, comb_f = sublayer_input(x, pre, "ffn")
        r = jax.vmap(lambda h_D, t: M.route_layer(plan, lp, w, h_D, t))(h_f, b["token"])
        guess = jax.vmap(lambda h_D: PF._guess_next(plan, lp, params, h_D))(h_f)
        new_keys = {PF._tree_key(k): v for k, v in shared.items() if PF._tree_key(k) not in b["shared"]}
        return new_st[lp.index], {"x": x, "pre": pre_f, "post": post_f, "comb": comb_f, "h": h_f, "idx": r.idx_K,
                                  "weight": r.weight_K, "swaps": r.swaps, "guess": guess, "shared": new_keys, **extra}

    return PF.row_loop(body, layers[lp.index], {**xs, "shared": shared_in}, n_valid)


def _ffn_blocks(plan: M.ModelPlan, lp: M.LayerPlan, w: dict, a: dict, tile: int = 0, n_valid=None) -> jax.Array:
    """Routed + shared experts and the FFN's mHC expand, W rows at a time, from the group's union -> [N, W, H, D].
    `tile` 0: each row's experts by decode's per-row products; >= 2: the whole group's routed experts grouped by
    expert in tiles of that many rows (layers/grouped_experts.py, the wide prompt pass). `n_valid` (traced): only
    the first n_valid blocks were read; the others add no expert to the union, no pair to a tile, and are not
    computed (their rows stay zero)."""
    cfg = plan.cfg
    limit = cfg.swiglu_limit[lp.index]
    N, W, K = a["idx"].shape
    if "routed" in w:  # blocks never read are replaced by block 0 for the union: they bring no expert of their own
        stacks, idx = PF.routed_stacks(w["routed"], PF._valid_rows(a["idx"], n_valid).reshape(N * W, K))
        idx = idx.reshape(N, W, K)
    else:
        stacks, idx = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"]), a["idx"]
    routed = None
    if tile:
        D = a["h"].shape[-1]
        routed = grouped_routed_experts(a["h"].reshape(N * W, D), *stacks, idx.reshape(N * W, K),
                                        a["weight"].reshape(N * W, K), limit, tile,
                                        None if n_valid is None else n_valid * W).reshape(N, W, D)

    def body(_, b):
        if tile:
            y = b["routed"]
        else:
            y = jax.vmap(lambda h, i, wt: routed_experts(h, *stacks, i, wt, limit))(b["h"], b["idx"], b["weight"])
        if cfg.n_shared_experts:
            y = y + jax.vmap(lambda h: shared_expert(h, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"],
                                                     cfg.swiglu_limit_shexp[lp.index]))(b["h"])
        return None, jax.vmap(hc_expand)(b["x"], y, b["post"], b["comb"])

    blocks = {"h": a["h"], "idx": idx, "weight": a["weight"], "x": a["x"], "post": a["post"], "comb": a["comb"]}
    if tile:
        blocks["routed"] = routed
    return PF.row_loop(body, None, blocks, n_valid)[1]


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8), donate_argnums=2)
def prefill_layer_major_rows(plan: M.ModelPlan, params: dict, state: dict, tokens_NW: jax.Array,
                             engram_rows_NW=None, trace_routing: bool = False,
                             feature_layers: tuple[int, ...] = (), tile: int = 0, last_logits: bool = False,
                             n_valid=None):
    """`block_step.prefill_rows`' contract, layer-major: (logits [N*W, V], state[, routing][, features]). `tile` >= 2
    is the wide prompt pass: routed experts grouped by expert, every other product a row-batched `dot` (its own
    bits, the same for any cut). `last_logits`: logits [1, V] of the last row only, from a head run on the last
    block alone (the same kernels as every block's head, so the same bits as the last row of all the logits).
    `n_valid` (traced): only the first n_valid blocks are read (a group shorter than the program: the wide pass's
    tail, jds41/prompt_pieces.py WIDE_TAIL); the per-row outputs of the other blocks are zero, `last_logits` is
    the last read row's, and the state advances by n_valid * W positions."""
    logits, state, _small, *extra = _layer_major_rows(plan, params, state, tokens_NW, engram_rows_NW, trace_routing,
                                                      feature_layers, tile, False, last_logits, n_valid)
    return (logits, state, *extra)


@functools.partial(jax.jit, static_argnums=(0, 6, 7), donate_argnums=2)
def prefill_wide_rest(plan: M.ModelPlan, params: dict, state: dict, tokens_W: jax.Array, engram_rows_W,
                      n_valid: jax.Array, trace_routing: bool = False, feature_layers: tuple[int, ...] = ()):
    """The last n_valid (< R) tokens of a prompt read by the wide pass: one R-row block (the tokens, then padding)
    whose state is rolled back to n_valid positions, as a speculative verify keeps its accepted rows
    (speculative.rollback). Rows never depend on later rows, so the live rows get the bits they would get in any
    other block. -> (logits [R, V], state[, routing][, features]); rows from n_valid on are padding."""
    from jds41.speculative import _undo, rollback  # speculative imports this module's callers

    R = tokens_W.shape[0]
    undo = _undo(plan, state, state["pos"] + jnp.arange(R, dtype=jnp.int32))
    logits, state, small, *extra = _layer_major_rows(plan, params, state, tokens_W[None],
                                                     None if engram_rows_W is None else engram_rows_W[None],
                                                     trace_routing, feature_layers, plan.prompt_width, True)
    return (logits, rollback(plan, state, undo, small, n_valid), *extra)


def _layer_major_rows(plan: M.ModelPlan, params: dict, state: dict, tokens_NW: jax.Array, engram_rows_NW,
                      trace_routing: bool, feature_layers: tuple[int, ...], tile: int, keep_small: bool,
                      last_logits: bool = False, n_valid=None):
    """(logits [N*W, V] or [1, V], state, small (per layer, leaves [W, ...] of the last block; None without
    keep_small)[, routing][, features]). A tile (the wide pass) traces every one-token product as a `dot`."""
    if keep_small and n_valid is not None:
        raise ValueError("_layer_major_rows: the last block's small leaves are kept only for a full group")
    with rows_as_dots() if tile else contextlib.nullcontext():
        return _layers_and_head(plan, params, state, tokens_NW, engram_rows_NW, trace_routing, feature_layers, tile,
                                keep_small, last_logits, n_valid)


def _layers_and_head(plan: M.ModelPlan, params: dict, state: dict, tokens_NW: jax.Array, engram_rows_NW,
                     trace_routing: bool, feature_layers: tuple[int, ...], tile: int, keep_small: bool,
                     last_logits: bool, n_valid=None):
    cfg = plan.cfg
    N, W = tokens_NW.shape
    pos = state["pos"] + jnp.arange(N * W, dtype=jnp.int32).reshape(N, W)
    x = jax.lax.map(jax.vmap(lambda t: jnp.broadcast_to(M.embed(params["token_embd"], t), (cfg.hc_mult, cfg.dim))),
                    tokens_NW)
    pre_prev = jnp.broadcast_to(hc_onehot_pre(cfg.hc_mult), (N, W, cfg.hc_mult))
    layers = list(state["layers"])
    produced: dict = {}
    trace = {"experts": [], "swaps": [], "predicted_next": []}
    features, small = {}, []
    blocks = list(params["blocks"])
    for lp in plan.layers:
        PF.hold_host_moves(blocks, lp, x)
        w = blocks[lp.index]
        xs = {"x": x, "pre_prev": pre_prev, "pos": pos, "token": tokens_NW}
        if lp.engram_slot >= 0:
            xs["engram"] = engram_rows_NW[:, :, lp.engram_slot]
        layers[lp.index], a = _attention_blocks(plan, lp, params, layers, xs, PF._shared_inputs(lp, produced),
                                                lp.index in feature_layers, keep_small, n_valid)
        produced.update(a["shared"])
        if keep_small:
            small.append(jax.tree.map(lambda v: v[-1], a["small"]))
        if lp.index in feature_layers:
            features[lp.index] = a["feature"]
        nxt = lp.index + 1
        if plan.lookahead and nxt < cfg.n_layers and "routed" in params["blocks"][nxt]:
            # guesses of blocks never read are block 0's: they start no read of their own
            prefetch_experts(params["blocks"][nxt]["routed"], PF._valid_rows(a["guess"], n_valid).reshape(-1))
        x, pre_prev = _ffn_blocks(plan, lp, w, a, tile, n_valid), a["pre"]
        for k, v in (("experts", a["idx"]), ("swaps", a["swaps"]), ("predicted_next", a["guess"])):
            trace[k].append(v)

    def head_block(b):
        return jax.vmap(lambda x_HD, p: M.output_head(cfg, params, x_HD, p))(*b)

    def wide_head(b):  # islands in every spelling: one block alone compiles to the kernels of any block
        return island(head_block(island(b)))

    if not tile and n_valid is None:  # the decode width's bits: those of block_step.prefill_rows
        logits = jax.lax.map(head_block, (x, pre_prev))
    elif not tile:
        logits = PF.row_loop(lambda _, b: (None, head_block(b)), None, (x, pre_prev), n_valid)[1]
    elif last_logits and n_valid is None:
        logits = jax.lax.map(wide_head, (x[-1:], pre_prev[-1:]))[0, -1:]
    elif last_logits:  # the last READ block: a dynamic index, then the same one-block map
        last = jax.tree.map(lambda v: jax.lax.dynamic_slice_in_dim(v, n_valid - 1, 1), (x, pre_prev))
        logits = jax.lax.map(wide_head, last)[0, -1:]
    elif n_valid is None:
        logits = jax.lax.map(wide_head, (x, pre_prev))
    else:  # blocks never read stay zero
        logits = PF.row_loop(lambda _, b: (None, wide_head(b)), None, (x, pre_prev), n_valid)[1]
    read = N * W if n_valid is None else n_valid * W
    out = (logits.reshape(-1, logits.shape[-1]), {"pos": state["pos"] + read, "layers": layers},
           small if keep_small else None)
    flat = functools.partial(jax.tree.map, lambda a: a.reshape((N * W, *a.shape[2:])))
    if trace_routing:
        out += (flat({k: jnp.stack(v, axis=2) for k, v in trace.items()}),)
    if feature_layers:
        out += (flat(jnp.stack([features[i] for i in feature_layers], axis=2)),)
    return out
