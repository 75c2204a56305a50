"""The Engram host call's FFI handler (jds41/native/engram_ffi.cc) against the Python reference of
jds41/layers/engram_rows.py: the same row ids (at the tiny model's and at V4.1's full-size hash parameters), the
same row bytes from tables in memory and read from the file with O_DIRECT, the same bytes when XLA calls it inside
jit, clear errors, and the device loops' tokens unchanged by which form the step uses."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.checkpoints import open_model
from jds41.checkpoints.presets import preset
from jds41.decode_loop import greedy_generate
from jds41.engine import Engine
from jds41.engram_host_call import CallbackRows, step_rows_fn
from jds41.layers.engram_rows import EngramHasher, MmapRowSource, read_step_rows
from jds41.native.engram_ffi import EngramFfi
from jds41.tiers.engram_store import SsdRowSource


@pytest.fixture(scope="module")
def path(synthetic_model):
    return synthetic_model("deepseek41", "tiny", "q8")


@pytest.fixture(scope="module")
def hasher(path):
    model = open_model(path)
    e = model.config.engram
    return EngramHasher(e, np.asarray(model.metadata[f"{model.config.arch}.engram.token_map"], np.int64))


@pytest.fixture(scope="module")
def model(path):
    return open_model(path)


def _cases(n_vocab: int, n_ctx: int, seed: int = 0):
    """(block, history) pairs: every history length up to n-1, blocks of 1 and 6, and blocked (negative) ids in
    both, which pad their slot and every older one."""
    rng = np.random.default_rng(seed)
    for n_hist in range(n_ctx + 1):
        for T in (1, 6):
            hist = rng.integers(0, n_vocab, n_hist)
            block = rng.integers(0, n_vocab, T)
            yield block, hist
            if n_hist:
                blocked = hist.copy()
                blocked[rng.integers(0, n_hist)] = -1
                yield block, blocked
            if T > 1:
                b = block.copy()
                b[2] = -1
                yield b, hist


def _padded(hist, n_ctx):
    """The loops' history form: n-1 slots, -1 on the left for none, and the count of real ones."""
    out = np.full((max(n_ctx, 1),), -1, np.int32)
    if len(hist):
        out[len(out) - len(hist):] = hist
    return out, len(hist)


def test_row_ids_equal_the_reference_at_full_size_parameters():
    """V4.1's real hash parameters (two layers, 24 buckets of primes near 16M, multipliers near 2^63 / 99,092),
    where products wrap and the modulus is of 64-bit values: the handler's ids equal EngramHasher's."""
    e = preset("deepseek41", "full").engram
    n_vocab = 129280
    token_map = np.random.default_rng(1).integers(0, 99092, n_vocab)
    ref = EngramHasher(e, token_map)
    ffi = EngramFfi(ref, None)
    for block, hist in _cases(n_vocab, e.max_ngram - 1):
        np.testing.assert_array_equal(ffi.row_ids(block, hist), ref.row_ids_seq(block, hist))
    assert ref.row_ids_seq([5], [7, 8, 9]).max() > 2**24  # ids past 2^24: the offsets of later buckets count


def test_rows_from_memory_tables_equal_the_reference(model, hasher):
    source = MmapRowSource.from_model(model, hasher.ecfg)
    ffi = EngramFfi(hasher, source)
    n_ctx = hasher.ecfg.max_ngram - 1
    call = jax.jit(ffi)
    for block, hist in _cases(len(hasher.token_map), n_ctx):
        want = read_step_rows(source, hasher.row_ids_seq(block, hist))
        np.testing.assert_array_equal(ffi.host_rows(block, hist), want)
        padded, n_hist = _padded(hist, n_ctx)
        got = call(jnp.asarray(block, jnp.int32), jnp.asarray(padded), jnp.int32(n_hist))
        np.testing.assert_array_equal(np.asarray(got), want)
    assert ffi.counters()["calls"] > 0 and ffi.counters()["rows_read"] == 0  # memory tables read no file


@pytest.mark.parametrize("direct", [True, False])
def test_rows_read_from_the_file_equal_the_reference(model, hasher, direct):
    """The file form (SsdRowSource's tables, O_DIRECT or buffered, the handler's own row cache): same bytes; a
    repeated call is answered from the cache and reads nothing."""
    ref = MmapRowSource.from_model(model, hasher.ecfg)
    src = SsdRowSource(model, hasher.ecfg, cache_rows=64, direct=direct)
    ffi = EngramFfi(hasher, src)
    for block, hist in _cases(len(hasher.token_map), hasher.ecfg.max_ngram - 1, seed=2):
        want = read_step_rows(ref, hasher.row_ids_seq(block, hist))
        np.testing.assert_array_equal(ffi.host_rows(block, hist), want)
    block, hist = np.array([11, 12, 13]), np.array([4, 5])
    ffi.host_rows(block, hist)
    before = ffi.counters()
    np.testing.assert_array_equal(ffi.host_rows(block, hist), read_step_rows(ref, hasher.row_ids_seq(block, hist)))
    after = ffi.counters()
    assert before["rows_read"] > 0 and after["rows_read"] == before["rows_read"]
    assert after["cache_hits"] > before["cache_hits"]
    src.close()


def test_a_bad_token_id_is_a_clear_error_inside_jit(model, hasher):
    ffi = EngramFfi(hasher, MmapRowSource.from_model(model, hasher.ecfg))
    bad = len(hasher.token_map) + 3
    with pytest.raises(ValueError, match="outside the token map"):
        ffi.host_rows([bad], [])
    padded, n_hist = _padded([], hasher.ecfg.max_ngram - 1)
    with pytest.raises(Exception, match="outside the token map"):
        jax.block_until_ready(jax.jit(ffi)(jnp.asarray([bad], jnp.int32), jnp.asarray(padded), jnp.int32(n_hist)))


def test_a_table_cut_short_names_its_file_and_row(model, hasher, tmp_path):
    """A GGUF cut inside an Engram table: the handler's read fails with the file, the table and the row."""
    src = SsdRowSource(model, hasher.ecfg, cache_rows=64, direct=False)
    path, offset, rows = src.tables[0]
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as fh:
        cut.write_bytes(fh.read(offset + (rows // 2) * hasher.ecfg.row_bytes))
    src.tables[0] = (str(cut), offset, rows)
    ffi = EngramFfi(hasher, src)
    ids = hasher.row_ids_seq(np.arange(64) % len(hasher.token_map), [])
    assert ids[:, 0].max() >= rows // 2  # some row of table 0 lies past the cut
    with pytest.raises(ValueError, match=r"cut\.gguf: Engram table 0 row \d+: file ends inside the row"):
        ffi.host_rows(np.arange(64) % len(hasher.token_map), [])
    src.close()


def test_the_loops_choose_the_handler_and_their_tokens_do_not_depend_on_it(path, monkeypatch):
    """A plain engine's step uses the handler by default; JDS41_ENGRAM_HOST=callback gives the Python form;
    greedy tokens and the session's tokens are the same either way (and equal the reference path's:
    tests/test_decode_loop.py)."""
    prompt = [5, 17, 3, 99, 42, 7, 64, 12]
    out = {}
    for how in ("auto", "callback"):
        monkeypatch.setenv("JDS41_ENGRAM_HOST", how)
        engine = Engine.open(str(path), max_ctx=64)
        fn = step_rows_fn(engine)
        assert isinstance(fn, EngramFfi if how == "auto" else CallbackRows)
        s = engine.session()
        out[how] = greedy_generate(s, int(np.argmax(s.feed(prompt))), 24), list(s.tokens)
    assert out["auto"] == out["callback"]
    assert out["auto"][0] and len(out["auto"][0]) == 24


def test_the_token_feed_hands_every_fed_id_to_the_prefetch_thread(model, hasher):
    """With a prefetch function (an SSD expert tier's), each call's non-negative token ids reach it on the
    handler's thread, and closing the handler ends that thread."""
    got, seen = [], threading.Event()

    def prefetch(ids):
        got.extend(ids)
        if len(got) >= 7:
            seen.set()

    ffi = EngramFfi(hasher, MmapRowSource.from_model(model, hasher.ecfg), prefetch=prefetch)
    ffi.host_rows([4, 9, 2], [1])
    ffi.host_rows([-1, 6], [])
    ffi.host_rows([8, 3, 5], [7, 7])
    assert seen.wait(10)
    assert got == [4, 9, 2, 6, 8, 3, 5]
    thread = ffi._feed_thread
    ffi.close()
    assert not thread.is_alive()


@pytest.mark.slow  # two engines over SSD experts (~85 s on 2 cores)
def test_an_ssd_expert_tier_with_hash_layers_feeds_its_prefetch(path, monkeypatch):
    """The ssd-heavy profile (SSD experts, hash layers) keeps the callback by default (measured faster there) and
    takes the handler with the token feed when asked; its greedy tokens equal the callback's (which prefetches
    inside the step)."""
    prompt = [5, 17, 3, 99, 42, 7, 64, 12]
    monkeypatch.delenv("JDS41_ENGRAM_HOST", raising=False)
    engine = Engine.open(str(path), max_ctx=64, profile="ssd-heavy")
    assert isinstance(step_rows_fn(engine), CallbackRows)
    engine.tiers.close()
    out = {}
    for how in ("ffi", "callback"):
        monkeypatch.setenv("JDS41_ENGRAM_HOST", how)
        engine = Engine.open(str(path), max_ctx=64, profile="ssd-heavy")
        assert engine.tiers.stores.ssd is not None and engine.tiers.hash_tables
        fn = step_rows_fn(engine)
        assert isinstance(fn, EngramFfi if how == "ffi" else CallbackRows)
        s = engine.session()
        out[how] = greedy_generate(s, int(np.argmax(s.feed(prompt))), 16)
        if how == "ffi":
            assert fn._feed_thread is not None and fn.counters()["calls"] >= 15
            fn.close()
        engine.tiers.close()
    assert out["ffi"] == out["callback"]


@pytest.mark.gpu
def test_the_cuda_handler_equals_the_reference(model, hasher):
    """On the GPU the handler copies the ids from the device and the rows back on XLA's stream."""
    gpu = jax.devices("gpu")[0]
    source = MmapRowSource.from_model(model, hasher.ecfg)
    ffi = EngramFfi(hasher, source)
    call = jax.jit(ffi)
    n_ctx = hasher.ecfg.max_ngram - 1
    for block, hist in _cases(len(hasher.token_map), n_ctx, seed=3):
        padded, n_hist = _padded(hist, n_ctx)
        args = jax.device_put((jnp.asarray(block, jnp.int32), jnp.asarray(padded), jnp.int32(n_hist)), gpu)
        got = call(*args)
        assert got.devices() == {gpu}
        np.testing.assert_array_equal(np.asarray(got), read_step_rows(source, hasher.row_ids_seq(block, hist)))
