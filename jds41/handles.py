"""What a caller of the scheduler holds: GenRequest, the Event types, Handle, SchedulerStats and the errors.

`jds41.scheduler` re-exports all of these; the loop that produces the events lives there. A Handle carries events
from the scheduler thread to its consumer through a thread-safe queue: an asyncio consumer (`events()`) is woken
with `call_soon_threadsafe`, a thread without an event loop blocks on `iter_events()`. Cancellation is a flag the
scheduler reads at the start of each iteration.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator

from jds41.engine import RequestError, SamplingParams
from jds41.errors import Jds41Error

OBSERVATIONS_KEPT = 1 << 16  # raw histogram observations kept between two `drain_observations` calls


class Unavailable(Jds41Error):
    """The scheduler cannot take the request now (503 with Retry-After): stopped, or see QueueFull."""


class QueueFull(Unavailable):
    """`max_queue` requests are already waiting."""


class ContextTooLong(RequestError):
    """The prompt leaves no room to generate in the context (400 exceed_context_size_error)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx
        super().__init__(f"this model's maximum context length is {n_ctx} tokens, but the prompt has "
                         f"{n_prompt_tokens} tokens and leaves no room for a completion")


@dataclasses.dataclass(frozen=True)
class GenRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...] = ()  # e.g. eos; the stop token is not part of the output text
    logprobs: int = 0  # 0 = none; n > 0: the sampled token's logprob and the top-n logprobs per generated token


class Event:
    """Base of what a Handle yields."""


@dataclasses.dataclass(frozen=True)
class Token(Event):
    id: int
    logprob: float | None = None  # log-softmax of the raw logits (temperature 1), when logprobs > 0
    top: list[tuple[int, float]] | None = None  # the top-n (id, logprob), best first, when logprobs > 0


@dataclasses.dataclass(frozen=True)
class Finished(Event):
    reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int  # sampled tokens, a final stop token included
    queue_s: float  # submit -> admitted into a slot
    ttft_s: float  # submit -> first token sampled (= e2e_s when no token was)
    e2e_s: float  # submit -> finished
    draft_tokens: int = 0  # speculative lane (serve --draft): draft tokens proposed for this request, and accepted
    draft_accepted: int = 0


@dataclasses.dataclass(frozen=True)
class Failed(Event):
    message: str


@dataclasses.dataclass
class SchedulerStats:
    """Gauges and counters, written by the scheduler thread (and, under its lock, by `submit` dropping cancelled
    waiters); plain int reads are safe from any thread, and every update lands before the event it concerns.

    Histogram observations are kept raw in bounded deques; the metrics endpoint moves them into its histograms
    with `drain_observations()` (one consumer), so memory stays bounded even if nobody scrapes.
    """

    running: int = 0
    waiting: int = 0
    n_slots: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    request_success_total: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0})
    request_failure_total: int = 0
    draft_tokens_total: int = 0  # speculative lane (serve --draft): draft tokens proposed, and of them accepted
    draft_accepted_total: int = 0
    ttft_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=OBSERVATIONS_KEPT))
    itl_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=OBSERVATIONS_KEPT))
    e2e_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=OBSERVATIONS_KEPT))
    queue_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=OBSERVATIONS_KEPT))

    @property
    def kv_cache_usage_perc(self) -> float:
        """Each slot reserves a whole context, so the cache in use is the share of occupied slots."""
        return self.running / self.n_slots if self.n_slots else 0.0

    def drain_observations(self) -> dict[str, list[float]]:
        """Take the raw observations gathered since the last call: {"ttft_s", "itl_s", "e2e_s", "queue_s"}."""
        out = {}
        for name in ("ttft_s", "itl_s", "e2e_s", "queue_s"):
            d = getattr(self, name)
            out[name] = [d.popleft() for _ in range(len(d))]  # popleft is atomic against the thread's appends
        return out


class Handle:
    """One submitted request, as its caller sees it. Events cross from the scheduler thread through a thread-safe
    queue; an asyncio consumer is woken with `call_soon_threadsafe`, a synchronous one blocks on the queue."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop | None, wake_scheduler):
        self.id = f"req-{uuid.uuid4().hex[:24]}"
        self.request = request
        self._loop = loop
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._ready = asyncio.Event()  # binds to a loop on first wait (3.10+), so creating it here is safe
        self._cancelled = threading.Event()
        self._ended = False  # the consumer has seen the final event
        self._wake_scheduler = wake_scheduler

    def cancel(self) -> None:
        """Thread-safe; the scheduler frees the slot at its next iteration and sends Finished("cancelled")."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake_scheduler()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def events(self) -> AsyncIterator[Event]:
        """Tokens, then one Finished or Failed. A consumer that goes away cancels the request: its task cancelled
        while awaiting, or the generator closed (`aclose()`, `contextlib.aclosing`; a bare `break` only closes it
        when it is garbage collected)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()  # set before the queue is checked: no event can be missed
        try:
            while True:
                try:
                    ev = self._events.get_nowait()
                except queue.Empty:
                    self._ready.clear()
                    if self._events.empty():
                        await self._ready.wait()
                    continue
                if isinstance(ev, (Finished, Failed)):
                    self._ended = True
                yield ev
                if self._ended:
                    return
        finally:
            if not self._ended:
                self.cancel()

    def iter_events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking form of `events()` for threads without an event loop (CLIs, tests); queue.Empty on timeout."""
        while not self._ended:
            ev = self._events.get(timeout=timeout)
            self._ended = isinstance(ev, (Finished, Failed))
            yield ev

    def _put(self, ev: Event) -> None:
        self._events.put(ev)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the consumer's loop is closed: nobody will read this request
                self._cancelled.set()
