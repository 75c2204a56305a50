"""Engram rows read ahead (jds41/engine.py `Session._pieces`): a feed reads piece k + 1's rows on a worker thread
while piece k is dispatched and computed, each piece still gets exactly its own rows, and a read never outlives
its feed: its error surfaces from `feed`, and a feed stopped by its piece waits for the read in flight. A caller
that feeds a prompt a chunk per call says what comes next (`Session.read_next`; the server's scheduler does), and
that chunk's rows are read during the feed before.

Overlap is proven by a rendezvous, not by timing: the read of piece k + 1 waits until piece k's `run_piece` has
been entered, and piece k's `run_piece` waits until that read has started. Both are then in flight together; a
serial design (reading after `run_piece` returns) makes the run wait in vain, which is recorded as a failure.

References: the rows of the whole prompt read in one call (each token's rows depend only on its own n - 1
predecessors, so slicing them per piece is an independent derivation of every piece's rows), and the same prompt
fed one piece per `feed` call (each feed reads its rows before its piece, with nothing to read ahead).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jds41 import engine as E
from jds41.engine import READ_AHEAD_THREAD, Engine
from jds41.prompt_pieces import prompt_pieces
from jds41.tiers.ssd import ExpertReadError

RENDEZVOUS_S = 5.0  # how long one side waits for the other before the test records a serial design


@pytest.fixture(scope="module")
def engine(synthetic_model):
    return Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=64, prefill_chunk=8)


def _prompt(engine: Engine) -> tuple[list[int], list[int], list[int]]:
    """A prompt of at least three pieces, the lengths of its pieces and where each starts."""
    tokens = np.random.default_rng(5).integers(8, engine.vocab_size, 21).tolist()
    lengths = [n for _, n in prompt_pieces(len(tokens), engine.plan.decode_width, engine.prefill_chunk, False,
                                           engine.plan.prompt_width)]
    assert len(lengths) >= 3
    return tokens, lengths, [int(s) for s in np.cumsum([0] + lengths[:-1])]


def _readers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(READ_AHEAD_THREAD)]


def test_each_pieces_rows_are_read_while_the_piece_before_it_runs(engine, monkeypatch):
    tokens, lengths, starts = _prompt(engine)
    want_rows = engine.engram_rows(tokens, [])

    read_started = [threading.Event() for _ in lengths]
    run_entered = [threading.Event() for _ in lengths]
    failures, given = [], []
    real_run, real_rows = E.run_piece, engine.engram_rows

    def rows(new, history):
        k = starts.index(len(history))
        read_started[k].set()
        if k and not run_entered[k - 1].wait(RENDEZVOUS_S):
            failures.append(f"the read of piece {k} ran without piece {k - 1} being dispatched")
        return real_rows(new, history)

    def run(plan, params, state, how, piece, rows, *rest):
        k = len(given)
        given.append(np.asarray(rows))
        run_entered[k].set()
        if k + 1 < len(lengths) and not read_started[k + 1].wait(RENDEZVOUS_S):
            failures.append(f"piece {k} was dispatched without the read of piece {k + 1} in flight")
        return real_run(plan, params, state, how, piece, rows, *rest)

    monkeypatch.setattr(E, "run_piece", run)
    monkeypatch.setattr(engine, "engram_rows", rows)
    got = engine.session().feed(tokens)
    monkeypatch.undo()

    assert failures == []
    assert all(e.is_set() for e in read_started) and len(given) == len(lengths)
    assert _readers_alive() == []
    for k, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        np.testing.assert_array_equal(given[k], want_rows[start:start + n], err_msg=f"piece {k}")

    one_by_one = engine.session()
    for start, n in zip(starts, lengths, strict=True):
        want = one_by_one.feed(tokens[start:start + n])
    np.testing.assert_array_equal(got, want)


def test_a_failed_read_of_a_later_piece_raises_from_feed(engine, monkeypatch):
    tokens, _, starts = _prompt(engine)
    real_rows = engine.engram_rows

    def rows(new, history):
        if len(history) == starts[1]:
            raise ExpertReadError("engram.gguf", -1, 7, "Engram table 0: injected")
        return real_rows(new, history)

    monkeypatch.setattr(engine, "engram_rows", rows)
    with pytest.raises(ExpertReadError, match="injected"):
        engine.session().feed(tokens)
    assert _readers_alive() == []


def test_a_feed_stopped_by_its_piece_waits_for_the_read_in_flight(engine, monkeypatch):
    tokens, _, starts = _prompt(engine)
    real_rows = engine.engram_rows
    read_finished = threading.Event()

    def rows(new, history):
        if len(history) == starts[1]:
            threading.Event().wait(0.5)  # still reading when piece 0 fails
            read_finished.set()
        return real_rows(new, history)

    def run(*args):
        raise RuntimeError("piece 0 failed")

    monkeypatch.setattr(E, "run_piece", run)
    monkeypatch.setattr(engine, "engram_rows", rows)
    with pytest.raises(RuntimeError, match="piece 0 failed"):
        engine.session().feed(tokens)
    assert read_finished.is_set()  # the feed waited for its read before raising
    assert _readers_alive() == []


def _recording_reads(engine: Engine, monkeypatch) -> list[tuple[str, int, tuple[int, ...]]]:
    """Every Engram read from now on: (thread name, tokens before the read's tokens, the read's tokens)."""
    calls, real = [], engine.engram_rows

    def rows(new, history):
        calls.append((threading.current_thread().name, len(history), tuple(int(t) for t in new)))
        return real(new, history)

    monkeypatch.setattr(engine, "engram_rows", rows)
    return calls


def test_tokens_said_next_are_read_during_the_feed_before_and_used_by_the_next(engine, monkeypatch):
    """`read_next(B)` before `feed(A)`: B's rows are read on the read-ahead thread during feed(A), feed(B) reads
    nothing for its first piece, and its logits are those of a session told nothing; a next feed of other tokens
    reads its own rows and is just as right."""
    a, b = _prompt(engine)[0][:8], _prompt(engine)[0][8:16]
    other = [t + 1 for t in b]
    plain = engine.session()
    plain.feed(a)
    want_b = plain.feed(b)
    plain_other = engine.session()
    plain_other.feed(a)
    want_other = plain_other.feed(other)

    calls = _recording_reads(engine, monkeypatch)
    told = engine.session()
    told.read_next(b)
    told.feed(a)
    assert (READ_AHEAD_THREAD + "_0", len(a), tuple(b)) in calls  # read while feed(a) ran, on its worker
    calls.clear()
    np.testing.assert_array_equal(told.feed(b), want_b)
    assert not [c for c in calls if c[2][:1] == (b[0],) and c[1] == len(a)]  # the kept rows were used

    guessed_wrong = engine.session()
    guessed_wrong.read_next(b)
    guessed_wrong.feed(a)
    calls.clear()
    np.testing.assert_array_equal(guessed_wrong.feed(other), want_other)
    assert calls and calls[0][2][0] == other[0]  # read for itself
    assert not _readers_alive()


def _scheduled_tokens(engine: Engine, prompt: list[int], prefill_budget: int) -> list[int]:
    """Four greedy tokens after `prompt`, served by a one-slot scheduler feeding at most `prefill_budget` prompt
    tokens per iteration."""
    from jds41 import scheduler as S
    from jds41.engine import SamplingParams

    sched = S.Scheduler(engine, n_slots=1, prefill_budget=prefill_budget)
    sched.start()
    try:
        events = sched.submit(S.GenRequest(prompt, 4, SamplingParams())).iter_events(timeout=120)
        return [e.id for e in events if isinstance(e, S.Token)]
    finally:
        sched.stop()


def test_the_scheduler_reads_a_long_prompts_next_chunk_while_feeding_this_one(engine, monkeypatch):
    """A prompt fed over several scheduler iterations: each next chunk's rows are read on the read-ahead thread
    during the chunk before, and the tokens equal those of the same prompt fed in one iteration."""
    prompt = _prompt(engine)[0]
    want = _scheduled_tokens(engine, prompt, 64)
    calls = _recording_reads(engine, monkeypatch)
    got = _scheduled_tokens(engine, prompt, 8)
    assert got == want and len(got) == 4
    ahead = {(at, toks) for name, at, toks in calls if name.startswith(READ_AHEAD_THREAD)}
    assert (8, tuple(prompt[8:16])) in ahead and (16, tuple(prompt[16:])) in ahead
