"""The serving scheduler (jds41/scheduler.py, handles.py, batching.py) on the tiny deepseek41 model.

Every test shares one engine (one plan, one slot count), so the batched step compiles once for the module; each
test gets a fresh Scheduler, so its counters start at zero. Prompts stay under PREFILL_CHUNK tokens so the module
never compiles the prefill scan (the chunk/step equivalence it relies on is tested in test_model_reference.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from jds41 import batching
from jds41 import model as M
from jds41 import scheduler as S
from jds41.engine import PREFILL_CHUNK, Engine, RequestError, SamplingParams

CTX = 64
N_SLOTS = 4
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def engine(synthetic_model):
    return Engine.open(str(synthetic_model("deepseek41", "tiny")), max_ctx=CTX)


@pytest.fixture
def sched(engine):
    s = S.Scheduler(engine, n_slots=N_SLOTS, max_queue=8)
    s.start()
    yield s
    s.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(8, 512, n).tolist()


def _collect(handle: S.Handle) -> tuple[list[S.Token], S.Event]:
    events = list(handle.iter_events(timeout=120))
    assert all(isinstance(e, S.Token) for e in events[:-1])
    return events[:-1], events[-1]


def _ids(tokens: list[S.Token]) -> list[int]:
    return [t.id for t in tokens]


def _wait(cond, timeout: float = 5.0) -> float:
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout, "condition not reached in time"
        time.sleep(0.005)
    return time.perf_counter() - t0


def test_batched_step_agrees_with_decode_step(engine):
    """The vmapped step is the reference one-token step on each slot (up to matmul rounding), whatever the slot."""
    plan, params = engine.plan, engine.params
    prompts = [_prompt(10 + i, 3 + 2 * i) for i in range(N_SLOTS)]
    sessions = [engine.session() for _ in prompts]
    nxt = [int(np.argmax(s.feed(p))) for s, p in zip(sessions, prompts)]
    states = batching.init_slots(plan, N_SLOTS)
    for i, s in enumerate(sessions):
        states = batching.write_slot(states, jnp.int32(N_SLOTS - 1 - i), s.state)  # reversed slot order
    np.testing.assert_array_equal(batching.read_slot(states, jnp.int32(N_SLOTS - 1))["pos"], len(prompts[0]))
    order = list(reversed(range(N_SLOTS)))
    rows = np.stack([engine.engram_rows([nxt[i]], prompts[i])[0] for i in order])
    logits, states = batching.batched_step(plan, params, states, jnp.asarray([nxt[i] for i in order], jnp.int32),
                                           jnp.asarray(rows))
    ref = np.stack([M.decode_step(plan, params, sessions[i].state, jnp.int32(nxt[i]),
                                  jnp.asarray(engine.engram_rows([nxt[i]], prompts[i])[0]))[0] for i in order])
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5, rtol=0)


def test_greedy_alone_equals_batched(sched):
    """A request's greedy tokens are bit-identical alone or beside 3 other requests, and nothing recompiles."""
    prompt = _prompt(1, 9)
    alone, fin = _collect(sched.submit(S.GenRequest(prompt, 12, GREEDY, logprobs=3)))
    assert fin.reason == "length" and len(alone) == 12
    compiled = batching.batched_step._cache_size()
    # Submitted third, so it lands in another slot, beside requests of other lengths and sampling settings.
    others = [sched.submit(S.GenRequest(_prompt(2, 5), 20, GREEDY)),
              sched.submit(S.GenRequest(_prompt(3, 14), 7, SamplingParams(temperature=0.9, seed=3)))]
    together = sched.submit(S.GenRequest(prompt, 12, GREEDY, logprobs=3))
    others.append(sched.submit(S.GenRequest(_prompt(4, 2), 16, GREEDY)))
    batched, _ = _collect(together)
    for h in others:
        assert _collect(h)[1].reason == "length"
    assert _ids(batched) == _ids(alone)
    assert [t.logprob for t in batched] == [t.logprob for t in alone]
    assert batching.batched_step._cache_size() == compiled
    for t in alone:  # greedy: the sampled token is the best of the top-n, best first
        assert t.top[0] == (t.id, t.logprob) and [lp for _, lp in t.top] == sorted((lp for _, lp in t.top),
                                                                                  reverse=True)
        assert np.exp([lp for _, lp in t.top]).sum() <= 1.0


def test_more_requests_than_slots_all_complete(engine):
    sched = S.Scheduler(engine, n_slots=N_SLOTS, max_queue=8)
    lengths = [3, 5, 8, 4, 6, 2]  # N + 2 requests, all queued before the loop starts
    handles = [sched.submit(S.GenRequest(_prompt(20 + i, 4 + i), n, GREEDY)) for i, n in enumerate(lengths)]
    assert sched.stats.waiting == N_SLOTS + 2 and sched.stats.running == 0
    sched.start()
    try:
        results = [_collect(h) for h in handles]
    finally:
        sched.stop()
    assert [len(toks) for toks, _ in results] == lengths
    assert all(f.reason == "length" for _, f in results)
    queued = [f.queue_s for _, f in results]
    assert min(queued[N_SLOTS:]) > max(queued[:N_SLOTS])  # the last two waited for a slot to free
    assert sched.stats.running == sched.stats.waiting == 0


def test_cancel_frees_slot_and_gauges_return_to_zero(sched):
    running = [sched.submit(S.GenRequest(_prompt(30 + i, 6), 50, GREEDY)) for i in range(N_SLOTS)]
    waiting = sched.submit(S.GenRequest(_prompt(40, 6), 50, GREEDY))
    first = next(running[0].iter_events(timeout=120))
    assert isinstance(first, S.Token)
    _wait(lambda: sched.stats.running == N_SLOTS and sched.stats.waiting == 1)
    waiting.cancel()
    t0 = time.perf_counter()
    running[0].cancel()
    _wait(lambda: sched.stats.waiting == 0)
    _, fin = _collect(running[0])
    assert fin.reason == "cancelled" and time.perf_counter() - t0 < 1.0
    never_ran, fin_waiting = _collect(waiting)
    assert not never_ran and (fin_waiting.reason, fin_waiting.completion_tokens) == ("cancelled", 0)
    for h in running[1:]:
        h.cancel()
    _wait(lambda: sched.stats.running == 0 and sched.stats.waiting == 0, timeout=1.0)
    assert sched.stats.request_success_total["cancelled"] == N_SLOTS + 1
    assert sched.stats.kv_cache_usage_perc == 0.0


def test_disconnected_async_consumer_cancels_and_leaks_nothing(sched):
    """A consumer that goes away (its task cancelled, or the event stream closed early, as a server does when a
    client disconnects) cancels the request; the scheduler then keeps no reference to it."""
    async def close_after_two() -> S.Handle:
        handle = sched.submit(S.GenRequest(_prompt(50, 5), 50, GREEDY))
        async with contextlib.aclosing(handle.events()) as events:
            async for ev in events:
                if isinstance(ev, S.Token):
                    break
        return handle

    async def cancel_task() -> S.Handle:
        handle = sched.submit(S.GenRequest(_prompt(51, 5), 50, GREEDY))
        started = asyncio.Event()

        async def consume():
            async for _ in handle.events():
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return handle

    handles = [asyncio.run(close_after_two()), asyncio.run(cancel_task())]
    assert all(h.cancelled for h in handles)
    _wait(lambda: sched.stats.running == 0, timeout=1.0)
    assert sched.stats.request_success_total["cancelled"] == 2
    refs = [weakref.ref(h) for h in handles]
    del handles
    gc.collect()
    assert all(r() is None for r in refs)
    toks, fin = _collect(sched.submit(S.GenRequest(_prompt(52, 5), 4, GREEDY)))  # the loop still serves
    assert fin.reason == "length" and len(toks) == 4


def test_warmup_then_long_prompt_prefilled_over_iterations(engine):
    """After warmup() serving compiles nothing; a prompt longer than the per-iteration prefill budget is fed over
    several iterations beside a decoding request and gives the tokens it gives when prefilled in one go."""
    sched = S.Scheduler(engine, n_slots=N_SLOTS, prefill_budget=PREFILL_CHUNK)
    sched.warmup()
    programs = (M.prefill, M.decode_step, batching.batched_step, batching.write_slot)
    compiled = [f._cache_size() for f in programs]
    sched.start()
    try:
        prompt = _prompt(110, PREFILL_CHUNK + 20)  # one scan chunk in one iteration, 20 steps in the next
        beside = sched.submit(S.GenRequest(_prompt(111, 3), 30, GREEDY))
        next(beside.iter_events(timeout=120))
        pieces, fin = _collect(sched.submit(S.GenRequest(prompt, 8, GREEDY)))
        _collect(beside)
        sched.prefill_budget = S.PREFILL_BUDGET
        whole, _ = _collect(sched.submit(S.GenRequest(prompt, 8, GREEDY)))
    finally:
        sched.stop()
    assert fin.prompt_tokens == len(prompt) and _ids(pieces) == _ids(whole)
    assert [f._cache_size() for f in programs] == compiled


def test_queue_full_and_stop(engine):
    sched = S.Scheduler(engine, n_slots=1, max_queue=2)  # not started: nothing leaves the queue
    handles = [sched.submit(S.GenRequest([9, 10], 4, GREEDY)) for _ in range(3)]  # 1 free slot + 2 waiting
    with pytest.raises(S.QueueFull):
        sched.submit(S.GenRequest([9, 10], 4, GREEDY))
    sched.stop()
    assert all(isinstance(_collect(h)[1], S.Failed) for h in handles)
    with pytest.raises(S.Unavailable):
        sched.submit(S.GenRequest([9, 10], 4, GREEDY))


def test_counters_exact_after_n_requests(sched):
    reqs = [S.GenRequest(_prompt(60 + i, 3 + 4 * i), 2 + i, GREEDY) for i in range(5)]
    for h in [sched.submit(r) for r in reqs]:
        _, fin = _collect(h)
        assert (fin.prompt_tokens, fin.completion_tokens) == (len(h.request.prompt), h.request.max_tokens)
        assert 0 <= fin.queue_s <= fin.ttft_s <= fin.e2e_s
    st = sched.stats
    assert st.prompt_tokens_total == sum(len(r.prompt) for r in reqs)
    assert st.generation_tokens_total == sum(r.max_tokens for r in reqs)
    assert st.request_success_total == {"stop": 0, "length": 5, "cancelled": 0}
    obs = st.drain_observations()
    assert {k: len(v) for k, v in obs.items()} == {"ttft_s": 5, "itl_s": sum(r.max_tokens - 1 for r in reqs),
                                                   "e2e_s": 5, "queue_s": 5}
    assert all(len(v) == 0 for v in st.drain_observations().values())
    assert st.running == st.waiting == 0


def test_max_tokens_clamped_to_context(sched, engine):
    prompt = _prompt(70, 20)
    toks, fin = _collect(sched.submit(S.GenRequest(prompt, 1000, GREEDY)))
    assert (fin.reason, fin.completion_tokens, len(toks)) == ("length", CTX - 20, CTX - 20)
    with pytest.raises(S.ContextTooLong, match=f"maximum context length is {CTX} tokens") as e:
        sched.submit(S.GenRequest(_prompt(71, CTX), 4, GREEDY))
    assert (e.value.n_prompt_tokens, e.value.n_ctx) == (CTX, CTX)
    for bad in ([engine.vocab_size], [], [-1]):
        with pytest.raises(RequestError):
            sched.submit(S.GenRequest(bad, 4, GREEDY))


def test_stop_id_ends_with_stop(sched):
    prompt = _prompt(80, 7)
    free, _ = _collect(sched.submit(S.GenRequest(prompt, 10, GREEDY)))
    ids = _ids(free)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    toks, fin = _collect(sched.submit(S.GenRequest(prompt, 10, GREEDY, stop_ids=(ids[k],))))
    assert _ids(toks) == ids[:k]  # the stop token is not sent...
    assert (fin.reason, fin.completion_tokens) == ("stop", k + 1)  # ...but it was generated and is counted
    assert sched.stats.request_success_total["stop"] == 1


def test_seeded_sampling_is_reproducible(sched):
    prompt = _prompt(90, 6)
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    first, _ = _collect(sched.submit(S.GenRequest(prompt, 10, hot)))
    beside = sched.submit(S.GenRequest(_prompt(91, 4), 10, GREEDY))  # a different slot and a companion
    again, _ = _collect(sched.submit(S.GenRequest(prompt, 10, hot)))
    _collect(beside)
    other, _ = _collect(sched.submit(S.GenRequest(prompt, 10, SamplingParams(temperature=1.0, top_p=0.95, seed=1))))
    assert _ids(first) == _ids(again)
    assert _ids(first) != _ids(other)


def test_error_fails_only_the_affected_request(sched, monkeypatch):
    real = S.sample

    def flaky(logits, p, rng):
        if p.seed == 666:
            raise FloatingPointError("injected")
        return real(logits, p, rng)

    monkeypatch.setattr(S, "sample", flaky)
    good = sched.submit(S.GenRequest(_prompt(100, 5), 6, GREEDY))
    bad = sched.submit(S.GenRequest(_prompt(101, 5), 6, SamplingParams(seed=666)))
    _, fin_bad = _collect(bad)
    toks, fin_good = _collect(good)
    assert isinstance(fin_bad, S.Failed) and fin_bad.message == "sampling failed: injected"
    assert fin_good.reason == "length" and len(toks) == 6
    assert sched.stats.request_failure_total == 1 and sched.stats.running == 0
