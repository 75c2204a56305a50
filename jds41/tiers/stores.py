"""Where routed experts live and the small interface the model reads them through (STYLE.md: moving bytes sits
behind a small interface; placement is data).

Owns:
- `ExpertLayout`: where each routed expert's gate/up/down bytes sit in the GGUF (shard path, absolute offset,
  length). Expert `e` of a stack `[E, out, in]` is the contiguous range `offset + e * (n_bytes // E)`.
- `ExpertStore`: `tier`, `contains(layer, expert)`, `local_index(layer, expert)`, `nbytes`.
- `DeviceStore` (tier 0): per layer a stacked QTensor of its tier-0 experts in device memory (HBM).
- `HostStore` (tier 1): the same stacks placed in `pinned_host` memory where the backend has that memory kind
  (on CPU the kind is a label: DESIGN.md §7), else in device memory with `note` saying so.
- `SsdStore` (tier 2): an ExpertReader feeding a SlotCache whose slots are a host staging array `[S, bytes]` and,
  per stack kind, a device QTensor `[S, out, in]` the graph gathers from by slot id. A prefill group's union
  call starts reading the next SSD layer's whole set (`read_ahead`), so those reads overlap this layer's compute.
- `build_stores(layout, placement, reader, n_slots)`: all three from a placement {(layer, expert): (tier, local)}
  (the planner, tiers/placement.py, writes it; a plain dict here so this module does not depend on it).

Tier-0/1 stacks are per layer with local indices 0..n-1 in placement order. A layer with no expert in a tier
still gets one zero row, so a graph that gathers with clamped indices from every store has something to index
(its contribution is masked by the tier table). Expert bytes stay quantized everywhere (DESIGN.md §1).
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import dataclasses
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from jds41.quant import QTensor
from jds41.quant.planar import regrouped, to_planar_on_device
from jds41.tiers.slot_cache import SlotCache
from jds41.tiers.ssd import ExpertReader, Key, aligned_empty

KINDS = ("gate", "up", "down")
_STACK = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


@dataclasses.dataclass(frozen=True)
class Stack:
    """One routed-expert stack tensor `[E, out, in]` as stored."""

    kind: str
    name: str
    path: str
    offset: int
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    expert_bytes: int
    stride: int = 0  # bytes from one expert's piece to the next: expert_bytes in a GGUF, the chunk size in Orbax

    def piece(self, expert: int) -> tuple[str, int, int]:
        return self.path, self.offset + expert * (self.stride or self.expert_bytes), self.expert_bytes


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """layer -> (gate, up, down) stacks. An expert's bytes, as the reader returns them, are gate|up|down."""

    stacks: dict[int, tuple[Stack, Stack, Stack]]
    # check(key, [gate, up, down]) -> None or why the bytes are bad: an Orbax checkpoint's chunk checksum
    check: Callable[[Key, list[np.ndarray]], str | None] | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_model(cls, model) -> ExpertLayout:
        """From an open jds41.checkpoints GGUFModel (only its tensor directory is used, never its maps) or Orbax
        checkpoint (its stacks are strided by the chunk size and its chunks carry checksums)."""
        found: dict[int, dict[str, Stack]] = {}
        for name, t in model.tensors.items():
            m = _STACK.match(name)
            if not m:
                continue
            if len(t.shape) != 3 or t.n_bytes % t.shape[0]:
                raise ValueError(f"{t.shard}: {name}: shape {t.shape} / {t.n_bytes} bytes is not an expert stack")
            found.setdefault(int(m[1]), {})[m[2]] = Stack(m[2], name, t.shard, t.offset, t.ggml_type, t.shape,
                                                          t.n_bytes // t.shape[0], getattr(t, "expert_stride", 0))
        stacks = {}
        for layer, by_kind in sorted(found.items()):
            if set(by_kind) != set(KINDS) or len({s.shape[0] for s in by_kind.values()}) != 1:
                raise ValueError(f"layer {layer}: expert stacks {sorted(by_kind)} are incomplete or disagree on E")
            stacks[layer] = tuple(by_kind[k] for k in KINDS)
        return cls(stacks, getattr(model, "check_expert", None))

    @property
    def layers(self) -> list[int]:
        return list(self.stacks)

    def n_experts(self, layer: int) -> int:
        return self.stacks[layer][0].shape[0]

    def expert_nbytes(self, layer: int) -> int:
        return sum(s.expert_bytes for s in self.stacks[layer])

    def signature(self, layer: int) -> tuple:
        """What a slot must hold for this layer's experts: (qtype, per-expert shape) of gate, up, down."""
        return tuple((s.qtype, s.shape[1:]) for s in self.stacks[layer])

    def pieces(self, key: Key) -> list[tuple[str, int, int]]:
        layer, expert = key
        if layer not in self.stacks or not 0 <= expert < self.n_experts(layer):
            raise KeyError(f"no routed expert {expert} in layer {layer}")
        return [s.piece(expert) for s in self.stacks[layer]]

    def split(self, layer: int, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Views of one expert's gate|up|down bytes, each as raw rows `[out, row_bytes]` (like GGUFModel.raw)."""
        out, at = {}, 0
        for s in self.stacks[layer]:
            out[s.kind] = buf[at:at + s.expert_bytes].reshape(s.shape[1], -1)
            at += s.expert_bytes
        return out


def split_placement(layout: ExpertLayout, placement: dict[Key, tuple[int, int]]) -> dict[int, dict[Key, int]]:
    """{tier: {key: local index}}, checked: every expert of the layout placed once, tiers 0-2, and per layer the
    tier-0/1 local indices exactly 0..n-1 (they are row numbers of that layer's stack)."""
    want = {(layer, e) for layer in layout.layers for e in range(layout.n_experts(layer))}
    got = {(int(k[0]), int(k[1])): (int(t), int(i)) for k, (t, i) in placement.items()}
    if set(got) != want:
        missing, extra = sorted(want - set(got)), sorted(set(got) - want)
        raise ValueError(f"placement does not cover the model's experts: missing {missing[:8]}, unknown {extra[:8]}")
    tiers: dict[int, dict[Key, int]] = {0: {}, 1: {}, 2: {}}
    for key, (tier, local) in sorted(got.items()):
        if tier not in tiers:
            raise ValueError(f"expert {key}: tier {tier} is not 0, 1 or 2")
        tiers[tier][key] = local
    for tier in (0, 1):
        for layer in layout.layers:
            idx = sorted(i for (lay, _), i in tiers[tier].items() if lay == layer)
            if idx != list(range(len(idx))):
                raise ValueError(f"tier {tier} layer {layer}: local indices {idx[:8]}... are not 0..{len(idx) - 1}")
    return tiers


class ExpertStore(abc.ABC):
    """One tier's experts. `local_index` is where the tier's own arrays hold an expert: a stack row for tiers 0/1,
    the planner's number for tier 2 (whose rows in memory are slots, given per step by `SsdStore.acquire`)."""

    tier: int

    def __init__(self, local: dict[Key, int]):
        self.local = dict(local)

    def contains(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.local

    def local_index(self, layer: int, expert: int) -> int:
        try:
            return self.local[(layer, expert)]
        except KeyError:
            raise KeyError(f"expert {expert} of layer {layer} is not in tier {self.tier}") from None

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this tier holds in memory (what its budget counts)."""


def _stacks_for(layout: ExpertLayout, local: dict[Key, int], reader: ExpertReader,
                sharding: jax.sharding.Sharding, planar: bool = False) -> dict[int, dict[str, QTensor]]:
    """Per layer, the experts of `local` read (O_DIRECT, straight into the stack rows) and placed with `sharding`;
    with `planar`, PLANAR_TYPES stacks are regrouped into planar rows on the way (quant/planar.py)."""
    stacks = {}
    for layer in layout.layers:
        keys = sorted((k for k in local if k[0] == layer), key=local.get)
        # At least 2 rows: XLA:GPU turns indexing a 1-row array into a bitcast, which may not cross from pinned
        # host memory to the device (seen on the H200, jax 0.11.2: "Bitcast cannot have different memory spaces").
        rows = max(len(keys), 2)
        bufs = [np.zeros((rows, s.expert_bytes), np.uint8) for s in layout.stacks[layer]]
        if keys:
            nbytes = len(keys) * layout.expert_nbytes(layer)
            # A layer may be hundreds of MB: allow 20 MB/s at least before calling the disk stuck.
            reader.read(keys, out={k: [b[i] for b in bufs] for i, k in enumerate(keys)},
                        timeout=max(reader.timeout_s, nbytes / 20e6))
        stacks[layer] = {s.kind: _put(QTensor.from_raw(b, s.qtype, (rows, *s.shape[1:])), sharding, planar)
                         for s, b in zip(layout.stacks[layer], bufs)}
    return stacks


def _put(q: QTensor, sharding: jax.sharding.Sharding, planar: bool = False) -> QTensor:
    """`q` placed with `sharding`; with `planar` (and a format that has the layout) regrouped on the way. The
    regrouping runs on the device (numpy did it at 0.2-0.3 GB/s), one stack at a time."""
    if planar and regrouped(q.qtype):
        rows = to_planar_on_device(jax.device_put(q.data, jax.devices()[0]), q.qtype)
        return q.with_layout(jax.device_put(rows, sharding), "planar")
    return dataclasses.replace(q, data=jax.device_put(q.data, sharding))


class _StackedStore(ExpertStore):
    def __init__(self, layout: ExpertLayout, local: dict[Key, int], reader: ExpertReader,
                 sharding: jax.sharding.Sharding, planar: bool = False):
        super().__init__(local)
        self.sharding = sharding
        self.stacks = _stacks_for(layout, self.local, reader, sharding, planar)

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for by_kind in self.stacks.values() for q in by_kind.values())


class DeviceStore(_StackedStore):
    """Tier 0: `stacks[layer][kind]` is a QTensor `[n_local (>= 1), out, in]` in device memory."""

    tier = 0

    def __init__(self, layout: ExpertLayout, local: dict[Key, int], reader: ExpertReader, device=None,
                 planar: bool = False):
        super().__init__(layout, local, reader, jax.sharding.SingleDeviceSharding(device or jax.devices()[0]), planar)


def memory_kinds(device) -> set[str]:
    return {m.kind for m in device.addressable_memories()}


class HostStore(_StackedStore):
    """Tier 1: the stacks in `pinned_host` memory when the backend has it (on the GPU box it does; on CPU it is a
    label), else in device memory with `note` saying so: the results are the same, only the budget moves."""

    tier = 1

    def __init__(self, layout: ExpertLayout, local: dict[Key, int], reader: ExpertReader, device=None,
                 planar: bool = False):
        device = device or jax.devices()[0]
        if "pinned_host" in memory_kinds(device):
            sharding, self.note = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"), ""
        else:
            sharding = jax.sharding.SingleDeviceSharding(device)
            self.note = f"{device.platform} has no pinned_host memory kind: tier 1 held in device memory"
        super().__init__(layout, local, reader, sharding, planar)


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# Answer buffers of SSD host calls kept for reuse (SsdStore._answer_buffers): sets per row count, and the largest
# row count kept so (decode answers); larger answers (a prefill or verify union) take views of ANSWER_ARENAS sets
# that grow to the largest answer asked for.
ANSWER_RING, ANSWER_RING_MAX_ROWS, ANSWER_ARENAS = 4, 8, 2

# A host call asking for at least this share of its layer's SSD experts answers a prefill group's union (decode
# and a verify ask for a few): the group's next layer will ask for most of its set too, so `read_ahead` starts
# reading that set while this layer computes. V4-Flash lucebox, 4K groups: 86 of 86 per layer, 1.15 GB per call,
# and the call waited for every byte of it (stall 37 s of a 61 s 20K prefill, H200, experiments/README.md).
SET_AHEAD_SHARE = 0.5
# Rows an answer copies out of the slots before the copy is spread over threads: a union answer is ~1.2 GB, about
# 0.15 s for one thread, which every layer of a prefill group waits for; decode answers (<= K rows) stay inline.
PARALLEL_COPY_ROWS = 16
COPY_THREADS = 8

# Donating the slot array updates it in place: a refill must not cost a second copy of all slots.
_set_rows = jax.jit(lambda a, i, v: a.at[i].set(v), donate_argnums=0)


class SsdStore(ExpertStore):
    """Tier 2. All its layers must share one expert signature (types and shapes), because slots are shared.

    Per step: `prefetch(keys)` as early as the keys are predicted; `acquire(keys) -> slot ids` pins them, waits
    for their fills and copies new slots to the device; the step gathers `slots[kind]` by those ids; then
    `release(keys)`. The host staging array keeps every slot's bytes, so a device copy never re-reads the SSD.
    """

    tier = 2

    def __init__(self, layout: ExpertLayout, local: dict[Key, int], reader: ExpertReader, n_slots: int, *,
                 device=None, memory_kind: str | None = None, alpha: float | None = None,
                 timeout_s: float | None = None):
        super().__init__(local)
        layers = sorted({k[0] for k in self.local})
        signatures = {layout.signature(layer) for layer in layers}
        if len(signatures) > 1:
            raise ValueError(f"tier-2 layers {layers} mix expert types/shapes {signatures}: one slot shape needed")
        self.layout, self.reader = layout, reader
        self.proto = layout.stacks[layers[0]] if layers else layout.stacks[layout.layers[0]]
        self.slot_bytes = sum(s.expert_bytes for s in self.proto)
        self.host = aligned_empty(n_slots * self.slot_bytes).reshape(n_slots, self.slot_bytes)
        self.cache = SlotCache(n_slots, self._load, alpha=alpha,
                               timeout_s=reader.timeout_s if timeout_s is None else timeout_s,
                               entry_bytes=lambda key: self.slot_bytes,
                               path_of=lambda key: layout.pieces(key)[0][0])
        self.stats = self.cache.stats
        self._answers: dict[int, list[list[np.ndarray]]] = {}  # rows -> ring of answer buffer sets (_answer_buffers)
        self._answer_turn: dict[int, int] = {}
        self._arenas: list[list[np.ndarray]] = [[] for _ in range(ANSWER_ARENAS)]  # large answers: views of these
        self._arena_turn = 0
        by_layer: dict[int, list[Key]] = {}
        for key in sorted(self.local):
            by_layer.setdefault(key[0], []).append(key)
        self._layer_keys = by_layer  # layer -> its tier-2 keys, for read_ahead
        self.set_ahead = True  # read_ahead on (False: the reference and A/B runs)
        self._passes_left = 0  # union passes the feed said it runs, this one included (expect_passes)
        self._copier: cf.ThreadPoolExecutor | None = None  # answer copies of union-sized calls, made when first used
        sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0], memory_kind=memory_kind)
        self.slots = {s.kind: _put(QTensor.from_raw(np.zeros((n_slots, s.expert_bytes), np.uint8), s.qtype,
                                                    (n_slots, *s.shape[1:])), sharding) for s in self.proto}

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.slots.values())

    @property
    def backing_nbytes(self) -> int:
        """Bytes of this tier's experts on the SSD."""
        return len(self.local) * self.slot_bytes

    def _load(self, keys: list[Key], slots: dict[Key, int]):
        # The reader copies each expert straight into its slot's host row; the slot cache keeps the slot busy
        # until this future settles, so no other expert's bytes can land there meanwhile.
        return self.reader.submit(keys, out={k: self.host[s] for k, s in slots.items()})

    def _own(self, keys) -> list[Key]:
        keys = [(int(k[0]), int(k[1])) for k in keys]
        foreign = [k for k in keys if k not in self.local]
        if foreign:
            raise KeyError(f"experts {foreign[:8]} are not in tier 2")
        return keys

    def prefetch(self, keys) -> list[Key]:
        """Start reads for predicted keys (those of this tier); never blocks."""
        return self.cache.prefetch([(int(k[0]), int(k[1])) for k in keys if (int(k[0]), int(k[1])) in self.local])

    def _pin_and_wait(self, keys: list[Key], timeout: float | None) -> np.ndarray:
        self.cache.lookup(keys, pin=True)
        try:
            return self.cache.wait(keys, timeout)
        except Exception:
            self.cache.unpin(set(keys))
            raise

    def acquire(self, keys, timeout: float | None = None) -> np.ndarray:
        """Pin `keys`, wait for their bytes, bring new slots to the device; slot ids aligned with `keys`."""
        keys = self._own(keys)
        slots = self._pin_and_wait(keys, timeout)
        self.sync()
        return slots

    def fetch(self, layer: int, experts: np.ndarray, on_ssd: np.ndarray) -> tuple[np.ndarray, ...]:
        """The `HostExpertSource` call of tiers/experts.py (one host call per layer on an actual miss): the rows of
        the experts flagged `on_ssd` as gate, up, down arrays `[K, out, in]` in the stacks' leaf layout (raw
        uint8 rows, or native floats for F32/F16/BF16), through the slot cache; unflagged rows are zero.
        Each stack is filled in its own contiguous buffer, one copy per row, so handing it to the graph copies
        nothing more (cutting the stacks out of one [K, slot_bytes] buffer made a strided copy of all K rows)."""
        t0 = time.perf_counter()
        experts, on_ssd = np.asarray(experts).reshape(-1), np.asarray(on_ssd, bool).reshape(-1)
        at_k = np.flatnonzero(on_ssd)
        keys = self._own([(layer, experts[k]) for k in at_k])
        bufs = self._answer_buffers(len(experts))
        for b in bufs:
            b[~on_ssd] = 0
        if keys:
            slots = self._pin_and_wait(keys, None)
            t1 = time.perf_counter()
            try:  # copied while pinned: the slots cannot be refilled under us
                self._copy_out(bufs, at_k, slots)
            finally:
                self.cache.unpin(set(keys))
            self.stats.copy_s += time.perf_counter() - t1
        out = tuple(QTensor.from_raw(b, s.qtype, (len(experts), *s.shape[1:])).data for b, s in zip(bufs, self.proto))
        self.stats.host_calls += 1
        self.stats.answer_rows += len(experts)
        self.stats.host_call_s += time.perf_counter() - t0
        return out

    def _copy_out(self, bufs: list[np.ndarray], at_k: np.ndarray, slots: np.ndarray) -> None:
        """Answer row k of each stack from its slot's host row. Rows are disjoint, and numpy releases the GIL while
        it copies, so a union-sized answer is copied on COPY_THREADS threads."""
        jobs, at = [], 0
        for b, s in zip(bufs, self.proto):
            jobs += [(b[k], self.host[slot, at:at + s.expert_bytes]) for k, slot in zip(at_k, slots)]
            at += s.expert_bytes
        if len(at_k) < PARALLEL_COPY_ROWS:
            for dst, src in jobs:
                np.copyto(dst, src)
            return
        if self._copier is None:
            self._copier = cf.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="jds41-answer")
        list(self._copier.map(lambda job: np.copyto(*job), jobs))  # list(): waits, and re-raises a failed copy

    def read_ahead(self, layer: int, asked: int) -> list[Key]:
        """Called once a host call of `layer` has its answer (tiers/experts.source_fetch). If it asked for at least
        SET_AHEAD_SHARE of the layer's tier-2 experts (a prefill group's union), start reading every tier-2 expert
        of the next layer that has any: that layer's call, made once its routing is known, finds them read or in
        flight. A prefetch: it never waits, never evicts a pinned slot, never counts as use. Returns the keys whose
        read started."""
        mine = self._layer_keys.get(layer, ())
        if not (self.set_ahead and mine) or asked < SET_AHEAD_SHARE * len(mine):
            return []
        later = [n for n in self._layer_keys if n > layer]
        if later:
            target = min(later)
        else:  # a pass's last SSD layer: the next pass, if one is coming, starts with the first SSD layer
            passes, self._passes_left = self._passes_left, max(0, self._passes_left - 1)
            if passes <= 1:
                return []
            target = min(self._layer_keys)
        started = self.prefetch(self._layer_keys[target])
        self.stats.set_ahead += len(started)
        return started

    def expect_passes(self, n: int) -> None:
        """Say that `n` union passes (prefill groups, this feed's and any the caller will feed right after) are
        about to run. After each but the last, `read_ahead` of the last SSD layer starts the first SSD layer's set
        for the next pass: without it every pass read that layer with nothing to overlap (on the H200, V4-Flash
        lucebox: 340 of 3,435 experts at 20K, 1,105 of 10,990 at 54K, results/bench_prefill_set_ahead_v4_8L_h200
        and bench_prefill_matrix_54k_v4_8L_h200). A count, not a guess at routing: a pass's union holds nearly
        every SSD expert of a layer; a wrong count costs one layer's read, never a bit."""
        self._passes_left = max(0, int(n))

    def close(self) -> None:
        """Stop the answer-copy threads (the reader is closed by whoever opened it)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def _answer_buffers(self, n: int) -> list[np.ndarray]:
        """Per stack a [n, expert_bytes] buffer for a host call's answer. Small answers (decode: 1, 2 or K rows)
        come from a ring of ANSWER_RING sets per size, allocated once: a fresh 10 MB buffer costs its page faults
        on first touch, several times the copy itself (about 4 ms per expert row against 0.4 ms reused, measured
        with numpy). A set is reused only ANSWER_RING calls of its size later; by then the graph has consumed it,
        since each answer feeds the layer whose output the later calls' routing (or the next step) depends on."""
        if n > ANSWER_RING_MAX_ROWS:  # a union's answer (up to the layer's SSD experts, ~1.3 GB on V4.1): the
            # first n rows of an arena, so its pages fault once per run, not once per layer and group
            turn = self._arena_turn % ANSWER_ARENAS
            self._arena_turn += 1
            if not self._arenas[turn] or self._arenas[turn][0].shape[0] < n:
                self._arenas[turn] = [np.empty((n, s.expert_bytes), np.uint8) for s in self.proto]
            return [a[:n] for a in self._arenas[turn]]
        ring = self._answers.setdefault(n, [])
        turn = self._answer_turn.get(n, 0)
        self._answer_turn[n] = turn + 1
        if len(ring) < ANSWER_RING:
            ring.append([np.empty((n, s.expert_bytes), np.uint8) for s in self.proto])
        return ring[turn % ANSWER_RING]

    def release(self, keys) -> None:
        self.cache.unpin(set(self._own(keys)))

    def sync(self) -> None:
        """Copy slots filled since the last sync from the host staging rows to the device slot arrays."""
        filled = self.cache.drain_filled()
        if not filled:
            return
        idx = np.array([s for _, s in filled], np.int32)
        # Pad to a power of two with repeats (same index, same bytes): a handful of shapes compile, not one per
        # count. The fancy index copies the rows, so the device never aliases a host row that a later fill rewrites.
        idx = np.concatenate([idx, np.full(_bucket(len(idx)) - len(idx), idx[0], np.int32)])
        rows = self.host[idx]
        at = 0
        for s in self.proto:
            part = QTensor.from_raw(rows[:, at:at + s.expert_bytes], s.qtype, (len(idx), *s.shape[1:])).data
            q = self.slots[s.kind]
            self.slots[s.kind] = dataclasses.replace(q, data=_set_rows(q.data, jnp.asarray(idx), part))
            at += s.expert_bytes

    def slot_table(self) -> np.ndarray:
        """int32 [layers, experts]: the slot of each filled tier-2 expert, -1 elsewhere (a per-step graph input)."""
        n_layers = max(self.layout.layers) + 1
        table = np.full((n_layers, max(self.layout.n_experts(layer) for layer in self.layout.layers)), -1, np.int32)
        for (layer, expert), slot in self.cache.resident().items():
            table[layer, expert] = slot
        return table


@dataclasses.dataclass
class Stores:
    device: DeviceStore
    host: HostStore
    ssd: SsdStore | None  # None when the placement sends nothing to the SSD

    def tier_table(self, layout: ExpertLayout) -> tuple[np.ndarray, np.ndarray]:
        """Static graph inputs (they change only with the placement): int8 tier and int32 local index, [L, E]."""
        n_layers = max(layout.layers) + 1
        n_exp = max(layout.n_experts(layer) for layer in layout.layers)
        tier, local = np.full((n_layers, n_exp), -1, np.int8), np.full((n_layers, n_exp), -1, np.int32)
        for store in (self.device, self.host, self.ssd):
            for (layer, expert), i in (store.local.items() if store else ()):
                tier[layer, expert], local[layer, expert] = store.tier, i
        return tier, local


def placement_dict(placement) -> dict[Key, tuple[int, int]]:
    """{(layer, expert): (tier, local)} from a dict as is, or from any object with `tier[layer][expert]` and
    `slot[layer][expert]` tables (tiers/placement.py's Placement), without importing the planner."""
    if isinstance(placement, dict):
        return placement
    return {(layer, e): (int(t), int(placement.slot[layer][e]))
            for layer, row in enumerate(placement.tier) for e, t in enumerate(row)}


def build_stores(layout: ExpertLayout, placement, reader: ExpertReader, *, n_slots: int, device=None,
                 slot_memory_kind: str | None = None, alpha: float | None = None, planar: bool = False) -> Stores:
    """The three stores of a placement (a dict, or an object `placement_dict` takes). Tiers 0 and 1 are read
    now, layer by layer through `reader` (O_DIRECT, straight into the stack rows); tier 2 starts empty. `planar`:
    tiers 0 and 1 hold PLANAR_TYPES stacks in planar rows (the SSD tier's rows stay as in the file, and the graph
    regroups the few it is answered with: tiers/experts.py)."""
    tiers = split_placement(layout, placement_dict(placement))
    ssd = SsdStore(layout, tiers[2], reader, n_slots, device=device, memory_kind=slot_memory_kind,
                   alpha=alpha) if tiers[2] else None
    return Stores(DeviceStore(layout, tiers[0], reader, device, planar),
                  HostStore(layout, tiers[1], reader, device, planar), ssd)
