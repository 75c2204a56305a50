"""Greedy speculative (DSpark) decoding in one jitted device loop: the fast path of `SpeculativeSession.generate`.

The host-orchestrated reference (speculative.SpeculativeSession with `step_loop=True`) runs, per verify step, the
drafter's propose, the target's `verify_block`, a device->host copy of the logits for `greedy_accept`, `rollback`
and the feature injection as separate dispatches with host syncs between them; on the H200 that made drafting
slower than plain decode's device loop (decode_loop.py). Here every verify step is one iteration of a
`lax.while_loop` over the same functions:

1. the drafter proposes `k` tokens from its window state (`propose`, no host round trip);
2. one host call (jds41.engram_host_call, only for Engram models, exactly where decode_loop has its own) hashes and
   reads the Engram rows of all k+1 block tokens (the Python form also starts the SSD reads of their hash-layer
   experts);
3. `speculative.verify_block` feeds [last, d1..dk] through the target, layer-major or token-major as the session
   chose (`SpeculativeSession.verify`, a static argument of the loop; "auto" = layer-major when experts are tiered,
   so a block moves each host / SSD expert it needs once instead of once per position; both give the same values,
   so the loop and the host reference agree either way); the greedy acceptance (longest prefix where d_i == argmax
   of the previous row, plus the target's own next token) is a device reduction;
4. `speculative.rollback` keeps the accepted prefix, and the kept positions' target features are injected into the
   drafter (`inject`);
5. the emitted tokens go into a fixed-size device buffer; stop ids, `max_new` and the context end are tested on
   the device, cutting the output exactly where the reference stops yielding.
Near the context end, where a whole block no longer fits, an iteration is a plain one-token step (lax.cond), as
in the reference. SSD experts still enter through the tiers' own host call inside the step, only on a miss.

The loop leaves the session's state and token history, the drafter's state and the draft statistics exactly as
the reference leaves them, and emits plain greedy decode's tokens (tests/test_speculative_loop.py).

Drafters for the loop provide `device_spec()` (a hashable static object with `block_size`, `feature_layers`,
`propose(params, state, last, pos) -> int32 [k]` and `inject(params, state, features [k+1, n, D], pos0, count)`),
`device_params()` (a pytree) and a `state` pytree; `DSparkDrafter` is the real one, `ForcedDrafter` (below) proposes
a known continuation or its opposite (tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds41 import model as M
from jds41.block_step import step_at_width
from jds41.decode_loop import _history, stop_array
from jds41.engram_host_call import fetch_step_rows, step_rows_fn
from jds41.speculative import rollback, verify_block

N_STATS = 5  # steps, drafted, accepted, emitted, plain_steps: DraftStats' counters, summed on the device


# ---- drafters on the device -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DSparkDevice:
    """The DSpark drafter's device functions; hashable by its plan, so the loop compiles once per drafter shape."""

    plan: object  # dspark.DraftPlan

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.plan.target_layer_ids)

    def propose(self, params, state, last, pos):
        from jds41.layers import dspark

        return dspark.propose(self.plan, params["draft"], params["shared"], state, last, pos)[0]

    def inject(self, params, state, features, pos0, count):
        from jds41.layers import dspark

        return dspark.inject(self.plan, params["draft"], state, features, pos0, count)


@dataclasses.dataclass(frozen=True)
class ForcedDevice:
    """Forced drafts: the continuation of a token stream, or (flip = 1) a token that never is it, both read from
    params (an array, so right and wrong drafts share one compiled loop). `inner` (a DSparkDevice or None)
    receives the features as the real drafter would; without one the state only counts injected positions."""

    block_size: int
    feature_layers: tuple[int, ...]
    vocab: int
    inner: DSparkDevice | None = None

    def propose(self, params, state, last, pos):
        # positions past the stream read 0, as the host-side oracles do (padding in ForcedDrafter.device_params)
        true = jax.lax.dynamic_slice(params["stream"], (pos + 1,), (self.block_size,))
        return (true + params["flip"]) % self.vocab

    def inject(self, params, state, features, pos0, count):
        if self.inner is not None:
            return self.inner.inject(params["inner"], state, features, pos0, count)
        return {"observed": state["observed"] + count}


class ForcedDrafter:
    """Proposes `stream`'s continuation (right=True) or never it (right=False), on the host (`propose`, for the
    reference path) and on the device (`device_spec`, for the loop). With `inner` (a DSparkDrafter) the features are
    injected into its state, which `state` then is; else `state` counts the injected positions."""

    def __init__(self, engine, stream, right: bool, block_size: int, feature_layers, inner=None):
        self.stream, self.right, self.vocab = [int(t) for t in stream], right, engine.vocab_size
        self.block_size, self.feature_layers, self.inner = int(block_size), tuple(feature_layers), inner
        # one fixed length per engine (the context plus a block past it), so every stream compiles the same loop
        self._stream_len = engine.max_ctx + 2 * self.block_size + 2
        if inner is None:
            self.state = {"observed": jnp.int32(0)}

    @property
    def state(self):
        return self.inner.state if self.inner is not None else self._state

    @state.setter
    def state(self, value):
        if self.inner is not None:
            self.inner.state = value
        else:
            self._state = value

    def observe(self, features, pos0: int, count: int) -> None:
        if self.inner is not None:
            self.inner.observe(features, pos0, count)
        else:
            self._state = {"observed": self._state["observed"] + count}

    def propose(self, last: int, pos: int) -> list[int]:
        true = [self.stream[p] if p < len(self.stream) else 0 for p in range(pos + 1, pos + 1 + self.block_size)]
        return true if self.right else [(t + 1) % self.vocab for t in true]

    def device_spec(self) -> ForcedDevice:
        return ForcedDevice(self.block_size, self.feature_layers, self.vocab,
                            self.inner.device_spec() if self.inner is not None else None)

    def device_params(self) -> dict:
        stream = np.zeros((max(self._stream_len, len(self.stream) + self.block_size + 1),), np.int32)
        stream[:len(self.stream)] = self.stream
        out = {"stream": jnp.asarray(stream), "flip": jnp.int32(0 if self.right else 1)}
        if self.inner is not None:
            out["inner"] = self.inner.device_params()
        return out


# ---- the loop ---------------------------------------------------------------------------------------------------
def _pad(x, n: int):
    """x [m, ...] -> [n, ...] with zeros after row m (fixed shapes for both lax.cond branches)."""
    return jnp.zeros((n, *x.shape[1:]), x.dtype).at[:x.shape[0]].set(x)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(8, 9))
def _loop(plan: M.ModelPlan, draft, n_max: int, rows_fn, trace: bool, how: str, params, dparams, state,
          dstate, first, history, n_hist, stop_ids):
    cfg = plan.cfg
    k = draft.block_size
    W = k + 1  # the verify block: [last, d1..dk]
    feature_layers = tuple(draft.feature_layers)
    n_ctx = cfg.engram.max_ngram - 1 if cfg.engram is not None else 0
    L, K = cfg.n_layers, cfg.n_experts_used
    # An iteration starts with fewer than n_max tokens out and adds at most W: n_max + W slots never overflow
    # (dynamic_update_slice would clamp the offset, silently moving the write).
    out = jnp.full((n_max + W,), -1, jnp.int32).at[0].set(first)
    routing = {"experts": jnp.zeros((n_max + W, L, K), jnp.int32), "swaps": jnp.zeros((n_max + W, L), jnp.int32),
               "predicted_next": jnp.full((n_max + W, L, K), -1, jnp.int32)}

    def rows_of(block, hist, n_hist):
        return None if rows_fn is None else fetch_step_rows(rows_fn, block, hist, n_hist)

    def verify(operands):
        st, dst, last, hist, n_hist = operands
        t0 = st["pos"]
        drafts = draft.propose(dparams, dst, last, t0).astype(jnp.int32)
        block = jnp.concatenate([last[None], drafts])
        res = verify_block(plan, params, st, block, rows_of(block, hist, n_hist), trace, feature_layers,
                           how)
        logits, st, undo, small, extra = res[0], res[1], res[2], res[3], res[4:]
        targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # first maximum, like greedy_accept's np.argmax
        a = jnp.sum(jnp.cumprod((drafts == targets[:k]).astype(jnp.int32)))
        keep = a + 1
        st = rollback(plan, st, undo, small, keep)
        if feature_layers:
            dst = draft.inject(dparams, dst, extra[-1], t0, keep)
        # drafts 0..a-1 equal targets 0..a-1, so the a+1 emitted tokens are targets[:keep]
        stats = jnp.stack([jnp.int32(1), jnp.int32(k), a, keep, jnp.int32(0)])
        return st, dst, block, targets, keep, (extra[0] if trace else {}), stats

    def plain(operands):
        # no room for a whole block before the context end: one decode step, as the reference's `feed([last])`
        st, dst, last, hist, n_hist = operands
        t0 = st["pos"]
        rows = rows_of(last[None], hist, n_hist)
        res = step_at_width(plan, params, st, last, None if rows is None else rows[0], trace, feature_layers)
        logits, st, extra = res[0], res[1], res[2:]
        if feature_layers:  # the reference pads one position to a block's rows too (DSparkDrafter.observe)
            dst = draft.inject(dparams, dst, _pad(extra[-1][None], W), t0, jnp.int32(1))
        tok = jnp.argmax(logits).astype(jnp.int32)
        block = jnp.full((W,), -1, jnp.int32).at[0].set(last)
        emitted = jnp.full((W,), -1, jnp.int32).at[0].set(tok)
        r = jax.tree.map(lambda x: _pad(x[None], W), extra[0]) if trace else {}
        return st, dst, block, emitted, jnp.int32(1), r, jnp.array([0, 0, 0, 0, 1], jnp.int32)

    def body(c):
        st, dst, last, n_all, _, _, out, hist, n_hist, routing, stats = c
        t0 = st["pos"]
        st, dst, block, emitted, keep, r, ds = jax.lax.cond(t0 + W <= plan.max_ctx, verify, plain,
                                                             (st, dst, last, hist, n_hist))
        out = jax.lax.dynamic_update_slice(out, emitted, (n_all,))
        if trace:  # the fed positions' routing, at their index among the fed tokens (n_all - 1 fed so far)
            routing = jax.tree.map(lambda buf, v: jax.lax.dynamic_update_slice(buf, v, (n_all - 1,) + (0,) *
                                                                                 (v.ndim - 1)), routing, r)
        if n_ctx:  # the Engram history advances by the fed tokens block[:keep]
            hist = jax.lax.dynamic_slice(jnp.concatenate([hist, block]), (keep,), (n_ctx,))
            n_hist = jnp.minimum(n_hist + keep, n_ctx)
        # Where the reference stops yielding: after emitted token j if it is a stop id, if it is the max_new-th
        # token, or if plain decode would have filled the context by then (the state keeps all `keep` positions).
        j = jnp.arange(W, dtype=jnp.int32)
        hit = (j < keep) & (jnp.any(emitted[:, None] == stop_ids[None, :], axis=1) | (n_all + j + 1 >= n_max)
                            | (t0 + j + 1 >= plan.max_ctx))
        done = jnp.any(hit)
        n_out = jnp.where(done, n_all + jnp.argmax(hit) + 1, n_all + keep)
        last = emitted[keep - 1]
        return st, dst, last, n_all + keep, n_out, done, out, hist, n_hist, routing, stats + ds

    carry = (state, dstate, jnp.asarray(first, jnp.int32), jnp.int32(1), jnp.int32(1), jnp.bool_(False), out,
             history, n_hist, routing, jnp.zeros((N_STATS,), jnp.int32))
    st, dst, _, n_all, n_out, _, out, _, _, routing, stats = jax.lax.while_loop(lambda c: ~c[5], body, carry)
    return out, n_out, n_all, st, dst, routing, stats


def speculative_generate(session, drafter, first_token: int, max_new: int, stop_ids=()) -> list[int]:
    """What `SpeculativeSession.generate` (the host-orchestrated reference) yields after the prompt, in one device
    loop: `first_token` is the argmax of the prompt's logits, already chosen (and fed nothing) by the caller.
    Returns every generated token, `first_token` included; the session's state, tokens and draft statistics and
    the drafter's state advance exactly as the reference leaves them. `session` is a SpeculativeSession (its plan
    has the verify block's ring slack)."""
    eng = session.engine
    if max_new < 1:
        return []
    stop, stop_arr = stop_array(stop_ids)
    first_token = int(first_token)
    if first_token in stop or max_new == 1 or len(session.tokens) >= eng.max_ctx:
        return [first_token]
    spec = drafter.device_spec()
    if int(spec.block_size) != session.k:
        raise ValueError(f"drafter block size {spec.block_size} != the session's {session.k}")
    _, hist, n_hist = _history(session)
    rows_fn = step_rows_fn(eng)
    trace = eng.tiers is not None
    out, n_out, n_all, state, dstate, routing, stats = _loop(
        session.plan, spec, max_new, rows_fn, trace, session.verify_mode, eng.params, drafter.device_params(),
        session.state, drafter.state, jnp.int32(first_token), hist, n_hist, stop_arr)
    session.state, drafter.state = state, dstate
    n_out, n_all = int(n_out), int(n_all)
    out = [int(t) for t in np.asarray(out[:n_all])]
    fed = out[:-1]  # every token but the newest emitted one was fed (also past a stop id cut inside a block)
    session.tokens += fed
    if trace and fed:
        session._record([jax.tree.map(lambda a: np.asarray(a[:len(fed)]), routing)])
    s = getattr(session, "stats", None)
    if s is not None:
        steps, drafted, accepted, emitted, plain = (int(x) for x in np.asarray(stats))
        s.steps, s.drafted, s.accepted = s.steps + steps, s.drafted + drafted, s.accepted + accepted
        s.emitted, s.plain_steps = s.emitted + emitted, s.plain_steps + plain
    return out[:n_out]
