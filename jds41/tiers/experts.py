"""Routed experts split across the three owners, as the decode graph sees them.

Each layer's routed experts are one `TieredLayer`: the tier-0 experts as device stacks, the tier-1 experts as
pinned-host stacks, and a map expert -> (tier, local index). Tier-2 experts live on the SSD: their bytes enter the
graph through one host call per layer, made only when a selected expert is on the SSD (`lax.cond`), which returns
the quantized rows of exactly the selected experts (DESIGN.md §4: a host call costs 0.2-0.4 ms on the GPU, so it
must not run on every layer of every step).

Invariance by construction: every tier holds the very bytes of the GGUF stack (regrouped alike in every tier where
the engine uses planar rows: quant/planar.py), the graph picks, per selected expert, the raw rows from the tier that
owns it, and the expert math then runs once on those rows. So any placement gives bit-identical results to the
all-resident model (tests/test_tiers_invariance.py).

The host-read side is a `HostExpertSource` (`fetch(layer, experts, on_ssd) -> (gate, up, down)` rows): the SSD
store (stores.py: O_DIRECT reader pool + slot cache) is one.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jds41.layers.moe import expert_outputs, sum_experts
from jds41.layers.rowwise import island
from jds41.quant import QTensor
from jds41.quant.planar import to_planar

STACKS = ("gate", "up", "down")
# Errors raised by host expert reads inside a step, newest last: `take_failure` hands them to the engine, which
# turns the opaque XLA callback failure back into the read error that caused it.
FAILURES: list[Exception] = []


def take_failure() -> Exception | None:
    """The newest host-read error since the last call (and forget the others), or None."""
    err = FAILURES[-1] if FAILURES else None
    FAILURES.clear()
    return err


class HostExpertSource(Protocol):
    def fetch(self, layer: int, experts: np.ndarray, on_ssd: np.ndarray) -> tuple[np.ndarray, ...]:
        """Raw rows [K, out, row_bytes] of each stack (gate, up, down) for the experts flagged `on_ssd`; other
        entries may hold anything (the graph ignores them)."""


@dataclasses.dataclass(frozen=True)
class TieredLayer:
    """One layer's routed experts across tiers. Leaves: the stacks and the maps; static: layer and row shapes."""

    hbm: dict  # stack name -> QTensor [E0, out, in] on the device (E0 >= 1: an unused dummy when empty)
    host: dict  # stack name -> QTensor [E1, out, in] in pinned host memory (dummy when empty)
    tier_E: jax.Array  # int32 [E]: 0 HBM, 1 host, 2 SSD
    local_E: jax.Array  # int32 [E]: index within its tier's stack (unused for the SSD)
    lean_margin: jax.Array  # f32 scalar: the router lean's margin (a leaf, so the live guard changes it without
    #                         recompiling; read only when the plan compiled the lean in)
    layer: int
    source: HostExpertSource | None = None  # None when nothing of this layer is on the SSD
    has_host: bool = True  # False: no tier-1 expert in this layer, so the graph moves no host rows at all
    host_fetch: str = "selected"  # or "all": K host rows per layer with no branch (Profile.host_fetch)
    n_ssd: int | None = None  # experts of this layer on the SSD (static): no call can flag more; None = unknown
    has_hbm: bool = True  # False: no tier-0 expert in this layer (its HBM stack is a dummy)
    host_whole: bool = False  # a group whose union may need every host expert moves the stack whole
    #                           (whole_host_stack; place_experts decides, for every layer at once)


jax.tree_util.register_dataclass(TieredLayer, data_fields=["hbm", "host", "tier_E", "local_E", "lean_margin"],
                                 meta_fields=["layer", "source", "has_host", "host_fetch", "n_ssd", "has_hbm",
                                              "host_whole"])


def host_rows(q: QTensor, local_N: jax.Array) -> jax.Array:
    """Rows `local_N` of a pinned-host stack, moved to the device.

    Each expert is a dynamic index into the WHOLE host array followed by a device_put: DESIGN.md §7 measured this at
    ~48 GB/s on the GPU box, while gathering with a host-side index vector became slow host compute.
    """
    data = q.data
    # device_put each expert on its own: stacking them first would be an op on host memory, which XLA turns into
    # slow host compute (seen on the H200: 23 GB/s instead of ~48).
    return jnp.stack([jax.device_put(jax.lax.dynamic_index_in_dim(data, local_N[k], 0, keepdims=False),
                                     jax.memory.Space.Device) for k in range(local_N.shape[0])])


def whole_host_stack(q: QTensor) -> jax.Array:
    """The whole pinned-host stack moved to the device as ONE transfer (a layer-major group whose union may need
    every host expert). Unlike `host_rows`' per-expert dynamic slices, which read host memory from a kernel on the
    compute stream, XLA makes a whole-array move an asynchronous copy (copy-start / copy-done) that overlaps compute:
    on the H200 a 2 GiB move hid 97% of itself behind independent matmuls (results/probe_host_copy_h200.jsonl), and
    the all-host V4-Flash 8-layer prefill of 4,096 tokens went from 2.97 s to 2.40 s
    (results/bench_prefill_stack_v4_8L_h200.jsonl). The price: the copies depend on no data, so XLA starts them
    early and holds them; that run's device peak was 19.4 GB above the per-expert moves' (about every layer's
    stack at once). `whole_stack_fits` bounds it. JDS41_WHOLE_STACK=0 keeps the per-expert moves (the A/B)."""
    return jax.device_put(q.data, jax.memory.Space.Device)


WHOLE_STACK = os.environ.get("JDS41_WHOLE_STACK", "1") != "0"
WHOLE_STACK_SHARE = 0.5  # of the device memory still free once the tiers are placed
# JDS41_HOST_STACK_AHEAD=N (default 1; 0 turns it off): layer l's whole-stack move may start only once layer
# l - N has started (`tie_host_stacks`), so about N + 2 layers' stacks are on the device at once instead of every
# layer's, and the memory bound counts that many. Measured on the H200 (all-host V4-Flash 8 layers, 4K prompt,
# results/bench_prefill_ahead_v4_8L_h200.jsonl): N = 1 took 2.21 s at a 21.0 GB device peak, where the moves
# scheduled freely took 2.40 s at 36.9 GB; the barrier keeps each move an asynchronous copy (probe_host_copy's
# `tied` program: copy-start in the HLO, results/probe_host_copy_h200.jsonl).
HOST_STACK_AHEAD = max(int(os.environ.get("JDS41_HOST_STACK_AHEAD", "1")), 0) or None


def whole_stack_fits(host_bytes: int, memory_stats: dict | None) -> bool:
    """Whether `host_bytes` of pinned-host stacks (every layer's, or with HOST_STACK_AHEAD the most that are held
    at once) may sit on the device together, as XLA may schedule the whole-stack moves: within WHOLE_STACK_SHARE
    of the free device memory (`memory_stats` of the device, after placement). A backend that reports no memory
    (CPU: its "host" memory is the device's) fits."""
    if not WHOLE_STACK:
        return False
    if not memory_stats or "bytes_limit" not in memory_stats:
        return True
    free = memory_stats["bytes_limit"] - memory_stats.get("bytes_in_use", 0)
    return host_bytes <= WHOLE_STACK_SHARE * free


def held_host_bytes(stores, layers) -> int:
    """Host stack bytes the whole-stack moves may hold on the device at once: every layer's, or with
    HOST_STACK_AHEAD = N the N + 2 largest layers' (the layer computing, the moves in flight, one spare)."""
    per_layer = sorted((sum(q.nbytes for q in stores.host.stacks[layer].values()) for layer in layers),
                       reverse=True)
    return sum(per_layer if HOST_STACK_AHEAD is None else per_layer[:HOST_STACK_AHEAD + 2])


def tie_host_stacks(tl: TieredLayer, anchor) -> TieredLayer:
    """`tl` with its host stacks' arrays passed through one optimization barrier together with `anchor`: a move
    of them (whole_host_stack) cannot start before `anchor` is computed. Values unchanged."""
    names = list(tl.host)
    data, _ = island(([tl.host[n].data for n in names], anchor))
    return dataclasses.replace(tl, host={n: dataclasses.replace(tl.host[n], data=d) for n, d in zip(names, data)})


def flagged_rows(flag_N: jax.Array, sizes, take, zeros, most: int | None = None) -> tuple[jax.Array, ...]:
    """Arrays [N, ...] holding, at each flagged entry, its rows from `take(positions [S]) -> arrays [S, ...]`
    (other entries: unspecified), through ONE branch of a lax.switch on the flagged count: `zeros()` when none is
    flagged; the smallest S of `sizes` that holds them (the flagged entries go first, in order, and are spread back
    to their places on the device); else take(all N), or take(`most` of them) when no more than `most` entries can
    be flagged. One branch per layer, not one per entry: on the GPU each conditional waits for its predicate on the
    host, and a per-entry cond made the h200 step 3.6 ms slower than all-HBM for 1.2 host experts per token."""
    N = flag_N.shape[0]
    most = N if most is None else max(1, min(most, N))
    count = jnp.sum(flag_N.astype(jnp.int32))

    def compact(S):
        def branch():
            rows_S = take(jnp.argsort(~flag_N, stable=True)[:S])  # flagged entries first, in their order
            rank_N = jnp.clip(jnp.cumsum(flag_N.astype(jnp.int32)) - 1, 0, S - 1)  # flagged entry -> its row
            return tuple(jnp.take(r, rank_N, axis=0) for r in rows_S)
        return branch

    sizes = sorted({S for S in sizes if S < most})
    last = (lambda: tuple(take(jnp.arange(N)))) if most == N else compact(most)
    branches = [zeros] + [compact(S) for S in sizes] + [last]
    # Branch b (1 <= b <= len(sizes)) answers with sizes[b - 1] rows: the number of sizes below `count`, plus one.
    which = jnp.where(count == 0, 0, 1 + sum((count > S).astype(jnp.int32) for S in sizes))
    return jax.lax.switch(which, branches)


def host_selected_rows(tl: TieredLayer, local_N: jax.Array, on_host_N: jax.Array) -> tuple[jax.Array, ...]:
    """Per stack, rows [N, out, in] holding the pinned-host rows of the entries flagged `on_host_N` (others:
    unspecified): only the flagged experts cross PCIe, in moves of 1, 2, 4, ... rows (`flagged_rows`)."""
    N = local_N.shape[0]
    sizes = [1 << i for i in range(max(N - 1, 1).bit_length())]

    def take(pos):
        return tuple(host_rows(tl.host[n], local_N[pos]) for n in STACKS)

    def zeros():
        return tuple(jnp.zeros((N, *tl.host[n].data.shape[1:]), tl.host[n].data.dtype) for n in STACKS)

    return flagged_rows(on_host_N, sizes, take, zeros)


# Row counts of a compact SSD answer, smallest first: a call answers with the first of these that holds its flagged
# experts, else with all N rows. A layer of a decode step rarely streams more than two of its K experts (lucebox on
# the full V4.1 shape: 1.4 per call), and every row of the answer crosses from pageable host memory into the graph:
# answering with all K rows (mostly zeros) moved 57 MB per layer where the streamed experts were 10-20.
SSD_ANSWER_ROWS = (1, 2)


def union_answer_rows(most: int) -> tuple[int, ...]:
    """Compact answer sizes of a union's call (prefill group, layer-major verify) that can flag at most `most`
    entries: SSD_ANSWER_ROWS, a quarter and a half of `most`; its last branch answers with `most` rows. Sized by N,
    a prefill group's call on the full V4.1 shape answered each layer's union of 384 experts with 384 rows (3.8 GB
    of fresh pageable memory, zeroed) for the 80-130 of them the SSD owns; bounded, a 64-token lucebox prompt's
    calls answered 121 rows on average on the H200 (experiments/results/bench_prefill_union_v41_4L_h200.jsonl)."""
    return SSD_ANSWER_ROWS + tuple(S for S in (-(-most // 4), -(-most // 2)) if 2 < S < most)


def in_layer_layout(tl: TieredLayer, rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """SSD answers arrive as the file's rows; where the layer's stores hold planar rows (quant/planar.py), the few
    answered rows are regrouped on the device, so every row a product reads has its stack's one layout."""
    return tuple(to_planar(r, tl.hbm[n].qtype) if tl.hbm[n].layout == "planar" else r for n, r in zip(STACKS, rows))


def stack_shapes(tl: TieredLayer, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of n raw expert rows of each stack (gate, up, down) in the layer's leaf layout."""
    return tuple(jax.ShapeDtypeStruct((n, *tl.hbm[s].data.shape[1:]), tl.hbm[s].data.dtype) for s in STACKS)


def source_fetch(tl: TieredLayer, shapes: tuple, union: bool = False):
    """Host side of a layer's SSD call, answering with arrays of `shapes`: the rows of every flagged entry, read
    through the source in batches no larger than its slot cache (a prefill union may flag more experts than there
    are slots; each batch is copied out while pinned, so its slots are free for the next). One batch, the decode
    case, hands the source's arrays over as they are. A `union` (a group's distinct experts) then tells the source,
    which may start reading the next layer's experts (SsdStore.read_ahead: only for a prefill-sized union)."""
    read_ahead = getattr(tl.source, "read_ahead", None) if union else None

    def fetch(idx_N, mask_N):
        idx, mask = np.asarray(idx_N), np.asarray(mask_N, bool)
        at = np.flatnonzero(mask)
        slots = getattr(getattr(tl.source, "cache", None), "n_slots", None) or max(len(at), 1)
        try:
            if len(at) <= slots:
                rows = tl.source.fetch(tl.layer, idx, mask)
                out = tuple(np.asarray(r, s.dtype).reshape(s.shape) for r, s in zip(rows, shapes))
            else:
                out = tuple(np.zeros(s.shape, s.dtype) for s in shapes)
                for i in range(0, len(at), slots):
                    sub = at[i:i + slots]
                    rows = tl.source.fetch(tl.layer, idx[sub], np.ones(len(sub), bool))
                    for o, r, s in zip(out, rows, shapes):
                        o[sub] = np.asarray(r, s.dtype).reshape((len(sub), *s.shape[1:]))
            if read_ahead is not None:  # after the last batch: every slot of this layer is free to take
                read_ahead(tl.layer, len(at))
            return out
        except Exception as e:
            # XLA reports a failed callback as its own runtime error; keep ours for the engine to re-raise.
            FAILURES.append(e)
            raise

    return fetch


def ssd_rows(tl: TieredLayer, idx_N: jax.Array, on_ssd_N: jax.Array, union: bool = False) -> tuple[jax.Array, ...]:
    """Raw rows [N, out, in] per stack of the entries flagged `on_ssd_N` (others: unspecified), through at most one
    host call (`source_fetch`): none when nothing is flagged, else one answering with the smallest of
    SSD_ANSWER_ROWS rows that holds the flagged entries, or with all N (`flagged_rows`). A `union` (distinct
    experts) cannot flag more entries than the layer has SSD experts: its answers are sized by that bound
    (`union_answer_rows`), not by N."""
    def take(pos):
        shapes = stack_shapes(tl, pos.shape[0])
        return in_layer_layout(tl, io_callback(source_fetch(tl, shapes, union), shapes, idx_N[pos], on_ssd_N[pos]))

    def zeros():
        return tuple(jnp.zeros(s.shape, s.dtype) for s in stack_shapes(tl, idx_N.shape[0]))

    N = idx_N.shape[0]
    if union and tl.n_ssd is not None:
        most = max(1, min(N, tl.n_ssd))
        return flagged_rows(on_ssd_N, union_answer_rows(most), take, zeros, most)
    return flagged_rows(on_ssd_N, SSD_ANSWER_ROWS, take, zeros)


def select_experts(tl: TieredLayer, idx_K: jax.Array) -> dict[str, QTensor]:
    """For the K selected experts, their quantized rows from whichever tier owns each, gathered into stacks
    [K, out, in], with no branch: the form a vmapped step needs (JAX has no IO inside a vmapped cond, and under
    vmap a switch runs every branch), used by the continuously batched step. It calls the host on every step (the
    host answers at once when nothing is flagged) and moves all K host rows. A one-sequence step computes each
    expert where its rows are instead (`tiered_routed_experts`)."""
    tier_K = tl.tier_E[idx_K]
    local_K = jnp.where(tier_K == 2, 0, tl.local_E[idx_K])
    on_ssd = tier_K == 2
    if tl.source is not None:
        shapes = stack_shapes(tl, idx_K.shape[0])
        ssd = in_layer_layout(tl, io_callback(source_fetch(tl, shapes), shapes, idx_K, on_ssd))
    if tl.has_host:  # each moved host row crosses PCIe: skip it where the layer has no tier-1 expert
        host = tuple(host_rows(tl.host[n], jnp.where(tier_K == 1, local_K, 0)) for n in STACKS)
    selected = {}
    for i, n in enumerate(STACKS):
        rows = jnp.take(tl.hbm[n].data, jnp.where(tier_K == 0, local_K, 0), axis=0)
        if tl.has_host:
            rows = jnp.where((tier_K == 1)[:, None, None], host[i], rows)
        if tl.source is not None:
            rows = jnp.where(on_ssd[:, None, None], ssd[i], rows)
        ref = tl.hbm[n]
        selected[n] = ref.with_rows(rows, (idx_K.shape[0], *ref.shape[1:]))
    return selected


def _piece(stacks: dict, rows) -> list[QTensor]:
    """The (gate, up, down) QTensors over rows [S, ...] moved from those stacks (same type and layout)."""
    return [stacks[n].with_rows(r, (r.shape[0], *stacks[n].shape[1:])) for n, r in zip(STACKS, rows)]


def tiered_routed_experts(tl: TieredLayer, x_D: jax.Array, idx_K: jax.Array, weight_K: jax.Array,
                          limit) -> jax.Array:
    """`moe.routed_experts` of a tiered layer, each expert computed where its rows are (the decode step's path).

    `select_experts` assembles the K experts' rows into [K, ...] stacks first: a gather of the HBM rows, and for
    moved host rows a spread and a select, each a device copy of expert bytes (on the H200, all-host V4-Flash
    decode spent 0.45 ms of 17.4 per token in the selects alone). Here the HBM experts are computed straight from
    the tier-0 stack, the host and SSD experts from the rows their branch moved (only those), and only the [K, D]
    outputs are selected. (The moved rows are still stacked: `host_rows`.) Every product uses the tile of the
    layer's K (`tile_k`), and each expert's arithmetic is `moe.expert_outputs` on the same bytes, so a placement
    gives the resident bits (tests/test_tiers_invariance.py)."""
    K = idx_K.shape[0]
    x_D, idx_K, weight_K = island((jnp.asarray(x_D, jnp.float32), jnp.asarray(idx_K, jnp.int32),
                                   jnp.asarray(weight_K, jnp.float32)))
    tier_K = tl.tier_E[idx_K]
    local_K = jnp.where(tier_K == 2, 0, tl.local_E[idx_K])
    D = tl.hbm["down"].shape[-2]
    # A weight that follows W_down (the rounded numerics) multiplies the selected outputs after the branches, as
    # the resident layer multiplies its products' outputs: XLA contracts that multiply and the sum over experts into
    # fused multiply-adds where they share a fusion, so both must meet them in the same ops (MXFP4 experts under
    # the int8 numerics on XLA:CPU showed it: weighted inside the branches, decode logits moved by an ulp)
    after_down = tl.hbm["down"].rounds_activation

    def outputs(stacks, idx, w):
        return expert_outputs(x_D, *stacks, idx, w, limit, tile_k=K, weigh_after_down=not after_down)

    def zeros():
        return (jnp.zeros((K, D), jnp.float32),)

    if tl.has_hbm:
        y_KD = outputs([tl.hbm[n] for n in STACKS], jnp.where(tier_K == 0, local_K, 0), weight_K)
    else:  # the tier-0 stack is a dummy: computing K experts from it would only read it K times
        y_KD = zeros()[0]
    if tl.has_host:
        host_local = jnp.where(tier_K == 1, local_K, 0)

        def host(pos):
            rows = [host_rows(tl.host[n], host_local[pos]) for n in STACKS]
            return (outputs(_piece(tl.host, rows), jnp.arange(pos.shape[0], dtype=jnp.int32), weight_K[pos]),)

        if tl.host_fetch == "selected":  # only the host entries move, in moves of 1, 2, 4 or K rows
            sizes = [1 << i for i in range(max(K - 1, 1).bit_length())]
            y_host = flagged_rows(tier_K == 1, sizes, host, zeros)[0]
        else:  # "all": K rows every step, no branch (Profile.host_fetch)
            y_host = host(jnp.arange(K, dtype=jnp.int32))[0]
        y_KD = jnp.where((tier_K == 1)[:, None], y_host, y_KD)
    if tl.source is not None:
        def ssd(pos):
            shapes = stack_shapes(tl, pos.shape[0])
            rows = in_layer_layout(tl, io_callback(source_fetch(tl, shapes), shapes, idx_K[pos], tier_K[pos] == 2))
            return (outputs(_piece(tl.hbm, rows), jnp.arange(pos.shape[0], dtype=jnp.int32), weight_K[pos]),)

        y_KD = jnp.where((tier_K == 2)[:, None], flagged_rows(tier_K == 2, SSD_ANSWER_ROWS, ssd, zeros)[0], y_KD)
    if after_down:
        y_KD = y_KD * weight_K[:, None]
    return island(sum_experts(y_KD))


def prefetch_experts(tl: TieredLayer, guess_K: jax.Array) -> None:
    """Hand predicted experts of a layer to its SSD source to start reading (a host call with no result: the graph
    does not wait for it). Only layers with SSD experts make the call."""
    if tl.source is None:
        return
    on_ssd = tl.tier_E[guess_K] == 2

    def start(idx, mask):
        tl.source.prefetch([(tl.layer, int(e)) for e, m in zip(np.asarray(idx), np.asarray(mask)) if m])

    io_callback(start, None, guess_K, on_ssd, ordered=False)


def _is_qtensor(v) -> bool:
    return isinstance(v, QTensor)


def place_experts(params: dict, stores, layout, host_fetch: str = "selected", lean_margin: float = 0.0) -> dict:
    """`params` with each placed layer's routed stacks replaced by a `TieredLayer` (key "routed") built from the
    stores of a placement (jds41.tiers.stores.build_stores): tier-0 and tier-1 stacks, the tier table, and the
    SSD store as the host source of layers that have experts on the SSD."""
    tier_LE, local_LE = stores.tier_table(layout)
    device = next(iter(stores.device.sharding.device_set))
    whole = whole_stack_fits(held_host_bytes(stores, layout.layers), device.memory_stats())
    # every QTensor of a loaded model carries the engine's activation numerics; the stores' stacks take it too
    act_round = next((v.act_round for v in jax.tree.leaves(params["blocks"], is_leaf=_is_qtensor) if _is_qtensor(v)),
                     None)
    numerics = lambda stacks: {k: dataclasses.replace(v, act_round=act_round) for k, v in stacks.items()}
    blocks = []
    for layer, block in enumerate(params["blocks"]):
        if layer in layout.layers:
            on_ssd = bool((tier_LE[layer] == 2).any())
            block = {k: v for k, v in block.items() if not k.endswith("_exps")}
            block["routed"] = TieredLayer(
                hbm=numerics(stores.device.stacks[layer]), host=numerics(stores.host.stacks[layer]),
                tier_E=jnp.asarray(tier_LE[layer], jnp.int32), local_E=jnp.asarray(np.maximum(local_LE[layer], 0)),
                lean_margin=jnp.float32(lean_margin),
                layer=layer, source=stores.ssd if on_ssd else None, has_host=bool((tier_LE[layer] == 1).any()),
                host_fetch=host_fetch, n_ssd=int((tier_LE[layer] == 2).sum()),
                has_hbm=bool((tier_LE[layer] == 0).any()), host_whole=whole)
        blocks.append(block)
    return {**params, "blocks": blocks}


def with_tiered_fields(params: dict, **fields) -> dict:
    """`params` with `fields` of every tiered layer (TieredLayer) replaced."""
    blocks = [{**b, "routed": dataclasses.replace(b["routed"], **fields)} if "routed" in b else b
              for b in params["blocks"]]
    return {**params, "blocks": blocks}


def with_lean_margin(params: dict, margin: float) -> dict:
    """`params` with every tiered layer's lean margin set to `margin` (a leaf, same shapes: no recompilation)."""
    return with_tiered_fields(params, lean_margin=jnp.float32(margin))
