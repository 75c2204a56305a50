"""Speculative decoding: a drafter proposes a block, the target verifies it in one jitted pass, output stays
bit-identical to plain greedy decode (DESIGN.md §5, MODEL.md §4).

One verify step with the last emitted (not yet fed) token `last` and drafts d1..dk:
1. `verify_block` feeds [last, d1..dk] through the target, one of two ways with the same values bit for bit:
   token-major, a `lax.scan` of the exact decode `step` (the same scan `prefill` is; chunked prefill equals
   one-token steps bit for bit), or layer-major, the layer-by-layer pass of jds41/prefill.py (each layer's
   attention scanned over the block in order, then the union of the block's experts brought from their tiers ONCE
   for all k+1 positions, then each position's FFN). Token-major moves a position's host / SSD experts into the
   device for every position, so under tier offload a block costs up to k+1 times the expert traffic of a decode
   step; layer-major moves each once per block (and gathers the union's rows once even from the tier-0 stack).
   With the model's own resident stacks (no profile) there is nothing to move and the plain scan stays, so the
   session's `verify="auto"` picks layer-major exactly when a layer's experts are tiered (a `TieredLayer` under
   "routed"); the choice is static and shared by the host path and the device loop. Either way it also returns
   what a rollback needs: the pre-verify contents of every state row the block can overwrite (window ring slots,
   compressed rows / index keys of the touched blocks) and the small compressor leaves after every position
   (partial-group buffers and latent: a ratio-1/2 buffer is overwritten within the block itself).
2. Greedy acceptance: t_i = argmax(logits_{i-1}); accept d_i while d_i == t_i; a accepted drafts emit d1..da and
   the target's own t_{a+1}, so each step yields a+1 >= 1 tokens, exactly plain decode's.
3. `rollback` keeps the first a+1 positions: ring slots and compressed rows written by rejected positions get their
   old contents back, the small leaves are taken after position a, pos = p0+a+1. The result equals plain decode's
   state at that position leaf for leaf (tests/test_speculative.py). Why the restores are exact: rejected
   positions only write ring slots no kept position wrote (the ring has `window + k` slots, plan.ring_slack, and
   attention reads it by position, attention.window_rows), and a compressed row is only written at its group's last
   position, so a group holding a rejected position was not emitted by a kept one.
4. The drafter is told the kept positions' target features (only committed positions are ever injected).
Engram n-gram history is the host token list, so it rolls back by itself.

Here the steps are orchestrated from the host (`SpeculativeSession(step_loop=True)`: the reference, with the
acceptance on the host); jds41/speculative_loop.py runs the same functions as one device loop, which
`SpeculativeSession.generate` uses by default, with the same tokens, state and draft counts.

Sampling: greedy only. Speculative sampling at temperature > 0 would need the drafter's probabilities and the
rejection rule; `generate` refuses temperature > 0 with a RequestError instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jds41 import model as M
from jds41 import prefill as PF
from jds41.block_step import SMALL_LEAVES, step_rows
from jds41.engine import Engine, RequestError, SamplingParams, Session
from jds41.errors import Jds41Error
from jds41.prompt_pieces import run_piece


# ---- target side: verify and rollback ---------------------------------------------------------------------------
def _row_arrays(plan: M.ModelPlan, lp: M.LayerPlan, st: dict):
    """(state name, leaf name, ratio) of the arrays indexed by position // ratio that a step may write."""
    out = []
    for name in ("cmp", "idx"):
        if name not in st:
            continue
        if "rows" in st[name]:
            ratio = lp.cmp.ratio if name == "cmp" else lp.idx_cmp.ratio
            out.append((name, "rows", ratio))
        else:  # V4.1 index keys derived from a kv source's rows
            out.append((name, "keys", lp.ratio))
    return out


def _undo(plan: M.ModelPlan, state: dict, positions: jax.Array) -> list:
    """The current contents of every row the block at `positions` may overwrite, per layer."""
    undo = []
    for lp, st in zip(plan.layers, state["layers"], strict=True):
        slots = positions % st["ring"]["kv"].shape[0]
        u = {"ring": {"kv": st["ring"]["kv"][slots], "pos": st["ring"]["pos"][slots]}}
        for name, leaf, ratio in _row_arrays(plan, lp, st):
            u[name] = st[name][leaf][positions // ratio]
        undo.append(u)
    return undo


def _small_layer(st: dict) -> dict:
    """One layer's small compressor leaves (a rollback takes them per position, not per row)."""
    return {name: {k: st[name][k] for k in SMALL_LEAVES} for name in ("cmp", "idx")
            if name in st and "rows" in st[name]}


def _small(state: dict) -> list:
    return [_small_layer(st) for st in state["layers"]]


VERIFY_MODES = ("auto", "token-major", "layer-major")


def resolve_verify(mode: str, params: dict) -> str:
    """How verify blocks run for `mode` (VERIFY_MODES): "auto" = "layer-major" when any layer's routed experts are
    tiered (a `TieredLayer` under "routed"), where moving each expert once per block instead of once per position
    is what the layer-major pass buys; with resident stacks the token-major scan is the plain path. (The third
    way, "batched", is not chosen here: it is exact only against decode at the same row width.)"""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    if mode == "auto":
        return "layer-major" if any("routed" in b for b in params["blocks"]) else "token-major"
    return mode


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7), donate_argnums=2)
def verify_block(plan: M.ModelPlan, params: dict, state: dict, tokens: jax.Array, engram_rows=None,
                 trace_routing: bool = False, feature_layers: tuple[int, ...] = (), how: str = "token-major"):
    """Feed `tokens` [n] through the target: (logits [n, V], state, undo, small[, routing][, features]); the
    per-position outputs have a leading n axis. n must not exceed plan.ring_slack + the window + 1.

    how="token-major": a scan of decode's `step`; "layer-major": the layer-major pass (jds41/prefill.py), each needed
    host / SSD expert moved once per block; both equal plain decode bit for bit (tests/test_verify_layer_major.py).
    "batched": all n rows in one row-batched pass (jds41/block_step.py), equal bit for bit to decode at row width n
    (block_step.decode_rows), not to the one-token step. The device loop calls it inside its own jit."""
    positions = state["pos"] + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    undo = _undo(plan, state, positions)
    if how == "batched":
        logits, state, small, *extra = step_rows(plan, params, state, tokens, engram_rows, trace_routing,
                                                 feature_layers)
        return (logits, state, undo, small, *extra)
    if how == "layer-major":
        logits, state, extras = PF.layer_major(plan, params, state, tokens, engram_rows, trace_routing,
                                               feature_layers, _small_layer)
        return (logits, state, undo, extras["states"], *(extras[k] for k in ("routing", "features") if k in extras))

    def body(st, xs):
        tok, rows = xs
        out = M.step(plan, params, st, tok, rows, trace_routing, feature_layers)
        return out[1], (out[0], _small(out[1]), *out[2:])

    state, ys = jax.lax.scan(body, state, (tokens, engram_rows))
    return (ys[0], state, undo, ys[1], *ys[2:])


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def rollback(plan: M.ModelPlan, state: dict, undo: list, small: list, keep: jax.Array) -> dict:
    """The state after only the first `keep` (>= 1) positions of the verified block (see the module docstring)."""
    n = undo[0]["ring"]["pos"].shape[0]
    p0 = state["pos"] - n
    positions = p0 + jnp.arange(n, dtype=jnp.int32)
    rejected = jnp.arange(n) >= keep
    layers = []
    for lp, st, u, sm in zip(plan.layers, state["layers"], undo, small, strict=True):
        st = dict(st)
        ring = st["ring"]
        slots = positions % ring["kv"].shape[0]
        st["ring"] = {"kv": ring["kv"].at[slots].set(jnp.where(rejected[:, None], u["ring"]["kv"], ring["kv"][slots])),
                      "pos": ring["pos"].at[slots].set(jnp.where(rejected, u["ring"]["pos"], ring["pos"][slots]))}
        for name, leaf, ratio in _row_arrays(plan, lp, st):
            d = dict(st[name])
            blocks = positions // ratio
            # Every group from the first rejected position's on was not emitted by a kept position: restore it.
            # Duplicate block indices all carry the same value, so the scatter is deterministic.
            restore = blocks >= (p0 + keep) // ratio
            d[leaf] = d[leaf].at[blocks].set(jnp.where(restore[:, None], u[name], d[leaf][blocks]))
            if name in sm:
                for k in SMALL_LEAVES:
                    d[k] = sm[name][k][keep - 1]
            st[name] = d
        layers.append(st)
    return {"pos": p0 + keep, "layers": layers}


def greedy_accept(drafts: Sequence[int], logits: np.ndarray) -> tuple[int, list[int]]:
    """(accepted drafts a, the a+1 tokens plain greedy decode emits): logits [k+1, V] of [last, d1..dk]."""
    targets = [int(t) for t in np.argmax(logits, axis=-1)]
    a = 0
    while a < len(drafts) and int(drafts[a]) == targets[a]:
        a += 1
    return a, [int(t) for t in drafts[:a]] + [targets[a]]


# ---- drafters ---------------------------------------------------------------------------------------------------
class DSparkDrafter:
    """The DSpark drafter of an engine: its stages' params (from the target file or a separate draft file) and its
    per-session window rings. `propose(last, pos)` drafts block_size tokens; `observe` injects committed features."""

    def __init__(self, plan, params: dict, shared: dict, source: str):
        from jds41.layers import dspark

        self._dspark = dspark
        self.plan, self.params, self.shared, self.source = plan, params, shared, source
        self.block_size = plan.block_size
        self.feature_layers = tuple(plan.target_layer_ids)
        self.confidence: np.ndarray | None = None  # of the last proposal
        self.reset()

    @classmethod
    def open(cls, engine: Engine, draft: str, numerics_act_round: str | None = None) -> DSparkDrafter:
        """`draft` = "self" (the target file's own `mtp.*` stages) or the path of a separate draft GGUF."""
        from jds41.checkpoints import open_model
        from jds41.checkpoints.schema import draft_stages
        from jds41.layers import dspark

        if draft == "self":
            model, cfg = engine.gguf, engine.cfg
            if not draft_stages(cfg):
                raise Jds41Error(f"{engine.path} has no DSpark draft stages (mtp.* tensors): pass --draft FILE")
        else:
            model = open_model(draft)
            cfg = model.config
            if not draft_stages(cfg):
                raise Jds41Error(f"{draft} is not a DSpark draft file (no DSpark keys / draft stages)")
            check_compatible(engine.cfg, cfg, draft)
        plan = dspark.make_draft_plan(cfg)
        params = dspark.load_draft_params(cfg, model, numerics_act_round)
        shared = {"token_embd": engine.params["token_embd"], "output": engine.params["output"]}
        return cls(plan, params, shared, draft)

    def reset(self) -> None:
        self.state = self._dspark.init_draft_state(self.plan)

    def observe(self, features: jax.Array, pos0: int, count: int) -> None:
        """Inject `count` committed positions from pos0; in pieces of block_size + 1 rows (a verify block's size),
        so one compiled program serves prompts, verify steps and single steps."""
        n = self.block_size + 1
        for i in range(0, count, n):
            piece = features[i:i + n]
            if piece.shape[0] < n:
                piece = jnp.pad(piece, ((0, n - piece.shape[0]), (0, 0), (0, 0)))
            self.state = self._dspark.inject(self.plan, self.params, self.state, piece, jnp.int32(pos0 + i),
                                             jnp.int32(min(n, count - i)))

    def propose(self, last: int, pos: int) -> list[int]:
        tokens, conf, _ = self._dspark.propose(self.plan, self.params, self.shared, self.state, jnp.int32(last),
                                               jnp.int32(pos))
        self.confidence = np.asarray(conf)
        return [int(t) for t in np.asarray(tokens)]

    # the device loop's view (jds41/speculative_loop.py): static functions, their params, and `state`
    def device_spec(self):
        from jds41.speculative_loop import DSparkDevice

        return DSparkDevice(self.plan)

    def device_params(self) -> dict:
        return {"draft": self.params, "shared": self.shared}


def check_compatible(target, draft, draft_path: str) -> None:
    """A separate draft file carries its target's keys: the main-model part of its config must equal the target's."""
    n = target.n_layers

    def main_part(c):
        return dataclasses.replace(c, n_nextn=0, compress_ratios=c.compress_ratios[:n], swiglu_limit=c.swiglu_limit[:n],
                                   swiglu_limit_shexp=c.swiglu_limit_shexp[:n], dspark=None)

    if draft.n_layers != n or main_part(draft) != main_part(target):
        diff = [f.name for f in dataclasses.fields(target)
                if f.name not in ("n_nextn", "dspark") and getattr(main_part(draft), f.name, None)
                != getattr(main_part(target), f.name)] if draft.n_layers == n else ["n_layers"]
        raise Jds41Error(f"{draft_path}: draft file was made for another target model (differs in: "
                         f"{', '.join(diff) or 'config'})")


# ---- the session -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DraftStats:
    steps: int = 0  # verify passes
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of them accepted
    emitted: int = 0  # tokens emitted by verify passes (accepted + one target token each)
    plain_steps: int = 0  # one-token steps where no block fit (context end)

    def to_dict(self) -> dict:
        return {"verify_steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "tokens_per_step": round(self.emitted / self.steps, 4) if self.steps else None,
                "plain_steps": self.plain_steps}


class SpeculativeSession(Session):
    """A Session whose greedy `generate` drafts with `drafter` and verifies blocks; tokens equal plain decode's.

    `drafter` needs `block_size`, `feature_layers` (target layers whose features it reads, may be empty),
    `observe(features, pos0, count)` and `propose(last, pos) -> list of block_size ids`; `DSparkDrafter` is the real
    one, tests pass oracles. Prompts are fed like Session.feed (prefill chunks + steps), with features.

    `generate` runs the whole generation as one device loop (jds41/speculative_loop.py) when the drafter has a
    device form (`device_spec`); `step_loop=True`, or a host-only drafter, selects the host-orchestrated loop below
    (one verify step per Python iteration), the reference the device loop is tested against.

    `verify` (VERIFY_MODES) picks how both paths run verify_block; `verify_mode` is the resolved choice
    ("token-major" or "layer-major"), one static value for the host path and the device loop alike.
    """

    def __init__(self, engine: Engine, drafter, step_loop: bool = False, verify: str = "auto"):
        super().__init__(engine)
        self.drafter = drafter
        self.step_loop = step_loop or not hasattr(drafter, "device_spec")
        self.verify_mode = resolve_verify(verify, engine.params)
        width = engine.plan.decode_width
        if width > 1:  # the engine decodes at a row width: verify blocks must be exactly that wide, and batched
            if int(drafter.block_size) + 1 != width:
                raise Jds41Error(f"the engine decodes at width {width}, but a drafter of block size "
                                 f"{int(drafter.block_size)} verifies {int(drafter.block_size) + 1} rows: use decode "
                                 f"width {int(drafter.block_size) + 1} (or 1)")
            self.verify_mode = "batched"
        self.k = int(drafter.block_size)
        # slack for the verify block, and for the wide prompt pass's rolled-back block (the plan's own slack)
        self.plan = dataclasses.replace(engine.plan, ring_slack=max(self.k, engine.plan.ring_slack))
        self.state = M.init_state(self.plan)
        self.feature_layers = tuple(drafter.feature_layers)
        self.stats = DraftStats()

    def _observe(self, outs: list, pos0: int, count: int) -> None:
        """Hand the drafter the features (last entry of a step's outputs) of `count` committed positions."""
        if self.feature_layers:
            self.drafter.observe(outs[-1], pos0, count)

    def _feed(self, tokens: Sequence[int], all_logits: bool) -> np.ndarray:
        """The engine session's prompt pieces (jds41/prompt_pieces.py), also handing the drafter each position's
        target features."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise RequestError("no tokens to feed")
        self._check(tokens)
        eng, trace = self.engine, self.engine.tiers is not None
        out = []
        if trace:
            eng.tiers.prefetch_tokens(tokens)
        # the next piece's Engram rows are read on a worker thread while this one runs (Session._pieces)
        with contextlib.closing(self._pieces(tokens)) as pieces:
            for how, chunk, rows in pieces:
                logits, self.state, *extra = run_piece(self.plan, eng.params, self.state, how, chunk, rows, trace,
                                                       self.feature_layers, all_logits, eng.prefill_chunk)
                self._record(extra[:1] if trace else [])
                self._observe(extra, len(self.tokens), len(chunk))
                out.append(logits if all_logits else logits[-1:])
                self.tokens += chunk
        # joined on the host, as Session.feed does: a jitted concatenate compiles once per count of pieces
        result = np.concatenate([np.asarray(o, np.float32) for o in out])
        return result if all_logits else result[-1]

    def verify(self, last: int, drafts: Sequence[int]) -> list[int]:
        """One verify step: feed [last, drafts...], keep the greedy-accepted prefix; returns the emitted tokens."""
        eng, trace = self.engine, self.engine.tiers is not None
        block = [int(last)] + [int(d) for d in drafts]
        self._check(block)
        if trace:  # exact prefetch: the draft tokens' hash-layer experts are known before verify runs
            eng.tiers.prefetch_tokens(block)
        rows = self._engram_rows(block)  # Engram rows of the draft tokens, hashed and read ahead of the pass
        logits, self.state, undo, small, *extra = verify_block(self.plan, eng.params, self.state,
                                                               jnp.asarray(block, jnp.int32), rows, trace,
                                                               self.feature_layers, self.verify_mode)
        a, emitted = greedy_accept(block[1:], np.asarray(logits))
        keep = a + 1
        self.state = rollback(self.plan, self.state, undo, small, jnp.int32(keep))
        if trace:
            self._record([jax.tree.map(lambda x: x[:keep], extra[0])])
        self._observe(extra, len(self.tokens), keep)
        self.tokens += block[:keep]
        s = self.stats
        s.steps, s.drafted, s.accepted, s.emitted = s.steps + 1, s.drafted + len(drafts), s.accepted + a, \
            s.emitted + len(emitted)
        return emitted

    def generate(self, prompt: Sequence[int], max_new: int, sampling: SamplingParams | None = None,
                 stop_ids: Sequence[int] = (), logits_out: list | None = None) -> Iterator[int]:
        """Greedy generation with drafting: yields exactly what Session.generate yields at temperature 0."""
        if sampling is not None and sampling.temperature > 0:
            raise RequestError("drafting (--draft) supports greedy decoding only: use temperature 0 (speculative "
                               "sampling is not implemented)")
        if logits_out is not None:
            raise RequestError("drafting does not record per-step logits (--logits): run without --draft")
        if max_new <= 0:
            return
        ctx = self.engine.max_ctx
        last = int(np.argmax(self.feed(prompt)))
        yield last
        if not self.step_loop:
            yield from self._generate_on_device(last, max_new, stop_ids)
            return
        if last in stop_ids or max_new == 1 or len(self.tokens) >= ctx:
            return
        n_out = 1
        while True:
            t0 = len(self.tokens)
            if t0 + self.k + 1 <= ctx:
                emitted = self.verify(last, self.drafter.propose(last, t0)[:self.k])
            else:  # no room for a whole block before the context end: plain steps
                self.stats.plain_steps += 1
                emitted = [int(np.argmax(self.feed([last])))]
            for j, tok in enumerate(emitted):
                yield tok
                n_out += 1
                # Plain decode has fed last and the j tokens before this one when it yields it.
                if tok in stop_ids or n_out == max_new or t0 + j + 1 >= ctx:
                    return
            last = emitted[-1]

    def _generate_on_device(self, first: int, max_new: int, stop_ids: Sequence[int]) -> list[int]:
        """The tokens after `first` from the device loop; an SSD read failure raises that read's error (as feed)."""
        from jds41.speculative_loop import speculative_generate
        from jds41.tiers.experts import take_failure

        try:
            return speculative_generate(self, self.drafter, first, max_new, stop_ids)[1:]
        except Exception as e:
            cause = take_failure()
            if cause is not None:
                raise cause from e
            raise
