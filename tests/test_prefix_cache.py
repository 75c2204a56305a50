"""Prefix cache (jds41/prefix_cache.py): a session resumed from a snapshot gives the logits and tokens of one that
read the whole prompt (exact and partial prefix hits, Engram history included), across a restart through the
snapshot directory; LRU eviction under the byte budget; corrupted, truncated or foreign snapshot files are
detected, warned about once and never used; the expert working set is saved and prefetched on restore.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jds41 import prefix_cache as PC
from jds41.engine import Engine

CHUNK = 8  # layer-major group and snapshot boundary: prompts of ~20 tokens cross it twice


def _snap(n: int, first: int = 1, width: int = 100) -> PC.Snapshot:
    tokens = np.arange(first, first + n, dtype=np.int32)
    return PC.Snapshot(tokens, [np.full((width,), n, np.float32)], np.zeros(4, np.float32), None)


def test_lru_eviction_under_byte_budget():
    a, b, c = _snap(3), _snap(4), _snap(5)
    cache = PC.PrefixCache(budget_bytes=a.nbytes + b.nbytes + 8)  # room for two of them
    cache.put(a)
    cache.put(b)
    assert cache.longest(np.arange(1, 10)).n_tokens == 4 and cache.nbytes == a.nbytes + b.nbytes
    assert cache.longest([1, 2, 3, 99]).n_tokens == 3  # touches a: b is now least recently used
    cache.put(c)
    assert cache.stats.evictions == 1 and cache.nbytes == a.nbytes + c.nbytes <= cache.budget
    assert cache.longest([1, 2, 3, 4, 99]).n_tokens == 3  # b (4 tokens) is gone, a remains
    assert cache.longest([7, 8]) is None
    s = cache.stats
    assert (s.hits, s.misses, s.hit_tokens) == (3, 1, 4 + 3 + 3)
    cache.put(_snap(2000))  # larger than the whole budget: not stored, nothing evicted for it
    assert cache.stats.evictions == 1 and len(cache) == 2


def test_hash_collision_or_other_tokens_is_a_miss():
    cache = PC.PrefixCache(1 << 20)
    snap = _snap(4)
    cache.put(snap)
    cache._mem[PC.prefix_key([9, 9, 9, 9])] = snap  # a forged key: the stored tokens are still compared
    assert cache.longest([9, 9, 9, 9, 1]) is None


def test_bad_snapshot_files_are_detected_warned_once_and_never_used(tmp_path, caplog):
    first = PC.PrefixCache(1 << 20, tmp_path, fingerprint="model-a")
    for n in (3, 4, 5, 6):
        first.put(_snap(n))
    assert len(list(tmp_path.glob("*.pfx"))) == 4
    by_n = {n: tmp_path / f"{_snap(n).key}.pfx" for n in (3, 4, 5, 6)}
    data = by_n[6].read_bytes()
    by_n[6].write_bytes(data[:-10])  # truncated
    data = bytearray(by_n[5].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped payload byte: same size, wrong checksum
    by_n[5].write_bytes(bytes(data))
    by_n[4].write_bytes(b"NOTASNAP" + by_n[4].read_bytes()[8:])  # wrong magic
    (tmp_path / "junk.pfx").write_bytes(b"JDS4")  # shorter than the header
    PC.PrefixCache(1 << 20, tmp_path / "other", fingerprint="model-b").put(_snap(7))

    with caplog.at_level(logging.WARNING, logger="jds41.prefix_cache"):
        restarted = PC.PrefixCache(1 << 20, tmp_path, fingerprint="model-a")
        got = restarted.longest(np.arange(1, 20))  # tries 5 (corrupted: found only when read) before 3
        again = restarted.longest(np.arange(1, 20))
    assert got is not None and got.n_tokens == 3 and again.n_tokens == 3
    np.testing.assert_array_equal(got.leaves[0], _snap(3).leaves[0])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 4 and restarted.stats.bad_files == 4, warnings  # each bad file once
    for path, why in ((by_n[6], "truncated"), (by_n[5], "checksum"), (by_n[4], "magic"),
                      (tmp_path / "junk.pfx", "shorter")):
        assert any(str(path) in w and why in w for w in warnings), (why, warnings)
        assert not path.exists()
    assert by_n[3].exists()
    foreign = PC.PrefixCache(1 << 20, tmp_path / "other", fingerprint="model-a")  # another model's files
    assert len(foreign) == 0 and len(list((tmp_path / "other").glob("*.pfx"))) == 1  # ignored, not deleted


def test_working_set_prefetch_picks_ssd_experts_most_used_first():
    class Ssd:
        class cache:
            n_slots = 2

        def __init__(self):
            self.asked = []

        def prefetch(self, keys):
            self.asked = list(keys)
            return self.asked

    class Tiers:
        tier_LE = np.array([[0, 2, 2, 1], [2, 2, 0, 2]])
        stores = type("S", (), {"ssd": Ssd()})

    counts = np.array([[9, 1, 5, 7], [0, 3, 8, 4]])
    assert PC.prefetch_working_set(Tiers, counts) == 2
    assert Tiers.stores.ssd.asked == [(0, 2), (1, 3)]  # SSD only (5 and 4 uses), never an unused one
    assert PC.prefetch_working_set(None, counts) == 0 and PC.prefetch_working_set(Tiers, None) == 0


@pytest.fixture(scope="module")
def engines(synthetic_model, tmp_path_factory):
    path = str(synthetic_model("deepseek41", "tiny"))
    directory = tmp_path_factory.mktemp("prefix-snapshots")
    cached = Engine.open(path, max_ctx=64, prefill_chunk=CHUNK, prefix_cache_bytes=64 << 20,
                         prefix_cache_dir=str(directory))
    plain = Engine.open(path, max_ctx=64, prefill_chunk=CHUNK)
    return path, directory, cached, plain


def _greedy(engine, prompt, n=4):
    session = engine.session()
    return list(session.generate(prompt, n)), session.cached_tokens


def test_shared_prefixes_give_identical_logits_and_tokens(engines):
    path, directory, cached, plain = engines
    rng = np.random.default_rng(11)
    base = rng.integers(8, cached.vocab_size, 20).tolist()
    first, n_cached = _greedy(cached, base)  # snapshots at 8 and 16 (chunk boundaries) and 20 (prompt end)
    assert n_cached == 0 and first == _greedy(plain, base)[0]
    assert cached.prefix_cache.lengths() == [20, 16, 8]
    cases = {"exact": base, "longer": base + rng.integers(8, 200, 5).tolist(),
             "partial": base[:13] + rng.integers(8, 200, 9).tolist()}
    for name, prompt in cases.items():
        session = cached.session()
        got = session.feed_prompt(prompt)
        want = plain.session().feed(prompt)
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert session.cached_tokens == {"exact": 20, "longer": 20, "partial": 8}[name]
        assert session.tokens == prompt
        assert _greedy(cached, prompt)[0] == _greedy(plain, prompt)[0], name

    # A restart: a new engine on the same directory resumes from the files.
    reopened = Engine.open(path, max_ctx=64, prefill_chunk=CHUNK, prefix_cache_bytes=64 << 20,
                           prefix_cache_dir=str(directory))
    assert len(reopened.prefix_cache) >= 3
    session = reopened.session()
    prompt = cases["longer"][:23]  # the files hold 8, 16, 20 and (from the greedy run above) 25 tokens of it
    np.testing.assert_array_equal(session.feed_prompt(prompt), plain.session().feed(prompt))
    assert session.cached_tokens == 20 and reopened.prefix_cache.stats.hits == 1


@pytest.mark.slow
def test_working_set_saved_with_snapshot_and_prefetched_on_restore(synthetic_model):
    engine = Engine.open(str(synthetic_model("deepseek41", "tiny", "q8")), max_ctx=64, prefill_chunk=CHUNK,
                         profile="ssd-heavy", prefix_cache_bytes=64 << 20)
    cfg = engine.cfg
    prompt = np.random.default_rng(12).integers(8, cfg.vocab_size, 16).tolist()
    session = engine.session()
    session.feed(prompt)
    session.save_prefix(session.feed([5]))
    snap = engine.prefix_cache.longest(prompt + [5])
    assert snap.experts.shape == (cfg.n_layers, cfg.n_experts)
    assert (snap.experts.sum(axis=1) == 17 * cfg.n_experts_used).all()  # every token's K selections per layer
    ssd = engine.tiers.stores.ssd
    on_ssd = snap.experts * (engine.tiers.tier_LE == 2)
    assert ssd is not None and on_ssd.any()
    asked = []
    real_prefetch = ssd.prefetch
    ssd.prefetch = lambda keys: asked.append(list(keys)) or real_prefetch(keys)
    resumed = engine.session()
    logits = resumed.feed_prompt(prompt + [5, 6])
    assert resumed.cached_tokens == 17
    want = sorted(zip(*map(np.ndarray.tolist, np.nonzero(on_ssd))))[:ssd.cache.n_slots]
    assert asked and sorted(asked[0]) == want[:len(asked[0])] and len(asked[0]) == min(len(want), ssd.cache.n_slots)
    engine.prefix_cache = None  # the same engine (same compiled programs) without the cache
    np.testing.assert_array_equal(logits, engine.session().feed(prompt + [5, 6]))
