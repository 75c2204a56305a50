"""Engram row sources by profile: O_DIRECT row reads behind an LRU cache (and their buffered fallback), and the
in-memory copy, return exactly the bytes of the GGUF table for any row ids, and the engine's tokens do not depend
on where the tables live."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jds41.checkpoints import open_model
from jds41.engine import Engine
from jds41.layers.engram_rows import MmapRowSource
from jds41.tiers.engram_store import InMemoryRowSource, SsdRowSource
from jds41.tiers.ssd import ExpertReadError


@pytest.fixture(scope="module")
def model(synthetic_model):
    return open_model(synthetic_model("deepseek41", "tiny", "q8"))


@pytest.mark.parametrize("direct", [True, False])
def test_ssd_rows_equal_the_table(model, direct):
    e = model.config.engram
    want = MmapRowSource.from_model(model, e)
    src = SsdRowSource(model, e, cache_rows=16, direct=direct)
    rng = np.random.default_rng(0)
    for _ in range(5):  # repeated ids, cache hits and evictions (16 rows of cache)
        ids = rng.integers(0, e.rows[0], (7, e.n_buckets))
        np.testing.assert_array_equal(src.read_rows(0, ids), want.read_rows(0, ids))
    assert src.cache_hits > 0 and src.rows_read <= src.rows_requested
    np.testing.assert_array_equal(InMemoryRowSource(model, e).read_rows(0, ids), want.read_rows(0, ids))
    src.close()


def test_rows_read_once_are_answered_from_the_cache(model):
    """A repeat of a call reads nothing from the file (its rows found their places in the direct-mapped cache),
    rows that collide in a one-place cache are still right, and tables sharing the cache keep their own rows."""
    e = model.config.engram
    want = MmapRowSource.from_model(model, e)
    ids = np.random.default_rng(1).integers(0, e.rows[0], (5, e.n_buckets))
    src = SsdRowSource(model, e, cache_rows=1 << 16)
    first = src.read_rows(0, ids)
    read = src.rows_read
    np.testing.assert_array_equal(src.read_rows(0, ids), first)
    assert src.rows_read == read and src.cache_hits == np.unique(ids).size
    np.testing.assert_array_equal(first, want.read_rows(0, ids))
    src.close()
    one = SsdRowSource(model, e, cache_rows=1)
    for _ in range(3):
        np.testing.assert_array_equal(one.read_rows(0, ids), want.read_rows(0, ids))
    one.close()
    # Two tables share the cache: a second table over the same bytes shifted by one row (its row r is table 0's
    # row r + 1), read right after table 0 with the same ids, gets its own rows, never table 0's cached ones.
    two = SsdRowSource(model, e, cache_rows=1 << 16)
    path, base, rows = two.tables[0]
    two.tables.append((path, base + e.row_bytes, rows - 1))
    ids = ids % (rows - 1)
    np.testing.assert_array_equal(two.read_rows(0, ids), want.read_rows(0, ids))
    np.testing.assert_array_equal(two.read_rows(1, ids), want.read_rows(0, ids + 1))
    two.close()


def test_ssd_row_read_error_names_the_table(model):
    def eio(fd, buf, offset):
        raise OSError(errno.EIO, "Input/output error (injected)")

    src = SsdRowSource(model, model.config.engram, read_fn=eio)
    with pytest.raises(ExpertReadError, match="Engram table 0"):
        src.read_rows(0, np.array([1, 2]))
    src.close()


def test_rows_whose_pages_touch_share_reads_cut_at_the_span_limit(model, monkeypatch):
    """Adjacent rows merge into one read, no read is longer than SPAN_BYTES (here 3 pages), reads are shared out to
    tasks by count and bytes, and every row still gets its own bytes; reads that come back short (at most one page
    per call) are finished by the careful path."""
    from jds41.tiers import engram_store as ES
    from jds41.tiers.ssd import ALIGN, _pread

    e = model.config.engram
    want = MmapRowSource.from_model(model, e)
    monkeypatch.setattr(ES, "SPAN_BYTES", 3 * ALIGN)
    monkeypatch.setattr(ES, "TASK_BYTES", 4 * ALIGN)  # tasks of one or two reads: many tasks, each its own buffer
    monkeypatch.setattr(ES, "SPANS_PER_TASK", 2)
    sizes = []

    def short(fd, buf, offset):  # one page at most per call, as a slow device may answer
        sizes.append(len(buf))
        return _pread(fd, buf[:ALIGN], offset)

    for read_fn in (None, short):
        src = SsdRowSource(model, e, cache_rows=0, read_fn=read_fn)
        dense = np.arange(e.rows[0] - 100, e.rows[0])  # the table's last 100 rows, its end included
        sparse = np.arange(0, e.rows[0] - 100, 47)
        ids = np.concatenate([dense, sparse])[np.random.default_rng(3).permutation(len(dense) + len(sparse))]
        spans = src._spans(0, np.unique(ids))
        assert len(spans) < len(np.unique(ids))  # touching rows merged
        assert max(n for *_, n in spans) <= 3 * ALIGN and all(n % ALIGN == 0 for *_, n in spans)
        assert [a for a, *_ in spans] == sorted({a for a, *_ in spans}) and spans[-1][1] == len(np.unique(ids))
        np.testing.assert_array_equal(src.read_rows(0, ids), want.read_rows(0, ids))
        assert src.files.stats.chunks >= len(spans)
        src.close()
    assert max(sizes) > ALIGN  # the short reads were asked for whole spans


def test_a_failed_read_names_the_row_it_was_for(model):
    e = model.config.engram
    first = SsdRowSource(model, e)
    path, base, _ = first.tables[0]
    first.close()
    bad_row = e.rows[0] - 1  # the read holding the table's last row fails; the one of rows 1 and 2 reads fine
    bad = base + bad_row * e.row_bytes
    ids = np.array([1, 2, bad_row])

    def eio_at(fd, buf, offset):
        if offset <= bad < offset + len(buf):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return os.preadv(fd, [buf], offset)

    src = SsdRowSource(model, e, read_fn=eio_at)
    assert [a for a, *_ in src._spans(0, ids)] == [0, 2]  # two reads: rows 1-2, then the last row
    with pytest.raises(ExpertReadError, match="Engram table 0") as err:
        src.read_rows(0, ids)
    assert err.value.expert == bad_row
    src.close()


@pytest.mark.slow
def test_tokens_do_not_depend_on_where_the_tables_live(synthetic_model):
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    prompt = [9, 10, 11, 12]
    want = list(Engine.open(path, max_ctx=64).session().generate(prompt, 6))
    engine = Engine.open(path, max_ctx=64, profile="ssd-heavy")  # engram_tables: ssd
    assert isinstance(engine.engram[1], SsdRowSource)
    assert list(engine.session().generate(prompt, 6)) == want
    assert engine.engram[1].rows_read > 0
