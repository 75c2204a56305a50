"""Serving scheduler: N slots, a bounded FIFO queue, continuous batching on one background thread.

The HTTP layer (jds41/serve/) only sees this API: `Scheduler.submit(GenRequest) -> Handle`, whose `events()`
yields `Token`s then one `Finished` (or one `Failed`), and `Handle.cancel()`. Each loop iteration
  1. drops cancelled requests (running or waiting) and frees their slots,
  2. admits waiting requests into free slots, first come first served,
  3. prefills admitted prompts through a per-request `Session` (at most `prefill_budget` prompt tokens per
     iteration, so a long prompt does not stall the running requests for its whole length), writing a finished
     prefill's state into its slot of the stacked state,
  4. runs ONE `batching.batched_step` for all slots and samples each running request's next token on the host
     with its own RNG (`engine.sample`), exactly as `Session.generate` does.
Token ids, Engram rows and sampling stay on the host; the device only ever sees the fixed-shape batched step.

A tiered engine (`serve --profile lucebox`, any profile that puts experts in pinned host memory or on the SSD)
keeps every request's state in its own `Session` instead: the vmapped batched step cannot move pinned-host rows or
call the SSD tier per slot, and a tiered step is bound by moving experts, which the slots would not share anyway.
Each iteration then feeds each running request one token through the single-sequence step (sampled requests and
logprobs), or runs up to `draft_chunk` tokens of the greedy device loop (jds41/decode_loop.greedy_generate) for a
greedy one; their tokens are those of `Session.generate` bit for bit. Its prompts are fed a whole prefill chunk per
iteration by default (`default_prefill_budget`): each fed slice is its own layer-major group, which moves the union
of its experts from host memory and the SSD, and a 256-token slice already touches nearly every expert of a layer.

With a drafter (`serve --draft`), greedy requests without logprobs take the speculative lane instead: their prompt
is read by a `SpeculativeSession` (which hands the drafter the target features), their state stays in that session
rather than in the stacked slots, and each iteration runs up to `draft_chunk` tokens of the DSpark device loop
(jds41/speculative_loop.py) for each of them before the batched step of the others. Their tokens are those of
`Session.generate` (`python -m jds41.generate`) bit for bit; the batched step agrees with that only to float
rounding (batching.py), so a near-tie may resolve differently with and without --draft. Tokens of a drafted chunk
arrive together, so their inter-token latencies are near zero and the chunk's wait lands on the first.

Counting: a stop token is sampled and counted (completion_tokens, generation_tokens_total) like any other, but
it is not sent as a `Token` event: it is not part of the output text. `max_tokens` is clamped to the context
left after the prompt (prompt + completion <= max_ctx); reaching either limit finishes with "length".
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import copy
import dataclasses
import itertools
import logging
import threading
import time
import weakref

import jax.numpy as jnp
import numpy as np

from jds41 import batching
from jds41.decode_loop import MAX_STOP_IDS, greedy_generate
from jds41.engine import PREFILL_CHUNK, Engine, RequestError, SamplingParams, Session, sample
from jds41.handles import (
    ContextTooLong,
    Event,
    Failed,
    Finished,
    GenRequest,
    Handle,
    QueueFull,
    SchedulerStats,
    Token,
    Unavailable,
)
from jds41.prompt_pieces import chunk_tokens, piece_lengths

__all__ = ["ContextTooLong", "Event", "Failed", "Finished", "GenRequest", "Handle", "QueueFull", "RequestError",
           "SamplingParams", "Scheduler", "SchedulerStats", "Token", "Unavailable"]

log = logging.getLogger(__name__)

PREFILL_BUDGET = 8 * PREFILL_CHUNK  # prompt tokens prefilled per iteration, across all admitted requests
DRAFT_CHUNK = 16  # tokens a drafted request decodes per iteration (one compiled device loop for every chunk)

# A daemon thread still inside XLA when the interpreter finalizes aborts the process ("FATAL: exception not
# rethrown"), so schedulers left running are stopped at exit. Held weakly: a dropped scheduler is not kept alive.
_RUNNING: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for sched in list(_RUNNING):
        sched.stop()


@dataclasses.dataclass
class _Slot:
    """A request in a slot: prefilling while `session` is set, then decoding with `pending` to feed next."""

    handle: Handle
    limit: int  # max_tokens clamped to the context left after the prompt
    rng: np.random.Generator
    t_submit: float
    t_admit: float
    session: Session | None
    drafted: Session | None = None  # the speculative lane's session once its prompt is read (state lives there)
    alone: Session | None = None  # a tiered engine's request: its session once its prompt is read (state there)
    fed: int = 0  # prompt tokens prefilled so far
    history: list[int] = dataclasses.field(default_factory=list)  # newest ids, for the Engram hash
    pending: int | None = None
    generated: int = 0
    t_first: float | None = None
    t_last: float = 0.0


def default_prefill_budget(engine: Engine) -> int:
    """Prompt tokens fed per iteration: PREFILL_BUDGET, or for a tiered engine at least one whole prefill chunk, so
    a long prompt moves each layer's experts once per chunk as `generate` does, not once per 256 tokens (DESIGN.md
    §9: 1K-token chunks touch nearly every expert each time)."""
    if engine.tiers is None:
        return PREFILL_BUDGET
    return max(PREFILL_BUDGET, chunk_tokens(engine.prefill_chunk, engine.plan.decode_width))


class Scheduler:
    def __init__(self, engine: Engine, n_slots: int = 4, max_queue: int = 64, prefill_budget: int | None = None,
                 drafter=None, draft_chunk: int = DRAFT_CHUNK):
        prefill_budget = default_prefill_budget(engine) if prefill_budget is None else prefill_budget
        if n_slots < 1 or max_queue < 0 or prefill_budget < 1 or draft_chunk < 1:
            raise ValueError("n_slots, prefill_budget and draft_chunk must be >= 1, max_queue >= 0")
        self.engine, self.n_slots, self.max_queue, self.prefill_budget = engine, n_slots, max_queue, prefill_budget
        self.drafter, self.draft_chunk = drafter, draft_chunk  # a DSparkDrafter: each drafted request copies it
        self.own_sessions = engine.tiers is not None  # every request decodes in its own session (module docstring)
        if drafter is not None:
            self._spec_session()  # a drafter whose block does not fit the engine's decode width fails here, at load
        self.stats = SchedulerStats(n_slots=n_slots)
        self._cv = threading.Condition()
        self._waiting: collections.deque[tuple[Handle, float]] = collections.deque()
        self._slots: list[_Slot | None] = [None] * n_slots
        self._states: dict | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Engram hashes look back max_ngram - 1 ids; a free slot's dummy step needs rows of the right shape.
        self._history_len = engine.engram[0].n - 1 if engine.engram is not None else 0
        rows = engine.engram_rows([0], [])
        self._dummy_rows = None if rows is None else rows[0]

    # ---- caller side ---------------------------------------------------------------------------------------
    def _prompt_lengths(self) -> list[int]:
        """Feeds that compile every prompt piece `_prefill` can run: it feeds at most `prefill_budget` tokens of a
        prompt per iteration, and a prompt is shorter than the context."""
        eng = self.engine
        longest = min(self.prefill_budget, eng.max_ctx - 1)
        return piece_lengths(longest, eng.plan.decode_width, eng.prefill_chunk, eng.tiers is not None,
                             eng.plan.prompt_width)

    def warmup(self) -> None:
        """Compile every program a request runs (each prompt piece: layer-major groups, scan, one-token step; slot
        write, batched step, device loops) now, e.g. while the server still answers 503 loading, so no request
        pays for compilation. Until now only the scan and the step were warmed: the first prompt of 64 tokens or
        more compiled its layer-major piece (tens of seconds under lucebox on the H200) while clients waited."""
        if self._thread is not None:
            raise RuntimeError("warmup() must run before start()")
        for n in self._prompt_lengths():
            self.engine.session().feed([0] * n)
        session = self.engine.session()
        session.feed([0])  # the decode programs below, from a short context
        if self.own_sessions:  # the greedy device loop of the own-session lane (the one-token step is compiled above)
            greedy_generate(session, 0, self.draft_chunk + 1)
        else:
            states = batching.write_slot(batching.init_slots(self.engine.plan, self.n_slots), jnp.int32(0),
                                         session.state)
            logits, states = self._step(states, np.zeros(self.n_slots, np.int32), self._dummy_batch_rows())[:2]
            # a slot written into the step's output (committed arrays, unlike init_slots' zeros) is another program
            batching.write_slot(states, jnp.int32(0), session.state)
            logits.block_until_ready()
        if self.drafter is not None:  # the speculative lane's prompt pieces and its device loop
            from jds41.speculative_loop import speculative_generate

            for n in self._prompt_lengths():
                self._spec_session().feed([0] * n)
            spec = self._spec_session()
            first = int(np.argmax(spec.feed([0] * min(PREFILL_CHUNK + 1, self.engine.max_ctx // 2))))
            speculative_generate(spec, spec.drafter, first, self.draft_chunk + 1)

    def _fresh_slots(self) -> dict | None:
        """The batched step's zeroed slot states; None when every request decodes in its own session (building
        them compiles a small program per state leaf, which such a server never warms up)."""
        return None if self.own_sessions else batching.init_slots(self.engine.plan, self.n_slots)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._states = self._fresh_slots()
        self._thread = threading.Thread(target=self._run, name="jds41-scheduler", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def stop(self, timeout: float | None = 10.0) -> None:
        """End the loop after its current iteration; every request still running or waiting gets Failed."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)  # the thread fails its own requests on the way out
        else:
            self._shutdown()
        _RUNNING.discard(self)

    def _shutdown(self) -> None:
        with self._cv:
            for i, s in enumerate(self._slots):
                if s is not None:
                    self._fail(i, "the server is shutting down")
            waiting, self._waiting = self._waiting, collections.deque()
            self._update_gauges()
        for handle, _ in waiting:
            handle._put(Failed("the server is shutting down"))

    def submit(self, req: GenRequest, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Queue a request. Raises RequestError (ContextTooLong) for a bad request, QueueFull / Unavailable."""
        self._validate(req)
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None  # bound later by events(), or consumed with iter_events()
        handle = Handle(req, loop, self._wake)
        with self._cv:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            # Requests the next iteration admits into free slots do not count against the queue bound, nor do
            # cancelled ones the loop has not dropped yet (clients that just gave up, e.g. on a timeout).
            free = sum(s is None for s in self._slots)
            if len(self._waiting) >= self.max_queue + free:
                self._drop_cancelled_waiting(time.perf_counter())
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append((handle, time.perf_counter()))
            self._update_gauges()
            self._cv.notify_all()
        return handle

    def _drafts(self, req: GenRequest) -> bool:
        """Whether a request takes the speculative lane (a drafter, and a request a device loop can decode)."""
        return self.drafter is not None and _greedy_loopable(req)

    def _spec_session(self):
        """A SpeculativeSession with its own copy of the drafter (shared weights, fresh window rings)."""
        from jds41.speculative import SpeculativeSession

        drafter = copy.copy(self.drafter)
        drafter.reset()
        return SpeculativeSession(self.engine, drafter)

    def _validate(self, req: GenRequest) -> None:
        V, ctx = self.engine.vocab_size, self.engine.max_ctx
        if not req.prompt:
            raise RequestError("the prompt is empty")
        for t in itertools.chain(req.prompt, req.stop_ids):
            if not isinstance(t, (int, np.integer)) or not 0 <= t < V:
                raise RequestError(f"token id {t!r} is outside the vocabulary [0, {V})")
        if len(req.prompt) >= ctx:
            raise ContextTooLong(len(req.prompt), ctx)
        if req.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if not 0 <= req.logprobs <= V:
            raise RequestError(f"logprobs must be in [0, {V}], got {req.logprobs}")

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ---- the loop ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not any(self._slots):
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self._iteration()
            except Exception as e:  # a bug outside the per-request guards: fail what is running, keep serving
                log.exception("scheduler iteration failed")
                with self._cv:
                    for i, s in enumerate(self._slots):
                        if s is not None:
                            self._fail(i, f"internal error: {e}")
                    self._update_gauges()
                self._states = self._fresh_slots()
        self._shutdown()

    def _iteration(self) -> None:
        with self._cv:
            self._reap_cancelled()
            self._admit()
        self._prefill()
        self._decode()
        with self._cv:
            self._update_gauges()

    def _reap_cancelled(self) -> None:
        now = time.perf_counter()
        for i, s in enumerate(self._slots):
            if s is not None and s.handle.cancelled:
                self._finish(i, "cancelled", now)
        self._drop_cancelled_waiting(now)

    def _drop_cancelled_waiting(self, now: float) -> None:
        """Under the lock (submit's thread or the loop's): the "cancelled" counter is only written under it."""
        gone = [(h, t) for h, t in self._waiting if h.cancelled]
        if gone:
            self._waiting = collections.deque((h, t) for h, t in self._waiting if not h.cancelled)
            self._update_gauges()
        for handle, t_submit in gone:
            self.stats.request_success_total["cancelled"] += 1
            e2e = now - t_submit
            handle._put(Finished("cancelled", len(handle.request.prompt), 0, e2e, e2e, e2e))

    def _admit(self) -> None:
        now = time.perf_counter()
        for i in range(self.n_slots):
            if self._slots[i] is None and self._waiting:
                handle, t_submit = self._waiting.popleft()
                req = handle.request
                drafted = self._drafts(req)
                self._slots[i] = _Slot(handle=handle, limit=min(req.max_tokens, self.engine.max_ctx - len(req.prompt)),
                                       rng=np.random.default_rng(req.sampling.seed), t_submit=t_submit, t_admit=now,
                                       session=self._spec_session() if drafted else self.engine.session())
                # prefix cache (issue #10): resume from the longest cached prefix, leaving >= 1 token to compute
                # (not in the speculative lane: its state has the verify block's ring slack, and its drafter the
                # features of every prompt position, which a snapshot does not carry)
                if not drafted:
                    self._slots[i].fed = handle.cached_tokens = self._slots[i].session.restore_prefix(
                        req.prompt, len(req.prompt) - 1)
                self.stats.queue_s.append(now - t_submit)
                self._update_gauges()

    def _prefill(self) -> None:
        """Feed admitted prompts, oldest admission first, up to `prefill_budget` tokens in this iteration."""
        budget = self.prefill_budget
        prefilling = sorted((s.t_admit, i) for i, s in enumerate(self._slots) if s is not None and s.session)
        for _, i in prefilling:
            if budget <= 0:
                break
            s = self._slots[i]
            prompt = s.handle.request.prompt
            n = _feed_length(len(prompt) - s.fed, budget)
            budget -= n
            try:
                if s.fed + n < len(prompt):  # its Engram rows are read while this feed's last piece runs
                    after = s.fed + n
                    s.session.read_next(prompt[after:after + _feed_length(len(prompt) - after, self.prefill_budget)])
                logits = s.session.feed(prompt[s.fed:s.fed + n])
                s.fed += n
                if s.fed < len(prompt):
                    continue
                if self._drafts(s.handle.request):
                    s.drafted = s.session  # decodes in the speculative lane, from its own state
                elif self.own_sessions:
                    s.alone = s.session  # a tiered engine: decodes in its own session
                else:
                    self._states = batching.write_slot(self._states, jnp.int32(i), s.session.state)
            except Exception as e:
                log.exception("prefill failed for %s", s.handle.id)
                self._fail(i, f"prefill failed: {e}")
                continue
            if s.drafted is None:
                s.session.save_prefix(logits)  # prefix cache (issue #10): a later turn resumes from this prompt
            s.history = s.session.tokens[-self._history_len:] if self._history_len else []
            s.session = None  # its state now lives in the slot (or in s.drafted); drop the reference
            self.stats.prompt_tokens_total += len(prompt)
            self._accept_guarded(i, logits)

    def _decode(self) -> None:
        for i, s in enumerate(self._slots):
            if s is not None and s.pending is not None and s.drafted is not None:
                self._decode_drafted(i)
            elif s is not None and s.pending is not None and s.alone is not None:
                self._decode_alone(i)
        live = [i for i, s in enumerate(self._slots)
                if s is not None and s.pending is not None and s.drafted is None and s.alone is None]
        if not live:
            return
        tokens = np.zeros(self.n_slots, np.int32)  # free and prefilling slots step a dummy token 0
        rows = self._dummy_batch_rows()
        try:
            for i in live:
                s = self._slots[i]
                tokens[i] = s.pending
                if rows is not None:
                    rows[i] = self.engine.engram_rows([s.pending], s.history)[0]
                if self._history_len:
                    s.history = (s.history + [s.pending])[-self._history_len:]
                s.pending = None
            logits, self._states = self._step(self._states, tokens, rows)
            logits = np.asarray(logits, np.float32)
        except Exception as e:  # the donated state may be gone: fail the slots that lived in it, start afresh
            log.exception("batched step failed")
            for i, s in enumerate(self._slots):
                if s is not None and s.session is None and s.drafted is None and s.alone is None:
                    self._fail(i, f"decode failed: {e}")
            self._states = self._fresh_slots()
            return
        for i in live:
            self._accept_guarded(i, logits[i])

    def _decode_alone(self, i: int) -> None:
        """Slot i of a tiered engine, in its own session: up to draft_chunk greedy tokens in one device loop, or
        one token through the single-sequence step (sampling, logprobs, many stop ids); only this request fails
        if it fails."""
        s = self._slots[i]
        req = s.handle.request
        tok, s.pending = s.pending, None
        looped = _greedy_loopable(req)
        try:
            if looped:  # the request's last chunk stops at its limit; one compiled loop serves every chunk
                out = greedy_generate(s.alone, tok, min(self.draft_chunk, s.limit - s.generated) + 1, req.stop_ids,
                                      n_max=self.draft_chunk + 1)
            else:
                logits = s.alone.feed([tok])
        except Exception as e:
            log.exception("decode failed for %s", s.handle.id)
            self._fail(i, f"decode failed: {e}")
            return
        if looped:
            self._emit_chunk(i, s, out)
        else:
            self._accept_guarded(i, logits)

    def _emit_chunk(self, i: int, s: _Slot, out: list[int]) -> None:
        """Tokens of a device-loop chunk that began with the fed token `out[0]`: every one but the newest was fed,
        and the newest is fed by the next chunk."""
        if len(out) < 2:  # no room left in the context (the limit normally ends the request first)
            self._finish(i, "length", time.perf_counter())
            return
        s.pending = None
        for tok in out[1:]:
            self._emit(i, tok)
            if self._slots[i] is not s:
                return

    def _decode_drafted(self, i: int) -> None:
        """Up to draft_chunk tokens of slot i from the DSpark device loop; only this request fails if it fails."""
        from jds41.speculative_loop import speculative_generate

        s = self._slots[i]
        spec, stats = s.drafted, s.drafted.stats
        drafted, accepted = stats.drafted, stats.accepted
        try:
            out = speculative_generate(spec, spec.drafter, s.pending, self.draft_chunk + 1, s.handle.request.stop_ids)
        except Exception as e:
            log.exception("drafted decode failed for %s", s.handle.id)
            self._fail(i, f"decode failed: {e}")
            return
        self.stats.draft_tokens_total += stats.drafted - drafted
        self.stats.draft_accepted_total += stats.accepted - accepted
        self._emit_chunk(i, s, out)

    def _step(self, states: dict, tokens: np.ndarray, rows: np.ndarray | None):
        return batching.batched_step(self.engine.plan, self.engine.params, states, jnp.asarray(tokens),
                                     None if rows is None else jnp.asarray(rows))

    def _dummy_batch_rows(self) -> np.ndarray | None:
        return None if self._dummy_rows is None else np.repeat(self._dummy_rows[None], self.n_slots, axis=0)

    # ---- per request ---------------------------------------------------------------------------------------
    def _accept_guarded(self, i: int, logits: np.ndarray) -> None:
        try:
            self._accept(i, logits)
        except Exception as e:  # e.g. NaN logits under top-p: only this request fails
            log.exception("sampling failed for %s", self._slots[i].handle.id)
            self._fail(i, f"sampling failed: {e}")

    def _accept(self, i: int, logits: np.ndarray) -> None:
        """Sample slot i's next token from its logits and decide whether the request goes on."""
        s = self._slots[i]
        self._emit(i, sample(logits, s.handle.request.sampling, s.rng), logits)

    def _emit(self, i: int, tok: int, logits: np.ndarray | None = None) -> None:
        """Slot i produced `tok`: send it (logprobs from `logits`), or finish on a stop id or the limit."""
        s = self._slots[i]
        req = s.handle.request
        now = time.perf_counter()
        s.generated += 1
        self.stats.generation_tokens_total += 1
        if s.t_first is None:
            s.t_first = now
            self.stats.ttft_s.append(now - s.t_submit)
        else:
            self.stats.itl_s.append(now - s.t_last)
        s.t_last = now
        if tok in req.stop_ids:
            self._finish(i, "stop", now)
            return
        s.handle._put(Token(tok, *_logprobs(logits, tok, req.logprobs)) if req.logprobs and logits is not None
                      else Token(tok))
        if s.generated >= s.limit:
            self._finish(i, "length", now)
        else:
            s.pending = tok

    # Slot, gauges and counters change BEFORE the final event is sent: whoever sees Finished sees them settled.
    def _finish(self, i: int, reason: str, now: float) -> None:
        s = self._release(i)
        e2e = now - s.t_submit
        ttft = e2e if s.t_first is None else s.t_first - s.t_submit
        self.stats.request_success_total[reason] += 1
        if reason != "cancelled":
            self.stats.e2e_s.append(e2e)
        drafts = s.drafted.stats if s.drafted is not None else None
        s.handle._put(Finished(reason, len(s.handle.request.prompt), s.generated, s.t_admit - s.t_submit, ttft, e2e,
                               drafts.drafted if drafts else 0, drafts.accepted if drafts else 0))

    def _fail(self, i: int, message: str) -> None:
        s = self._release(i)
        self.stats.request_failure_total += 1
        s.handle._put(Failed(message))

    def _release(self, i: int) -> _Slot:
        s, self._slots[i] = self._slots[i], None
        self._update_gauges()
        return s

    def _update_gauges(self) -> None:
        self.stats.running = sum(s is not None for s in self._slots)
        self.stats.waiting = len(self._waiting)


def _feed_length(remaining: int, budget: int) -> int:
    """Prompt tokens one feed takes: up to the budget, in whole chunks unless it is the prompt's tail (whole chunks
    go through the scan; only a prompt's tail is fed by steps)."""
    n = min(remaining, budget)
    if n < remaining and n >= PREFILL_CHUNK:
        n -= n % PREFILL_CHUNK
    return n


def _greedy_loopable(req: GenRequest) -> bool:
    """Whether a device loop can decode the request: greedy, no logprobs (the loop keeps no logits), few stops."""
    return req.sampling.temperature == 0 and not req.logprobs and len(req.stop_ids) <= MAX_STOP_IDS


def _logprobs(logits: np.ndarray, tok: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's log-softmax and the top-n (id, logprob), best first (lower id first on ties)."""
    z = logits.astype(np.float64)
    lse = z.max() + np.log(np.exp(z - z.max()).sum())
    n = min(n, len(z))
    top = np.argpartition(-z, n - 1)[:n]
    top = top[np.lexsort((top, -z[top]))]
    return float(z[tok] - lse), [(int(t), float(z[t] - lse)) for t in top]
