"""Engram rows read ahead (jds41/engine.py `Session._pieces`): a feed reads piece k + 1's rows right after it
dispatches piece k, before it waits for piece k's outputs, and each piece still gets exactly its own rows.

References: the rows of the whole prompt read in one call (each token's rows depend only on its own n - 1
predecessors, so slicing them per piece is an independent derivation of every piece's rows), and the same prompt
fed one piece per `feed` call (each feed reads its rows before its piece, as before the read-ahead).
"""

from __future__ import annotations

import numpy as np

from jds41 import engine as E
from jds41.engine import Engine
from jds41.prompt_pieces import prompt_pieces


def test_each_pieces_rows_are_read_while_the_piece_before_it_runs(synthetic_model, monkeypatch):
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=64, prefill_chunk=8)
    tokens = np.random.default_rng(5).integers(8, engine.vocab_size, 21).tolist()
    pieces = [n for _, n in prompt_pieces(len(tokens), engine.plan.decode_width, engine.prefill_chunk, False,
                                          engine.plan.prompt_width)]
    assert len(pieces) >= 3
    want_rows = engine.engram_rows(tokens, [])
    ends = np.cumsum(pieces)

    events, given = [], []
    real_run, real_rows, real_record = E.run_piece, engine.engram_rows, E.Session._record

    def run(plan, params, state, how, piece, rows, *rest):
        events.append(("run", len(piece)))
        given.append(np.asarray(rows))
        return real_run(plan, params, state, how, piece, rows, *rest)

    def rows(new, history):
        events.append(("rows", len(history) + len(new)))  # the position after the piece the rows are for
        return real_rows(new, history)

    def record(self, routing):
        events.append(("record",))
        return real_record(self, routing)

    monkeypatch.setattr(E, "run_piece", run)
    monkeypatch.setattr(engine, "engram_rows", rows)
    monkeypatch.setattr(E.Session, "_record", record)
    session = engine.session()
    got = session.feed(tokens)

    want_events = [("rows", int(ends[0]))]
    for k, n in enumerate(pieces):
        want_events += [("run", n)] + ([("rows", int(ends[k + 1]))] if k + 1 < len(pieces) else []) + [("record",)]
    assert events == want_events
    for k, rows_k in enumerate(given):
        np.testing.assert_array_equal(rows_k, want_rows[ends[k] - pieces[k]:ends[k]], err_msg=f"piece {k}")

    monkeypatch.undo()
    one_by_one = engine.session()
    for k, n in enumerate(pieces):
        want = one_by_one.feed(tokens[ends[k] - n:ends[k]])
    np.testing.assert_array_equal(got, want)
