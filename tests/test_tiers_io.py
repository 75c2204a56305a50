"""The byte-moving side of the tiers: O_DIRECT expert reads, the slot cache, the three stores and the loader.

Oracle: `GGUFModel.raw(name)`. The tiny Q8_0 file has 2176-byte experts, so expert e > 0 starts mid-page and
reads take the aligned bounce path. Whatever the tmp file system does, both I/O paths run: the buffered one is
forced by `direct=False` or by an `open_fn`/`read_fn` that refuses O_DIRECT as tmpfs or some FUSE mounts do.
Faults (truncated copy, injected EIO, a read that never returns) end in ExpertReadError / ModelFileError naming
file, layer and expert (or tensor), quickly: never wrong bytes, never a hang.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import os
import shutil
import threading
import time
import types
import warnings
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.checkpoints import open_model
from jds41.errors import ModelFileError
from jds41.quant import qmatvec_experts
from jds41.tiers.loader import load_tensors
from jds41.tiers.slot_cache import SlotCache, SlotCacheFull
from jds41.tiers.ssd import DirectIOUnavailable, ExpertReader, ExpertReadError
from jds41.tiers.stores import ExpertLayout, build_stores, placement_dict, split_placement
from jds41.weights import load_params

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def q8(synthetic_model):
    with open_model(synthetic_model("deepseek4", "tiny", "q8")) as model:
        yield model


@pytest.fixture(scope="module")
def layout(q8):
    return ExpertLayout.from_model(q8)


def _expected(model, layout, key):
    """gate|up|down bytes of one expert from the memory map."""
    layer, e = key
    return np.concatenate([model.raw(s.name).reshape(s.shape[0], -1)[e] for s in layout.stacks[layer]])


def _fail(code):
    raise OSError(code, os.strerror(code))


def _refuse_direct_open(path, flags):  # as tmpfs did before Linux 6.6
    return _fail(errno.EINVAL) if flags & os.O_DIRECT else os.open(path, flags)


def _refuse_direct_read(fd, buf, offset):  # some FUSE mounts open with O_DIRECT, then refuse the read
    return _fail(errno.EINVAL) if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else os.preadv(fd, [buf], offset)


def _all_keys(layout):
    return [(layer, e) for layer in layout.layers for e in range(layout.n_experts(layer))]


# ---- ExpertReader ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "buffered", "open-refused", "read-refused"])
def test_every_expert_equals_raw(q8, layout, mode):
    assert any(s.piece(1)[1] % 4096 for st in layout.stacks.values() for s in st), "want unaligned experts"
    kw = {"buffered": {"direct": False}, "open-refused": {"open_fn": _refuse_direct_open},
          "read-refused": {"read_fn": _refuse_direct_read}}.get(mode, {})
    keys = _all_keys(layout)
    with warnings.catch_warnings(record=True) as caught, ExpertReader(layout, threads=4, **kw) as reader:
        warnings.simplefilter("always")
        together = reader.read(keys)
        one_by_one = {k: reader.read([k])[k] for k in keys[::3]}
        for fut in [reader.submit(keys[i::4]) for i in range(4)]:  # concurrent requests
            one_by_one.update(fut.result(timeout=10))
    for k, v in [*together.items(), *one_by_one.items()]:
        assert v.dtype == np.uint8 and np.array_equal(v, _expected(q8, layout, k)), k
    warned = sum(issubclass(w.category, DirectIOUnavailable) for w in caught)
    direct = reader.stats.direct_io  # mode "direct": whatever the tmp file system allows, flag and warning agree
    assert direct == (direct and mode == "direct") and warned == (not direct and mode != "buffered")
    assert mode not in ("open-refused", "read-refused") or "O_DIRECT" in reader.stats.fallback_reason
    assert reader.stats.errors == 0 and reader.stats.bytes_read >= reader.stats.bytes_useful


def test_coalescing_chunks_and_destinations(q8, layout):
    with ExpertReader(layout, threads=2) as reader:
        reader.read([(1, e) for e in range(layout.n_experts(1))])
        # The tiny file stores gate, up and down of a layer back to back on page boundaries: one span, one chunk.
        assert reader.stats.chunks == 1
        reader.read([(2, 5)])  # one expert: three pieces in three separate pages
        assert reader.stats.chunks == 4
    with ExpertReader(layout, threads=3, chunk_bytes=4096) as small:
        got = small.read(_all_keys(layout))
        assert small.stats.chunks > 3 * len(layout.layers)
    assert all(np.array_equal(v, _expected(q8, layout, k)) for k, v in got.items())
    with pytest.raises(KeyError, match="no routed expert 99"):
        small.submit([(0, 99)])

    # Into the caller's buffers (the slot cache's host rows, the stores' stacks): one whole, or gate/up/down.
    n = layout.expert_nbytes(0)
    whole, parts = np.zeros(n, np.uint8), [np.zeros(s.expert_bytes, np.uint8) for s in layout.stacks[0]]
    with ExpertReader(layout) as reader:
        got = reader.read([(0, 3), (0, 4)], out={(0, 3): whole, (0, 4): parts})
        with pytest.raises(ValueError, match="needs"):
            reader.submit([(0, 1)], out={(0, 1): np.zeros(n - 1, np.uint8)})
    assert got[(0, 3)] is whole and np.array_equal(whole, _expected(q8, layout, (0, 3)))
    assert np.array_equal(np.concatenate(parts), _expected(q8, layout, (0, 4)))
    assert np.array_equal(layout.split(0, whole)["down"], q8.raw("blk.0.ffn_down_exps.weight").reshape(8, 64, -1)[3])


@pytest.mark.parametrize("direct", [True, False])
def test_short_read_on_truncated_copy(q8, tmp_path, direct):
    copy = tmp_path / "truncated.gguf"
    shutil.copyfile(q8.path, copy)
    with open_model(copy) as model:
        layout = ExpertLayout.from_model(model)
        want = {k: _expected(model, layout, k) for k in [(3, 0), (3, 1)]}
    last = layout.layers[-1]
    os.truncate(copy, layout.stacks[last][2].offset + 5000)  # the file now ends mid-page inside expert 2's down rows
    with ExpertReader(layout, direct=direct) as reader:
        # Experts 0 and 1 lie before the cut (1 ends at 4352, its O_DIRECT page read stops at EOF): still exact.
        got = reader.read([(last, 0), (last, 1)])
        assert all(np.array_equal(got[k], want[k]) for k in want)
        with pytest.raises(ExpertReadError, match="short read") as info:
            reader.read([(last, 6)])
        assert (info.value.path, info.value.layer, info.value.expert) == (str(copy), last, 6)
        assert f"layer {last} expert 6" in str(info.value) and str(copy) in str(info.value)
        with pytest.raises(ExpertReadError, match="short read"):
            reader.read([(0, 0), (last, 7)])  # one bad expert fails the whole request


def test_injected_eio_fails_the_request(q8, layout):
    bad = layout.pieces((2, 4))[1][1]  # the up piece of layer 2, expert 4
    flaky = lambda fd, buf, off: _fail(errno.EIO) if off <= bad < off + len(buf) else os.preadv(fd, [buf], off)
    with ExpertReader(layout, read_fn=flaky) as reader:
        t0 = time.perf_counter()
        with pytest.raises(ExpertReadError, match="EIO") as info:
            reader.read([(2, 4)])
        assert time.perf_counter() - t0 < 5 and (info.value.layer, info.value.expert) == (2, 4)
        assert info.value.path == q8.path and reader.stats.errors == 1
        assert np.array_equal(reader.read([(0, 2)])[(0, 2)], _expected(q8, layout, (0, 2)))  # the pool lives on


def _stuck_until(release: threading.Event):
    return lambda fd, buf, offset: release.wait(10) and os.preadv(fd, [buf], offset)


def test_stuck_read_times_out(q8):
    release = threading.Event()
    reader = ExpertReader(ExpertLayout.from_model(q8), read_fn=_stuck_until(release), timeout_s=0.3)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ExpertReadError, match="no answer within 0.3 s"):
            reader.read([(1, 1)])
        assert time.perf_counter() - t0 < 2
        pending = reader.submit([(1, 2)])
    finally:
        threading.Timer(0.2, release.set).start()  # after close() has failed the pending request
        reader.close()  # waits for the stuck reads to return before closing their descriptors
    with pytest.raises(ExpertReadError, match="reader closed"):  # stuck, then closed: fails, never hangs
        pending.result(timeout=5)


# ---- SlotCache ------------------------------------------------------------------------------------------------


def _settled(keys, slots):
    (fut := cf.Future()).set_result(None)
    return fut


def test_alpha_zero_is_exact_lru():
    rng = np.random.default_rng(1)
    trace = [[(0, int(e)) for e in rng.choice(24, 3, replace=False)] for _ in range(500)]
    cache, ref, hits = SlotCache(6, _settled, alpha=0.0), OrderedDict(), []
    for step in trace:
        _, misses = cache.lookup(step)
        expect = [k for k in step if k not in ref]
        for key in step:  # reference LRU; a step's own keys are never its victims
            if key not in ref and len(ref) >= 6:
                del ref[next(k for k in ref if k not in step)]
            ref[key] = None
            ref.move_to_end(key)
        assert misses == expect
        hits.append(len(step) - len(misses))
    assert set(cache.resident()) == set(ref) and cache.stats.hits == sum(hits)


def test_frequency_prior_beats_lru_on_skewed_trace():
    rng = np.random.default_rng(0)  # Zipf(1) over 64 experts, 4 distinct per step
    p, names = 1 / np.arange(1, 65), rng.permutation(64)
    trace = [[(0, int(names[i])) for i in rng.choice(64, 4, replace=False, p=p / p.sum())] for _ in range(2000)]
    rates = {}
    for alpha in (0.0, None):
        cache = SlotCache(16, _settled, alpha=alpha)
        for step in trace:
            cache.lookup(step)
        rates[alpha] = cache.stats.hit_rate
        assert cache.stats.lookups == 4 * len(trace) and cache.stats.evictions == cache.stats.misses - 16
    assert rates[None] > rates[0.0] + 0.05, rates  # measured 0.55 -> 0.64


def test_pinned_and_filling_entries_survive():
    gates: dict = {}

    def slow(keys, slots):
        fut = cf.Future()
        gates[tuple(keys)] = fut
        return fut

    cache = SlotCache(4, slow, alpha=0.0, timeout_s=0.2)
    slots, misses = cache.lookup([(0, 0), (0, 1)], pin=True)
    assert misses == [(0, 0), (0, 1)] and sorted(slots) == [0, 1]
    cache.lookup([(0, 2), (0, 3)])  # filling, unpinned
    with pytest.raises(SlotCacheFull):  # nothing is evictable: pinned, or filling past the 0.2 s timeout
        cache.lookup([(0, 4)])
    with pytest.raises(ExpertReadError, match="not filled within 0.2 s"):
        cache.wait([(0, 0)])
    settle_all = lambda: [f.set_result(None) for f in gates.values() if not f.done()]
    settle_all()
    assert list(cache.wait([(0, 1), (0, 0)])) == [slots[1], slots[0]]
    for i in range(5, 30):  # a flood of misses evicts only the unpinned pair
        cache.lookup([(0, i)])
        settle_all()
    assert {(0, 0), (0, 1)} <= set(cache.resident()) and (0, 2) not in cache
    cache.unpin([(0, 0), (0, 1)])
    for i in range(30, 33):
        cache.lookup([(0, i)])
    assert not cache.pinned() and len(cache.resident()) <= 4
    with pytest.raises(SlotCacheFull, match="5 distinct"):
        cache.lookup([(1, i) for i in range(5)])


def test_prefetch_does_not_block_and_failures_free_the_slot():
    release, calls = threading.Event(), []

    def delayed(keys, slots):
        calls.append(list(keys))
        fut = cf.Future()

        def later():
            release.wait(5)
            fut.set_exception(ExpertReadError("f.gguf", 0, 9, "EIO")) if (0, 9) in keys else fut.set_result(None)
        threading.Thread(target=later, daemon=True).start()
        return fut

    cache = SlotCache(3, delayed)
    t0 = time.perf_counter()
    assert cache.prefetch([(0, 1), (0, 2)]) == [(0, 1), (0, 2)] and time.perf_counter() - t0 < 1  # reads take 0.1 s
    _, misses = cache.lookup([(0, 1)], pin=True)
    assert misses == [] and cache.stats.prefetch_used == 1 and calls == [[(0, 1), (0, 2)]]
    threading.Timer(0.1, release.set).start()
    # One slot is free, the other frees only when (0, 2)'s prefetch settles: the demand waits for it, never fails.
    assert cache.lookup([(0, 5), (0, 6)])[1] == [(0, 5), (0, 6)] and (0, 2) not in cache
    cache.wait([(0, 1), (0, 5), (0, 6)])
    assert cache.stats.stall_s >= 0.05 and cache.stats.bytes == 0
    cache.unpin([(0, 1)])
    cache.lookup([(0, 9)])
    with pytest.raises(ExpertReadError, match="EIO"):
        cache.wait([(0, 9)])
    assert (0, 9) not in cache and cache.stats.failures == 1 and "stall_s" in cache.stats.to_dict()
    assert cache.lookup([(0, 9)])[1] == [(0, 9)]  # retried


# ---- stores ---------------------------------------------------------------------------------------------------


def _placement(layout):
    """Tier (layer + expert) mod 3; per layer and tier, local indices in expert order."""
    placement, count = {}, {}
    for layer, e in _all_keys(layout):
        t = (e + layer) % 3
        placement[(layer, e)], count[(layer, t)] = (t, count.get((layer, t), 0)), count.get((layer, t), 0) + 1
    return placement


def _bytes_at(stacks, i):
    """gate|up|down bytes of row i of three stacks (QTensors by kind, or a tuple of leaf arrays)."""
    leaves = [stacks[k].data for k in ("gate", "up", "down")] if isinstance(stacks, dict) else stacks
    return np.concatenate([np.asarray(leaf[i]).reshape(-1).view(np.uint8) for leaf in leaves])


@pytest.mark.parametrize("quant", ["q8", "f32"])
def test_stores_follow_the_placement(synthetic_model, quant):
    with open_model(synthetic_model("deepseek4", "tiny", quant)) as model, \
            ExpertReader(ExpertLayout.from_model(model), threads=2) as reader:
        layout, placement = reader.layout, _placement(reader.layout)
        stores = build_stores(layout, placement, reader, n_slots=4)
        dev, host, ssd = stores.device, stores.host, stores.ssd
        tier, local = stores.tier_table(layout)
        for (layer, e), (t, i) in placement.items():
            store = (dev, host, ssd)[t]
            assert store.contains(layer, e) and store.local_index(layer, e) == i
            assert not any(s.contains(layer, e) for s in (dev, host, ssd) if s is not store)
            assert (tier[layer, e], local[layer, e]) == (t, i)
            assert t == 2 or np.array_equal(_bytes_at(store.stacks[layer], i), _expected(model, layout, (layer, e)))
        assert host.stacks[0]["gate"].data.sharding.memory_kind == "pinned_host"
        assert dev.nbytes > 0 and host.nbytes > 0 and ssd.nbytes == 4 * layout.expert_nbytes(0)
        with pytest.raises(KeyError, match="not in tier 0"):
            dev.local_index(*next(k for k, (t, _) in placement.items() if t == 1))

        # Steps of two tier-2 experts through four slots: evictions, refills and device copies stay exact.
        ssd_keys = sorted(ssd.local)
        for step in range(6):
            keys = [ssd_keys[(2 * step) % len(ssd_keys)], ssd_keys[(2 * step + 5) % len(ssd_keys)]]
            ssd.prefetch([keys[1], (0, 0)])  # (0, 0) is not tier 2 here: ignored
            for key, slot in zip(keys, ssd.acquire(keys)):
                assert np.array_equal(_bytes_at(ssd.slots, slot), _expected(model, layout, key)), (step, key)
                assert ssd.slot_table()[key] == slot
            ssd.release(keys)
        assert ssd.stats.evictions > 0 and ssd.stats.lookups == 12 and not ssd.cache.pinned()

        # The host-call form (tiers/experts.py HostExpertSource): rows of the flagged experts, zeros elsewhere.
        experts = np.arange(6, dtype=np.int32)
        rows = ssd.fetch(2, experts, tier[2, experts] == 2)
        for e in experts:
            want = _expected(model, layout, (2, e)) if tier[2, e] == 2 else np.zeros(layout.expert_nbytes(2), np.uint8)
            assert np.array_equal(_bytes_at(rows, e), want), e
        assert rows[0].dtype == (np.float32 if quant == "f32" else np.uint8) and not ssd.cache.pinned()
        # Union-sized answers (more than a decode step's rows) come from reused arenas: each call's own rows are
        # exact, and the arena of two calls back is handed out again rather than new memory.
        n_exp = tier.shape[1]
        answers = []
        for n in (12, 10, 12):
            experts = np.concatenate([np.arange(n_exp), np.zeros(n - n_exp, int)]).astype(np.int32)
            flagged = (tier[2, experts] == 2) & (np.arange(n) < n_exp)
            rows = ssd.fetch(2, experts, flagged)
            for k, e in enumerate(experts):
                want = (_expected(model, layout, (2, e)) if flagged[k]
                        else np.zeros(layout.expert_nbytes(2), np.uint8))
                assert np.array_equal(_bytes_at(rows, k), want), (n, k)
            answers.append(rows)
        assert np.shares_memory(answers[0][0], answers[2][0]) and not np.shares_memory(answers[0][0], answers[1][0])

        # The graph's view: products from a store's stack or slots equal those from the whole GGUF stack.
        product = jax.jit(qmatvec_experts)  # eager dispatch of its many small ops costs seconds on CPU
        x = jnp.asarray(np.random.default_rng(0).standard_normal(64), jnp.float32)
        full = load_params(model.config, model)["blocks"][1]
        mine, theirs = [e for (lay, e) in sorted(dev.local) if lay == 1], [k for k in ssd_keys if k[0] == 1][:2]
        np.testing.assert_array_equal(product(x, dev.stacks[1]["gate"], jnp.asarray([local[1, e] for e in mine])),
                                      product(x, full["ffn_gate_exps"], jnp.asarray(mine)))
        slots = ssd.acquire(theirs)
        np.testing.assert_array_equal(product(x, ssd.slots["up"], jnp.asarray(slots)),
                                      product(x, full["ffn_up_exps"], jnp.asarray([e for _, e in theirs])))
        ssd.release(theirs)


def test_placement_is_checked(layout):
    good = _placement(layout)
    assert sum(len(v) for v in split_placement(layout, good).values()) == len(good)
    tier = good[(0, 0)][0]
    for bad, match in [({k: v for k, v in good.items() if k != (2, 3)}, r"missing \[\(2, 3\)\]"),
                       ({**good, (0, 0): (tier, 7)}, f"tier {tier} layer 0: local indices"),
                       ({**good, (0, 0): (5, 0)}, "tier 5")]:
        with pytest.raises(ValueError, match=match):
            split_placement(layout, bad)
    rows = [[good[(layer, e)] for e in range(8)] for layer in layout.layers]  # Placement's [layer][expert] tables
    tables = types.SimpleNamespace(tier=[[t for t, _ in r] for r in rows], slot=[[i for _, i in r] for r in rows])
    assert placement_dict(tables) == good


# ---- loader ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "open-refused"])
def test_loader_bytes_identical(q8, mode):
    names = [n for n in q8.tensors if "exps" not in n][:40] + ["blk.2.ffn_down_exps.weight"]
    kw = {"open_fn": _refuse_direct_open} if mode == "open-refused" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = load_tensors(q8, names, progress=False, chunk_bytes=8192, **kw)
    for n in names:
        assert res.arrays[n].shape == q8.raw(n).shape and np.array_equal(res.arrays[n], q8.raw(n)), n
    assert res.bytes == sum(q8.tensors[n].n_bytes for n in names) and res.gbps > 0 and res.seconds > 0
    fell_back = [w for w in caught if issubclass(w.category, DirectIOUnavailable)]
    assert len(fell_back) == (0 if res.direct_io else 1)
    if mode == "open-refused":
        assert not res.direct_io and res.summary()["fallback_reason"]
    put = load_tensors(q8, names[:3], progress=False, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert all(isinstance(a, jax.Array) and np.array_equal(np.asarray(a), q8.raw(n)) for n, a in put.arrays.items())


def test_loader_faults_name_the_tensor(q8, tmp_path):
    copy = tmp_path / "cut.gguf"
    shutil.copyfile(q8.path, copy)
    with open_model(copy) as model:
        name = "blk.3.ffn_down_shexp.weight"
        os.truncate(copy, model.tensors[name].offset + 100)
        with pytest.raises(ModelFileError, match="short read") as info:
            load_tensors(model, [name, "token_embd.weight"], progress=False)
        assert info.value.tensor == name and info.value.path == str(copy)

    release, t0 = threading.Event(), time.perf_counter()
    try:
        with pytest.raises(ModelFileError, match="no progress"):
            load_tensors(q8, ["token_embd.weight"], progress=False, stall_timeout_s=0.3, read_fn=_stuck_until(release))
    finally:
        release.set()
    assert time.perf_counter() - t0 < 5
    with pytest.raises(ModelFileError, match="no such tensor"):
        load_tensors(q8, ["nope.weight"], progress=False)
