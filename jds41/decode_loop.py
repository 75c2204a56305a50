"""Greedy decode of many tokens in one jitted device loop: the fast path of `Session.generate` at temperature 0.

`Session.generate` runs one jitted step per token and returns to Python between steps (argmax, stop check, Engram
hashing, tier bookkeeping). On a GPU that round trip is a host sync per token. Here the whole generation is one
`lax.while_loop` over the same `model.step`: the argmax, the stop-token test and the context limit are device
operations, so the host is only entered where it has to be:

- Engram rows depend on the token ids alone; one host call per step hashes the newest n-gram contexts and reads
  the rows from the engine's row source (jds41.engram_host_call: an XLA FFI handler in C++, or a Python
  `io_callback` that also starts the SSD reads of the hash-layer experts of the token about to be fed, exact
  prefetch, DESIGN.md §3/§4). Models without Engram make no such call.
- SSD experts still enter through the tiers' own host call inside the step, only on a miss.

The loop feeds exactly the tokens `Session.generate` would feed (the last generated token and a stop token are
never fed), with the same per-token arithmetic, so its tokens equal the reference path's (tests/test_decode_loop.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds41 import model as M
from jds41.block_step import step_at_width
from jds41.engram_host_call import fetch_step_rows, step_rows_fn

MAX_STOP_IDS = 8  # stop ids are a fixed-size array (padded with -1) so the loop compiles once per model


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=5)
def _loop(plan: M.ModelPlan, n_max: int, rows_fn, trace: bool, params, state, first, history, n_hist, stop_ids,
          limit, forced=None):
    """Up to `limit` (traced, <= n_max) outputs, `first` included, in buffers of the static size n_max: one compiled
    loop serves every limit up to it. `forced` [n_max] (optional): feed these tokens instead of the argmax (out[i]
    is still the argmax after feeding token i-1), so a benchmark can run decode steps over a fixed token stream."""
    cfg = plan.cfg
    n_ctx = cfg.engram.max_ngram - 1 if cfg.engram is not None else 0
    L, K = cfg.n_layers, cfg.n_experts_used
    out = jnp.full((n_max,), -1, jnp.int32).at[0].set(first)
    routing = {"experts": jnp.zeros((n_max, L, K), jnp.int32), "swaps": jnp.zeros((n_max, L), jnp.int32),
               "predicted_next": jnp.full((n_max, L, K), -1, jnp.int32)}

    def stop(tok):
        return jnp.any(tok == stop_ids)

    def cond(c):
        st, tok, count = c[0], c[1], c[2]
        return (count < limit) & ~stop(tok) & (st["pos"] < plan.max_ctx)

    def body(c):
        st, tok, count, out, hist, n_hist, routing = c
        rows = None if rows_fn is None else fetch_step_rows(rows_fn, tok[None], hist, n_hist)[0]
        res = step_at_width(plan, params, st, tok, rows, trace)
        logits, st = res[0], res[1]
        pred = jnp.argmax(logits).astype(jnp.int32)  # first maximum, like numpy's argmax in engine.sample
        nxt = pred if forced is None else forced[count]
        if trace:
            # the trace of the step that fed token `count - 1` (Session.generate records the same steps)
            routing = jax.tree.map(lambda buf, v: buf.at[count - 1].set(v), routing, res[2])
        if n_ctx:
            hist = jnp.concatenate([hist[1:], tok[None]])
            n_hist = jnp.minimum(n_hist + 1, n_ctx)
        return st, nxt, count + 1, out.at[count].set(pred), hist, n_hist, routing

    carry = (state, first, jnp.int32(1), out, history, n_hist, routing)
    st, _, count, out, _, _, routing = jax.lax.while_loop(cond, body, carry)
    return out, count, st, routing


def stop_array(stop_ids) -> tuple[list[int], jax.Array]:
    """(the stop ids as ints, the loop's fixed-size int32 array of them padded with -1); at most MAX_STOP_IDS."""
    stop = [int(s) for s in stop_ids]
    if len(stop) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop)}")
    return stop, jnp.asarray(stop + [-1] * (MAX_STOP_IDS - len(stop)), jnp.int32)


def greedy_generate(session, first_token: int, max_new: int, stop_ids=(), n_max: int | None = None) -> list[int]:
    """Tokens `Session.generate` would yield at temperature 0 after its first one (`first_token`, the argmax of the
    prompt's logits, already chosen by the caller), all in one device loop; the session's state and history advance
    exactly as the reference loop would leave them. Returns every generated token, `first_token` included.
    `n_max` (>= max_new; default max_new) sizes the compiled loop: callers whose max_new varies (a request's last
    chunk) pass a fixed n_max and compile once."""
    eng = session.engine
    if max_new < 1:
        return []
    n_max = max_new if n_max is None else n_max
    if n_max < max_new:
        raise ValueError(f"n_max {n_max} < max_new {max_new}")
    stop, stop_arr = stop_array(stop_ids)
    _, hist, n_hist = _history(session)
    rows_fn = step_rows_fn(eng)
    trace = eng.tiers is not None
    out, count, state, routing = _loop(eng.plan, n_max, rows_fn, trace, eng.params, session.state,
                                       jnp.int32(first_token), hist, n_hist, stop_arr, jnp.int32(max_new))
    # cut on the host: a device slice compiles once per length (the tiered server's lane stops at any count)
    produced = [int(t) for t in np.asarray(out)[:int(count)]]
    fed = produced[:-1]  # every iteration fed the newest token and produced the next; the last is never fed
    session.state = state
    session.tokens += fed
    if trace and fed:
        eng.tiers.record(jax.tree.map(lambda a: np.asarray(a)[:len(fed)], routing))
        eng.apply_lean_guard()
    return produced


def decode_forced(session, tokens) -> np.ndarray:
    """Feed `tokens` one decode step each in the device loop (not greedy: the next token comes from `tokens`);
    returns the argmax after each fed token but the last ([len(tokens) - 1]). For benchmarks: the greedy output of
    random weights can fall into a loop that any cache serves, a fixed stream keeps routing as varied as its
    tokens. The session advances over every token but the last, exactly as `feed` would."""
    eng = session.engine
    tokens = [int(t) for t in tokens]
    if len(tokens) < 2:
        raise ValueError("decode_forced needs at least 2 tokens")
    session._check(tokens[:-1])
    n_ctx, hist, n_hist = _history(session)
    rows_fn = step_rows_fn(eng)
    trace = eng.tiers is not None
    stop = jnp.full((MAX_STOP_IDS,), -1, jnp.int32)
    out, count, state, routing = _loop(eng.plan, len(tokens), rows_fn, trace, eng.params, session.state,
                                       jnp.int32(tokens[0]), hist, n_hist, stop, jnp.int32(len(tokens)),
                                       jnp.asarray(tokens, jnp.int32))
    fed = tokens[:int(count) - 1]
    session.state = state
    session.tokens += fed
    if trace and fed:
        eng.tiers.record(jax.tree.map(lambda a: np.asarray(a)[:len(fed)], routing))
        eng.apply_lean_guard()
    return np.asarray(out[1:int(count)])


def _history(session):
    """The Engram n-gram history the loop carries: (n-1, last n-1 fed tokens padded with -1 on the left, count)."""
    cfg = session.engine.cfg
    n_ctx = cfg.engram.max_ngram - 1 if cfg.engram is not None else 0
    tail = session.tokens[max(0, len(session.tokens) - n_ctx):] if n_ctx else []
    hist = np.full((max(n_ctx, 1),), -1, np.int32)
    if tail:
        hist[len(hist) - len(tail):] = tail
    return n_ctx, jnp.asarray(hist), jnp.int32(len(tail))
