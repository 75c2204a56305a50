"""Engram row sources by profile: O_DIRECT row reads behind an LRU cache (and their buffered fallback), and the
in-memory copy, return exactly the bytes of the GGUF table for any row ids, and the engine's tokens do not depend
on where the tables live."""

from __future__ import annotations

import errno

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


def test_ssd_row_read_error_names_the_table(model):
    def eio(fd, buf, offset):
        raise OSError(errno.EIO, "Input/output error (injected)")

    src = SsdRowSource(model, model.config.engram, read_fn=eio)
    with pytest.raises(ExpertReadError, match="Engram table 0"):
        src.read_rows(0, np.array([1, 2]))
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
