"""Layer-major chunked prefill: a group of prompt tokens runs layer by layer, so each layer's experts move once.

`model.prefill` scans the per-token `step` over a chunk (token-major: every layer for token t, then token t+1).
With experts on the SSD or in pinned host memory that moves the selected experts' rows once per token per layer.
`prefill_layer_major` reorders the same arithmetic: for layer l it runs the attention sublayer over all T tokens
of the group in order (a lax.scan carrying layer l's decode state: attention is sequential by nature), then
routes all T tokens, takes the UNION of their experts, brings each needed expert's rows from its tier once for the
whole group (one gather from the tier-0 stack, one transfer from the pinned-host stack, one host call for the SSD
experts), and computes each token's expert outputs from that union stack. Values that cross layers per token
become [T, ...] arrays handed from one layer pass to the next: the residual stream, the V4.1 `pre` lag, the index
source's top-k and the candidate blocks.

Bit-identical to `model.prefill` by construction, not by tolerance: every per-token value goes through the same
functions `step` uses (`model._attention_block`, `sublayer_input`, `route`, `routed_experts`, `shared_expert`,
the mHC collapse/expand), each run once per token inside a scan whose body sees the decode shapes; those layer
functions are fusion islands (layers/rowwise.py), so their rounding does not depend on the program around them.
Two things differ and neither changes a value:
- a layer whose kv source is an EARLIER layer reads that source's compressed rows after the whole group, not after
  token t. Rows are written once, when their block completes, and a query only sees rows with j < (p+1) // ratio
  (compressor.visible_mask; the indexer top-k masks the same way), so rows from later tokens are masked out: a
  masked key has weight exactly 0 in the softmax and adds exactly 0 to the output sums.
- a token's experts are gathered from the union stack by their position in it instead of from a [K] stack by
  0..K-1: the same raw bytes reach the same per-expert arithmetic.
tests/test_prefill_layer_major.py checks logits and state bit for bit against `model.prefill` for both
architectures, with and without a tier profile.

`layer_major` is the un-jitted pass (usable inside another jit); `prefill_layer_major` is its jitted, donating
prefill wrapper. Besides the logits and state the pass returns, only when asked (static options, so prefill pays
nothing for them), the step's per-token extras: the routing trace, the DSpark target features, and a projection
of each layer's state after each token. The speculative verify (speculative.verify_block, layer_major=True) asks
for all three, so a verify block of k+1 tokens moves each needed host / SSD expert once instead of once per token.

Look-ahead (plan.lookahead): the step's per-token guess of layer l+1's experts is kept (it is part of the routing
trace); instead of one prefetch call per token per layer, layer l makes ONE prefetch call with the guesses of all
T tokens for layer l+1, before its own SSD fetch, so those reads overlap layer l's work.

Static plan: the chunk length is static (shapes), the layer loop is unrolled in Python at trace time, and the
function is jitted, so nothing is dispatched per layer at run time. The engine runs full chunks of
`prefill_chunk` tokens and the rest in power-of-two pieces down to `LAYER_MAJOR_MIN` (`plan_pieces`), so at most
1 + log2(chunk / LAYER_MAJOR_MIN) programs compile; a remainder below that goes through the token-major path.
With tiered experts the rest is one group instead, read by the chunk's program with a traced `n_valid`: its row
loops run n_valid trips (`row_loop`), so one more program serves every length (jds41/prompt_pieces.py says why).
`last_logits` runs the output head for the last token only, which is all a prompt feed returns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds41 import model as M
from jds41.layers.engram import engram_combine
from jds41.layers.mhc import hc_expand, hc_onehot_pre
from jds41.layers.moe import routed_experts, shared_expert
from jds41.layers.router import route
from jds41.layers.rowwise import island, map_rows
from jds41.quant import QTensor
from jds41.tiers.experts import (
    HOST_STACK_AHEAD,
    STACKS,
    TieredLayer,
    host_rows,
    host_selected_rows,
    prefetch_experts,
    ssd_rows,
    tie_host_stacks,
    whole_host_stack,
)

LAYER_MAJOR_MIN = 64  # the smallest layer-major piece; shorter remainders run token-major (model.prefill/step)


def row_loop(body, carry, xs: dict, n_valid=None):
    """`lax.scan(body, carry, xs)`; with `n_valid` (a traced count) the same body over only the first n_valid rows
    of xs (a while loop of n_valid trips), outputs of the rows after them left zero. The body is the one the scan
    runs, so a row's values do not depend on which of the two ran it."""
    if n_valid is None:
        return jax.lax.scan(body, carry, xs)
    T = jax.tree.leaves(xs)[0].shape[0]
    row = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
    shapes = jax.eval_shape(lambda c, x: body(c, x)[1], carry, jax.tree.map(lambda a: row(a, 0), xs))
    outs = jax.tree.map(lambda s: jnp.zeros((T, *s.shape), s.dtype), shapes)

    def trip(i, c_outs):
        c, y = body(c_outs[0], jax.tree.map(lambda a: row(a, i), xs))
        return c, jax.tree.map(lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), c_outs[1], y)

    return jax.lax.fori_loop(0, n_valid, trip, (carry, outs))


def plan_pieces(n_tokens: int, chunk: int, min_piece: int | None = None) -> tuple[list[int], int]:
    """(layer-major piece lengths, token-major remainder) for `n_tokens`: full chunks, then the binary
    decomposition of the rest into powers of two >= min(min_piece, chunk) (default LAYER_MAJOR_MIN, read at call
    time). chunk <= 0: all token-major."""
    if chunk <= 0:
        return [], n_tokens
    pieces = [chunk] * (n_tokens // chunk)
    rest = n_tokens % chunk
    floor = min(LAYER_MAJOR_MIN if min_piece is None else min_piece, chunk)
    b = 1 << max(chunk - 1, 0).bit_length() - 1 if chunk > 1 else 1  # largest power of two below chunk
    while b >= floor and rest:
        if rest >= b:
            pieces.append(b)
            rest -= b
        b //= 2
    return pieces, rest


# ---- the union of a group's experts, brought from their tiers once ---------------------------------------------

def union_stack(tl: TieredLayer, union_U: jax.Array, valid_U: jax.Array) -> dict[str, QTensor]:
    """Raw rows of the union's experts, [U, out, in] per stack, each from the tier that owns it: one gather from
    the tier-0 stack, one move from the pinned-host stack, one host call for the SSD experts (made only when the
    union has one). When the union could cover every host expert, the host stack moves whole: in one transfer
    where the placement allowed it (`tl.host_whole`: an async copy that overlaps compute, started when XLA
    schedules it), else one device_put per expert tied to this layer's routing; otherwise only the union entries
    the host owns move (tiers/experts.host_selected_rows)."""
    U = union_U.shape[0]
    tier_U = jnp.where(valid_U, tl.tier_E[union_U], -1)
    local_U = tl.local_E[union_U]
    on_ssd = tier_U == 2
    ssd = None
    if tl.source is not None:
        ssd = ssd_rows(tl, union_U, on_ssd, union=True)
    if tl.has_host:
        host_local = jnp.where(tier_U == 1, local_U, 0)
        n_host = tl.host[STACKS[0]].data.shape[0]
        if U >= n_host and tl.host_whole:  # the union may need every host expert: move the stack in one transfer
            host = tuple(jnp.take(whole_host_stack(tl.host[n]), host_local, axis=0) for n in STACKS)
        elif U >= n_host:  # the same, expert by expert
            # The barrier ties the move to this layer's routing: without it XLA may start every layer's
            # transfer at once (they depend on no data), holding all layers' host stacks on the device.
            every, _ = island((jnp.arange(n_host, dtype=jnp.int32), union_U))
            host = tuple(jnp.take(host_rows(tl.host[n], every), host_local, axis=0) for n in STACKS)
        else:  # only the entries the host owns: a verify or decode-width union is mostly padding and HBM rows
            host = host_selected_rows(tl, host_local, tier_U == 1)
    stacks = {}
    for i, n in enumerate(STACKS):
        rows = jnp.take(tl.hbm[n].data, jnp.where(tier_U == 0, local_U, 0), axis=0)
        if tl.has_host:
            rows = jnp.where((tier_U == 1)[:, None, None], host[i], rows)
        if ssd is not None:
            rows = jnp.where(on_ssd[:, None, None], ssd[i], rows)
        ref = tl.hbm[n]
        stacks[n] = ref.with_rows(rows, (U, *ref.shape[1:]))
    return stacks


def hold_host_moves(blocks: list, lp: M.LayerPlan, anchor) -> None:
    """With HOST_STACK_AHEAD = N (tiers/experts.py), tie layer lp + N's whole-stack host moves to `anchor` (layer
    lp's input), in place in `blocks`: they start once layer lp has, not whenever XLA would (which was at once)."""
    if HOST_STACK_AHEAD is None:
        return
    later = lp.index + HOST_STACK_AHEAD
    tl = blocks[later].get("routed") if later < len(blocks) else None
    if tl is not None and tl.has_host and tl.host_whole:
        blocks[later] = {**blocks[later], "routed": tie_host_stacks(tl, anchor)}


def routed_stacks(tl: TieredLayer, idx_TK: jax.Array) -> tuple[tuple[QTensor, ...], jax.Array]:
    """((gate, up, down) stacks, index of each selection in them [T, K]) for a group's selections idx_TK.
    A layer whose experts all sit in HBM (no host stack, nothing on the SSD; static) indexes its tier-0 stack
    directly: the union's sort, search and gather-copy would move no byte and only add launches (all-hbm width-5
    decode ran at 159 tok/s against 236 resident on the H200 with them). Other layers go through the union."""
    if tl.source is None and not tl.has_host:
        return tuple(tl.hbm[n] for n in STACKS), tl.local_E[idx_TK]
    union, valid, pos_TK = expert_union(idx_TK, tl.tier_E.shape[0])
    g = union_stack(tl, union, valid)
    return tuple(g[n] for n in STACKS), pos_TK


def expert_union(idx_TK: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(union [U] sorted expert ids clamped to a valid id, valid [U], position of each selection in it [T, K]);
    U = min(T*K, E) is the static bound, unused entries are padding (valid False)."""
    U = min(idx_TK.size, n_experts)
    union = jnp.unique(idx_TK.reshape(-1), size=U, fill_value=n_experts)  # padding sorts after every real id
    pos_TK = jnp.searchsorted(union, idx_TK).astype(jnp.int32)
    return jnp.minimum(union, n_experts - 1), union < n_experts, pos_TK


# ---- one layer over the group -------------------------------------------------------------------------------------

def _guess_next(plan: M.ModelPlan, lp: M.LayerPlan, params: dict, h_D) -> jax.Array:
    """model._predict_next without its per-token prefetch call (made once per layer here)."""
    k, nxt = plan.cfg.n_experts_used, lp.index + 1
    if not plan.lookahead or nxt >= plan.cfg.n_layers or plan.layers[nxt].hash_layer:
        return jnp.full((k,), -1, jnp.int32)
    w_next = params["blocks"][nxt]
    return route(h_D, w_next["ffn_gate_inp"], w_next["exp_probs_b"], plan.cfg).idx_K


def _route(plan: M.ModelPlan, lp: M.LayerPlan, w: dict, h_D, token):
    """model.route_layer, unchanged: (idx [K], weight [K], swaps)."""
    r = M.route_layer(plan, lp, w, h_D, token)
    return r.idx_K, r.weight_K, r.swaps


def _attention_pass(plan: M.ModelPlan, lp: M.LayerPlan, params: dict, layers: list, xs: dict, shared_in: dict,
                    feature: bool = False, state_out=None, n_valid=None):
    """Layer lp over the T tokens in order (the first n_valid of them when given): Engram, attention sublayer, and
    the FFN's input and routing. Returns (layer state after the group, per-token outputs [T, ...]). `feature`:
    also the block input after Engram averaged over the hc copies ("feature", model.step's target feature);
    `state_out`: also state_out(layer state after each token) ("state")."""
    cfg = plan.cfg
    w = params["blocks"][lp.index]
    source_st = layers[lp.kv_source] if 0 <= lp.kv_source != lp.index else None

    def body(st, x_in):
        x, pre_prev, pos, token = x_in["x"], x_in["pre_prev"], x_in["pos"], x_in["token"]
        if lp.engram_slot >= 0:
            x = engram_combine(x, x_in["engram"], w["engram_wkv"], w["engram_q"], w["engram_k"], cfg.rms_eps)
        extra = {"feature": jnp.mean(x, axis=0)} if feature else {}
        st_all = [None] * cfg.n_layers
        st_all[lp.index] = st
        new_st = list(st_all)
        if source_st is not None:
            new_st[lp.kv_source] = source_st  # read only where visible: rows of later tokens are masked
        shared = {_step_key(k): v for k, v in x_in["shared"].items()}
        h, pre, post, comb = M.sublayer_input(cfg, w, "attn", x, pre_prev)
        x = hc_expand(x, M._attention_block(plan, lp, w, st_all, new_st, h, pos, shared), post, comb)
        h_f, pre_f, post_f, comb_f = M.sublayer_input(cfg, w, "ffn", x, pre)
        idx, weight, swaps = _route(plan, lp, w, h_f, token)
        out = {"x": x, "pre": pre_f, "post": post_f, "comb": comb_f, "h": h_f, "idx": idx, "weight": weight,
               "swaps": swaps, "guess": _guess_next(plan, lp, params, h_f),
               "shared": {_tree_key(k): v for k, v in shared.items() if _tree_key(k) not in x_in["shared"]}, **extra}
        if state_out is not None:
            out["state"] = state_out(new_st[lp.index])
        return new_st[lp.index], out

    xs = {**xs, "shared": shared_in}
    return row_loop(body, layers[lp.index], xs, n_valid)


def _ffn_pass(plan: M.ModelPlan, lp: M.LayerPlan, w: dict, a: dict, n_valid=None) -> jax.Array:
    """Routed + shared experts and the FFN's mHC expand for the T tokens (the first n_valid) -> stream [T, H, D]."""
    cfg = plan.cfg
    limit = cfg.swiglu_limit[lp.index]
    if "routed" in w:
        stacks, idx_TK = routed_stacks(w["routed"], _valid_rows(a["idx"], n_valid))
    else:
        stacks, idx_TK = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"]), a["idx"]

    def body(_, r):
        y = routed_experts(r["h"], *stacks, r["idx"], r["weight"], limit)
        if cfg.n_shared_experts:
            y = y + shared_expert(r["h"], w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"],
                                  cfg.swiglu_limit_shexp[lp.index])
        return None, hc_expand(r["x"], y, r["post"], r["comb"])

    rows = {"h": a["h"], "idx": idx_TK, "weight": a["weight"], "x": a["x"], "post": a["post"], "comb": a["comb"]}
    return row_loop(body, None, rows, n_valid)[1]


def _valid_rows(a_T, n_valid):
    """a_T with the rows from n_valid on replaced by row 0: rows that were never computed add no expert to a union
    and no guess to a prefetch. Unchanged when n_valid is None."""
    if n_valid is None:
        return a_T
    keep = (jnp.arange(a_T.shape[0]) < n_valid).reshape(-1, *([1] * (a_T.ndim - 1)))
    return jnp.where(keep, a_T, a_T[0])


def _tree_key(step_key) -> str:
    """model._attention_block's `shared` keys ("candidates", ("topk", layer)) as pytree dict keys (all str)."""
    return step_key if isinstance(step_key, str) else f"topk{step_key[1]}"


def _step_key(tree_key: str):
    return ("topk", int(tree_key[4:])) if tree_key.startswith("topk") else tree_key


def _shared_inputs(lp: M.LayerPlan, produced: dict) -> dict:
    """The per-token values this layer's attention reads from earlier layers ([T, ...] each)."""
    out = {}
    if lp.ratio and lp.index_source >= 0 and lp.index_source != lp.index:
        out[f"topk{lp.index_source}"] = produced[f"topk{lp.index_source}"]
    if lp.uses_candidates:
        out["candidates"] = produced["candidates"]
    return out


def layer_major(plan: M.ModelPlan, params: dict, state: dict, tokens: jax.Array, engram_rows=None,
                trace_routing: bool = False, feature_layers: tuple[int, ...] = (), state_out=None,
                n_valid=None, last_logits: bool = False):
    """The layer-major pass, un-jitted (callable inside another jit, as model.step is): (logits [T, V], state,
    extras). `extras` holds only what was asked for, each with a leading T axis: "routing" (trace_routing: the
    step's routing trace), "features" (float32 [T, len(feature_layers), D], the step's target features) and
    "states" (`state_out` given: a list over layers of state_out(that layer's state after each token), e.g. the
    speculative verify's per-position compressor leaves). Nothing is computed for an extra not asked for.

    `n_valid` (traced): only the first n_valid tokens are read (a group shorter than its program: one program
    serves every length up to T); the other rows of every output are zero and the state advances by n_valid.
    `last_logits` (static): logits [1, V] of the last read token only; the output head reads the whole [V, D]
    matrix per token, which for a 4,096-token group is the cost of 4,096 head products nobody reads."""
    cfg = plan.cfg
    T = tokens.shape[0]
    if state_out is not None and n_valid is not None:
        raise ValueError("layer_major: per-token states are kept only for a full group (n_valid None)")
    pos_T = state["pos"] + jnp.arange(T, dtype=jnp.int32)
    x = jax.lax.map(lambda t: jnp.broadcast_to(M.embed(params["token_embd"], t), (cfg.hc_mult, cfg.dim)), tokens)
    pre_prev = jnp.broadcast_to(hc_onehot_pre(cfg.hc_mult), (T, cfg.hc_mult))
    layers = list(state["layers"])
    produced: dict = {}  # per-token values that later layers read (index top-k, candidate blocks)
    trace = {"experts": [], "swaps": [], "predicted_next": []}
    features, states = {}, []
    blocks = list(params["blocks"])
    for lp in plan.layers:
        hold_host_moves(blocks, lp, x)
        w = blocks[lp.index]
        xs = {"x": x, "pre_prev": pre_prev, "pos": pos_T, "token": tokens}
        if lp.engram_slot >= 0:
            xs["engram"] = engram_rows[:, lp.engram_slot]
        layers[lp.index], a = _attention_pass(plan, lp, params, layers, xs, _shared_inputs(lp, produced),
                                              lp.index in feature_layers, state_out, n_valid)
        produced.update(a["shared"])
        if lp.index in feature_layers:
            features[lp.index] = a["feature"]
        if state_out is not None:
            states.append(a["state"])
        nxt = lp.index + 1
        if plan.lookahead and nxt < cfg.n_layers and "routed" in params["blocks"][nxt]:
            prefetch_experts(params["blocks"][nxt]["routed"], _valid_rows(a["guess"], n_valid).reshape(-1))
        x, pre_prev = _ffn_pass(plan, lp, w, a, n_valid), a["pre"]
        trace["experts"].append(a["idx"])
        trace["swaps"].append(a["swaps"])
        trace["predicted_next"].append(a["guess"])

    logits = head_rows(cfg, params, x, pre_prev, n_valid, last_logits)
    extras = {}
    if trace_routing:
        extras["routing"] = {k: jnp.stack(v, axis=1) for k, v in trace.items()}
    if feature_layers:
        extras["features"] = jnp.stack([features[i] for i in feature_layers], axis=1)
    if state_out is not None:
        extras["states"] = states
    return logits, {"pos": state["pos"] + (T if n_valid is None else n_valid), "layers": layers}, extras


def head_rows(cfg, params: dict, x_THD, pre_TH, n_valid=None, last_logits: bool = False) -> jax.Array:
    """The output head of each row of a group's final stream: logits [T, V], rows from n_valid on zero; or, with
    `last_logits`, of the last read row only, [1, V]. Rows run one at a time in a loop whose body sees one
    position, as in decode (a single row too: rowwise.map_rows)."""
    head = lambda _, r: (None, M.output_head(cfg, params, r["x"], r["pre"]))  # noqa: E731
    if last_logits:
        n = x_THD.shape[0] if n_valid is None else n_valid
        last = {k: jax.lax.dynamic_slice_in_dim(v, n - 1, 1) for k, v in (("x", x_THD), ("pre", pre_TH))}
        return map_rows(lambda r: head(None, r)[1], last)
    return row_loop(head, None, {"x": x_THD, "pre": pre_TH}, n_valid)[1]


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7), donate_argnums=2)
def prefill_layer_major(plan: M.ModelPlan, params: dict, state: dict, tokens: jax.Array, engram_rows=None,
                        trace_routing: bool = False, feature_layers: tuple[int, ...] = (), last_logits: bool = False,
                        n_valid=None):
    """Same contract as `model.prefill`: (logits [T, V], state[, routing][, features], each of the per-token
    outputs with a leading T axis), bit-identical; `last_logits` and `n_valid` as in `layer_major`."""
    logits, state, extras = layer_major(plan, params, state, tokens, engram_rows, trace_routing, feature_layers,
                                        n_valid=n_valid, last_logits=last_logits)
    return (logits, state, *(extras[k] for k in ("routing", "features") if k in extras))


def moved_bytes(tiers, experts_TLK: np.ndarray) -> dict:
    """Expert bytes one layer-major group of these selections moves into the device, per tier, next to what the
    token-major scan moves for the same tokens (host: K rows per token per layer where the layer has a host
    expert; SSD: the distinct SSD experts of each token). From the routing trace, on the host."""
    sel = np.asarray(experts_TLK)
    T = sel.shape[0]
    out = {"host": 0, "ssd": 0, "host_token_major": 0, "ssd_token_major": 0}
    for layer in range(sel.shape[1]):
        tier_E = tiers.tier_LE[layer]
        nbytes = int(tiers.expert_bytes[layer])
        union = np.unique(sel[:, layer])
        n_host_stack = int((tier_E == 1).sum())
        if n_host_stack:
            U = min(sel[:, layer].size, tier_E.shape[0])
            out["host"] += (max(n_host_stack, 2) if U >= max(n_host_stack, 2) else U) * nbytes
            out["host_token_major"] += sel[:, layer].size * nbytes
        out["ssd"] += int((tier_E[union] == 2).sum()) * nbytes
        out["ssd_token_major"] += sum(int((tier_E[np.unique(sel[t, layer])] == 2).sum()) for t in range(T)) * nbytes
    return out
