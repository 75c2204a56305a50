"""The expert slot cache of tier 2: which streamed expert sits in which of a fixed number of slots, and when to
read one in. Policy, residency and the asynchronous fill state machine only; the bytes are moved by a `load`
function (SsdStore passes one that reads with the ExpertReader straight into the host row of the slot).

Policy: LRU with a frequency prior. Every demanded key access advances a clock; an entry's score is
`last_use + alpha * log2(1 + demand_count)` and the victim is the unpinned, filled entry of lowest score. So an
expert used 2^k times is kept as if it had been used alpha*k accesses more recently (default alpha: two cache
turnovers, 2 * n_slots); `alpha = 0` is exact LRU (tests/test_tiers_io.py checks it against a reference LRU,
and that the prior wins on a skewed trace: DESIGN.md §9 quotes 8-18% hits for LRU on V4-Flash decode and 46%
with frequency pinning at the same size). Demand counts
are kept for every key ever asked for, resident or not (at most layers x experts, ~11k for V4-Flash), so a hot
expert evicted by a burst comes back with its history.

Lifetime rules (why the states exist):
- `pin(keys)` / `lookup(..., pin=True)` protect the entries a running step reads: a pinned slot is never evicted
  or refilled mid-step (DESIGN.md §3: evictions never stall a running step). Pins count; `unpin` balances them.
- An entry being filled ("loading") is never evicted either: its read writes into the slot's host row, and
  handing the slot to another expert before the read settles could mix two experts' bytes. A fill that times out
  in `wait` keeps its slot busy until the read itself settles.
- A failed fill frees its slot and is reported by `wait` as ExpertReadError; the next lookup of that key retries.
- A demand that finds every slot pinned or filling waits (counted as stall) for a fill to settle instead of
  failing: prefetches in flight must not break a step. A prefetch never waits and never evicts a pinned entry.

Thread-safety: all state sits under one condition variable; fills complete on reader threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np

from jds41.tiers.ssd import ExpertReadError, Key
from jds41.tiers.stats import TierStats

LoadFn = Callable[[list[Key], dict[Key, int]], cf.Future]


class SlotCacheFull(RuntimeError):
    """More distinct experts asked for than there are slots that are not pinned or filling."""


class SlotCache:
    """`n_slots` expert slots. `load(keys, {key: slot}) -> Future` starts filling slots and must settle the future
    (with any result, or an exception) when the bytes are in place. `entry_bytes(key)` feeds the byte counter."""

    def __init__(self, n_slots: int, load: LoadFn, *, alpha: float | None = None, timeout_s: float = 30.0,
                 entry_bytes: Callable[[Key], int] = lambda key: 0, path_of: Callable[[Key], str] = lambda key: "?"):
        if n_slots < 1:
            raise ValueError(f"a slot cache needs at least one slot, got {n_slots}")
        # Default: a doubling of use is worth two turnovers of the cache. On a Zipf(1) trace of 64 experts (4 per
        # step) that took 16 slots from 55% (LRU) to 64% hits; larger alphas gained little and adapted worse when
        # the hot set moved (demand counts never decay).
        self.alpha = 2.0 * n_slots if alpha is None else float(alpha)
        self.n_slots, self.timeout_s = n_slots, timeout_s
        self._load, self._entry_bytes, self._path_of = load, entry_bytes, path_of
        self.stats = TierStats(tier=2)
        self._cond = threading.Condition()  # an RLock: a load that settles at once may call back on this thread
        self._slot: dict[Key, int] = {}  # resident or loading
        self._ready: set[Key] = set()
        self._errors: dict[Key, ExpertReadError] = {}
        self._pins: Counter[Key] = Counter()
        self._last: dict[Key, int] = {}
        self._freq: Counter[Key] = Counter()
        self._prefetched: set[Key] = set()
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._heap: list[tuple[float, int, Key]] = []  # (score, tick, key); stale rows skipped on pop
        self._tick = 0
        self._filled: list[tuple[Key, int]] = []  # since the last drain_filled()

    # ---- policy -------------------------------------------------------------------------------------------------

    def _touch(self, key: Key) -> None:
        self._tick += 1
        self._last[key] = self._tick
        heapq.heappush(self._heap, (self._score(key), self._tick, key))
        if len(self._heap) > 4 * self.n_slots + 64:  # drop stale rows now and then: the heap stays O(slots)
            self._heap = [(self._score(k), self._last[k], k) for k in self._slot if k in self._last]
            heapq.heapify(self._heap)

    def _score(self, key: Key) -> float:
        return self._last[key] + self.alpha * math.log2(1 + self._freq[key])

    def _take_slot(self, protect: set[Key]) -> int:
        if self._free:
            return self._free.pop()
        skipped, victim = [], None
        while self._heap:
            row = heapq.heappop(self._heap)
            key = row[2]
            if key not in self._slot or row[1] != self._last[key]:
                continue  # stale: the key was touched again or left the cache
            if self._pins[key] or key not in self._ready or key in protect:
                skipped.append(row)
                continue
            victim = key
            break
        for row in skipped:
            heapq.heappush(self._heap, row)
        if victim is None:
            raise SlotCacheFull(f"all {self.n_slots} slots are pinned, filling or asked for by this call")
        self.stats.evictions += 1
        self._ready.discard(victim)
        self._prefetched.discard(victim)
        return self._slot.pop(victim)

    def _claim(self, keys: list[Key], protect: set[Key], wait: bool) -> dict[Key, int]:
        """Slots for keys not yet resident; all or nothing (a failure gives back what this call took). With
        `wait`, a demand that finds every slot pinned or filling waits for fills to settle (prefetches in flight
        must not fail a step), up to the timeout; without, it fails at once (a prefetch never waits)."""
        got: dict[Key, int] = {}
        deadline = time.perf_counter() + self.timeout_s
        try:
            for key in keys:
                while key not in self._slot:
                    try:
                        got[key] = self._slot[key] = self._take_slot(protect)
                        self._errors.pop(key, None)
                    except SlotCacheFull:
                        filling = any(k not in self._ready and k not in protect for k in self._slot)
                        left = deadline - time.perf_counter()
                        if not (wait and filling and left > 0):
                            raise
                        t0 = time.perf_counter()
                        self._cond.wait(left)
                        self.stats.stall_s += time.perf_counter() - t0
        except SlotCacheFull:
            for key, slot in got.items():
                del self._slot[key]
                self._free.append(slot)
            raise
        return got

    # ---- requests -----------------------------------------------------------------------------------------------

    def lookup(self, keys: Iterable[Key], pin: bool = False) -> tuple[np.ndarray, list[Key]]:
        """Slot ids (int32, aligned with `keys`) and the keys that missed; reads for misses start now, without
        blocking (unless every slot is pinned or filling: then it waits for a fill to settle, counted as stall).
        Slots of misses (and of hits still filling) are valid once `wait(keys)` returns. Lookups and pins come
        from the one step thread; prefetch may come from any."""
        keys = [(int(k[0]), int(k[1])) for k in keys]
        protect = set(keys)
        if len(protect) > self.n_slots:
            raise SlotCacheFull(f"{len(protect)} distinct experts asked for, only {self.n_slots} slots")
        with self._cond:
            new = self._claim(keys, protect, wait=True)
            for key in keys:
                self._freq[key] += 1
                self._touch(key)
                if key in self._prefetched and key not in new:
                    self._prefetched.discard(key)
                    self.stats.prefetch_used += 1
            if pin:
                self._pins.update(protect)
            self.stats.lookups += len(keys)
            self.stats.misses += len(new)
            self.stats.hits += len(keys) - len(new)
            slots = np.array([self._slot[k] for k in keys], np.int32)
        self._start(new)
        return slots, list(new)

    def prefetch(self, keys: Iterable[Key]) -> list[Key]:
        """Start reading keys that are not resident, as far as unpinned slots allow; never blocks, never counts
        as use (a wrong prediction must not raise an expert's frequency). Returns the keys whose read started."""
        keys = list(dict.fromkeys((int(k[0]), int(k[1])) for k in keys))
        new: dict[Key, int] = {}
        with self._cond:
            for key in keys:
                if key in self._slot:
                    continue
                try:
                    new.update(self._claim([key], set(keys), wait=False))
                except SlotCacheFull:
                    break  # a prediction is never worth evicting what a step has pinned
                self._touch(key)
                self._prefetched.add(key)
            self.stats.prefetches += len(new)
        self._start(new)
        return list(new)

    def _start(self, new: dict[Key, int]) -> None:
        if not new:
            return
        keys = list(new)
        try:
            fut = self._load(keys, dict(new))
        except Exception as e:  # noqa: BLE001 - a load that fails at once fails like one that fails later
            fut = cf.Future()
            fut.set_exception(e)
        fut.add_done_callback(lambda f: self._settled(keys, new, f))

    def _settled(self, keys: list[Key], slots: dict[Key, int], fut: cf.Future) -> None:
        exc = fut.exception()
        with self._cond:
            for key in keys:
                if self._slot.get(key) != slots[key]:
                    continue  # cannot happen while loading entries are unevictable; kept as a guard
                if exc is None:
                    self._ready.add(key)
                    self._filled.append((key, slots[key]))
                    self.stats.bytes += self._entry_bytes(key)
                    continue
                self.stats.failures += 1
                self._errors[key] = exc if isinstance(exc, ExpertReadError) else ExpertReadError(
                    self._path_of(key), *key, f"{type(exc).__name__}: {exc}")
                self._prefetched.discard(key)
                self._free.append(self._slot.pop(key))
            self._cond.notify_all()

    def wait(self, keys: Iterable[Key], timeout: float | None = None) -> np.ndarray:
        """Block until every key's slot is filled; returns the slot ids. Raises ExpertReadError if a fill failed
        or did not finish within the timeout, KeyError for a key never looked up."""
        keys = [(int(k[0]), int(k[1])) for k in keys]
        timeout = self.timeout_s if timeout is None else timeout
        t0 = time.perf_counter()
        with self._cond:
            while True:
                pending = [k for k in keys if k not in self._ready]
                for key in pending:
                    if key not in self._slot:
                        if key in self._errors:
                            raise self._errors[key]
                        raise KeyError(f"expert {key} was not looked up (or was evicted unpinned)")
                if not pending:
                    break
                left = t0 + timeout - time.perf_counter()
                if left <= 0:
                    self.stats.stall_s += time.perf_counter() - t0
                    key = pending[0]
                    raise ExpertReadError(self._path_of(key), *key, f"slot not filled within {timeout:g} s")
                self._cond.wait(left)
            self.stats.stall_s += time.perf_counter() - t0
            return np.array([self._slot[k] for k in keys], np.int32)

    def pin(self, keys: Iterable[Key]) -> None:
        keys = [(int(k[0]), int(k[1])) for k in keys]
        with self._cond:
            absent = [k for k in keys if k not in self._slot]
            if absent:
                raise KeyError(f"cannot pin experts that are not in the cache: {absent}")
            self._pins.update(keys)

    def unpin(self, keys: Iterable[Key]) -> None:
        with self._cond:
            for key in keys:
                key = (int(key[0]), int(key[1]))
                if self._pins[key] <= 1:
                    del self._pins[key]
                else:
                    self._pins[key] -= 1

    # ---- views ---------------------------------------------------------------------------------------------------

    def drain_filled(self) -> list[tuple[Key, int]]:
        """(key, slot) filled since the last call and still holding that key: what the device copy must take."""
        with self._cond:
            filled, self._filled = self._filled, []
            return [(k, s) for k, s in filled if self._slot.get(k) == s and k in self._ready]

    def resident(self) -> dict[Key, int]:
        """Filled entries: key -> slot."""
        with self._cond:
            return {k: self._slot[k] for k in self._ready}

    def pinned(self) -> set[Key]:
        with self._cond:
            return set(self._pins)

    def __contains__(self, key: Key) -> bool:
        with self._cond:
            return key in self._ready
