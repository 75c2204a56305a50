"""The SSD host call of a layer (tiers/experts.ssd_rows): at most one call, and as few rows in its answer as the
flagged experts need (none, 1, 2, or all of them; a prefill union no more than the layer's SSD experts), with every
flagged entry getting its own expert's rows back in its own place; the same for the pinned-host tier's compact
moves (host_selected_rows); and the decode path (tiered_routed_experts), which computes each expert where its rows
are and makes the same one compact call. The sources here are fakes whose rows encode the expert id (or hold a known
stack), so the expected rows are known without the code under test; the real SSD store is covered by
tests/test_tiers_invariance.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from jds41.quant import QTensor
from jds41.tiers.experts import STACKS, TieredLayer, host_selected_rows, select_experts, ssd_rows

E, OUT, IN = 8, 3, 4
F32 = GGMLQuantizationType.F32


def _expert_rows(e: int, stack: int) -> np.ndarray:
    return np.full((OUT, IN), 100 * stack + e + 1, np.float32)


class FakeSource:
    def __init__(self):
        self.calls: list[int] = []  # rows asked for, per call

    def fetch(self, layer, experts, on_ssd):
        self.calls.append(len(experts))
        return tuple(np.stack([_expert_rows(int(e), i) if m else np.zeros((OUT, IN), np.float32)
                               for e, m in zip(experts, on_ssd)]) for i in range(len(STACKS)))


def _layer(tier_E: np.ndarray, source, n_ssd: int | None = None) -> TieredLayer:
    hbm_ids = np.flatnonzero(tier_E == 0)
    local = np.zeros(len(tier_E), np.int32)
    local[hbm_ids] = np.arange(len(hbm_ids))
    hbm = {n: QTensor(jnp.asarray(np.stack([_expert_rows(int(e), i) for e in hbm_ids] or [np.zeros((OUT, IN))])
                                  .astype(np.float32)), F32, (max(len(hbm_ids), 1), OUT, IN))
           for i, n in enumerate(STACKS)}
    dummy = {n: QTensor(jnp.zeros((1, OUT, IN), jnp.float32), F32, (1, OUT, IN)) for n in STACKS}
    return TieredLayer(hbm=hbm, host=dummy, tier_E=jnp.asarray(tier_E, jnp.int32), local_E=jnp.asarray(local),
                       lean_margin=jnp.float32(0), layer=0, source=source, has_host=False,
                       n_ssd=n_ssd)


@pytest.mark.parametrize("flags", [[0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0],
                                   [0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1]])
def test_one_call_with_only_the_rows_the_flagged_experts_need(flags):
    src = FakeSource()
    tl = _layer(np.full(E, 2), src)
    idx = np.array([5, 3, 7, 0, 2, 6], np.int32)
    on = np.array(flags, bool)
    rows = jax.jit(lambda i, m: ssd_rows(tl, i, m))(jnp.asarray(idx), jnp.asarray(on))
    n = int(on.sum())
    want_calls = {0: [], 1: [1], 2: [2]}.get(n, [len(idx)])  # the compact sizes are (1, 2)
    assert src.calls == want_calls
    for s, r in enumerate(rows):
        r = np.asarray(r)
        assert r.shape == (len(idx), OUT, IN)
        for k in np.flatnonzero(on):
            np.testing.assert_array_equal(r[k], _expert_rows(int(idx[k]), s), err_msg=f"stack {s}, entry {k}")


@pytest.mark.parametrize("n_flagged", [0, 1, 2, 3, 5, 6, 9, 10, 12])
def test_a_union_is_answered_with_no_more_rows_than_the_layer_has_ssd_experts(n_flagged):
    """A prefill union of 24 distinct experts in a layer of 40 with 12 on the SSD: the answer never has more than
    12 rows (the union's 24 entries were all answered before), in steps of 1, 2, 3 (a quarter), 6 (a half) or 12,
    and every flagged entry gets its own expert's rows."""
    n_experts, n_ssd = 40, 12
    tier = np.zeros(n_experts, np.int32)
    ssd_ids = np.arange(1, 2 * n_ssd, 2)  # odd experts below 24 are on the SSD
    tier[ssd_ids] = 2
    src = FakeSource()
    tl = _layer(tier, src, n_ssd=n_ssd)
    rng = np.random.default_rng(n_flagged)
    union = np.sort(np.concatenate([rng.choice(ssd_ids, n_flagged, replace=False),
                                    rng.choice(np.flatnonzero(tier == 0), 24 - n_flagged, replace=False)]))
    on = tier[union] == 2
    rows = jax.jit(lambda i, m: ssd_rows(tl, i, m, union=True))(jnp.asarray(union, jnp.int32), jnp.asarray(on))
    want = [] if n_flagged == 0 else [next(S for S in (1, 2, 3, 6, 12) if S >= n_flagged)]
    assert src.calls == want
    for s, r in enumerate(rows):
        assert np.asarray(r).shape == (24, OUT, IN)
        for k in np.flatnonzero(on):
            np.testing.assert_array_equal(np.asarray(r)[k], _expert_rows(int(union[k]), s), err_msg=f"{s}, {k}")


def _stacks(rng, n: int, F: int = 8, D: int = 16) -> dict[str, np.ndarray]:
    return {"gate": rng.standard_normal((n, F, D)).astype(np.float32),
            "up": rng.standard_normal((n, F, D)).astype(np.float32),
            "down": rng.standard_normal((n, D, F)).astype(np.float32)}


class StackSource:
    """A fake SSD source answering with the real rows of a stack (and counting the rows of each call)."""

    def __init__(self, stacks):
        self.stacks, self.calls = stacks, []

    def fetch(self, layer, experts, on_ssd):
        self.calls.append(len(experts))
        return tuple(np.where(on_ssd[:, None, None], self.stacks[n][experts], 0) for n in STACKS)


@pytest.mark.parametrize("host_fetch", ["selected", "all"])
def test_a_tiered_layer_computes_each_expert_where_it_is_and_gives_the_resident_bits(host_fetch):
    """Experts 0-3 in HBM, 4-7 in pinned host memory (local order reversed), 8-11 on the SSD. The decode path
    computes HBM experts from the tier-0 stack, host experts from the rows it moves, SSD experts from one compact
    answer, and selects the [K, D] outputs: the same bits as `routed_experts` over the whole resident stack."""
    from jds41.layers.moe import routed_experts
    from jds41.tiers.experts import tiered_routed_experts

    rng = np.random.default_rng(7)
    n = 12
    full = _stacks(rng, n)
    tier = np.repeat([0, 1, 2], 4)
    local = np.array([0, 1, 2, 3, 3, 2, 1, 0, 0, 0, 0, 0], np.int32)

    def q(a):
        return QTensor(jnp.asarray(a), F32, a.shape)

    src = StackSource(full)
    host = {k: q(v[4:8][::-1].copy()) for k, v in full.items()}  # host row r holds expert 7 - r
    tl = TieredLayer(hbm={k: q(v[:4]) for k, v in full.items()}, host=host,
                     tier_E=jnp.asarray(tier, jnp.int32), local_E=jnp.asarray(local), lean_margin=jnp.float32(0),
                     layer=0, source=src, has_host=True, host_fetch=host_fetch, n_ssd=4)
    x = jnp.asarray(rng.standard_normal(16), jnp.float32)
    for idx in ([9, 1, 5, 0, 11, 6], [0, 1, 2, 3, 4, 5], [10, 8, 2, 9, 4, 1]):
        w = jnp.asarray(rng.random(6), jnp.float32)
        want = jax.jit(lambda i, w: routed_experts(x, q(full["gate"]), q(full["up"]), q(full["down"]), i, w, 0.0))(
            jnp.asarray(idx, jnp.int32), w)
        before = len(src.calls)
        got = jax.jit(lambda i, w: tiered_routed_experts(tl, x, i, w, 0.0))(jnp.asarray(idx, jnp.int32), w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(idx))
        n_ssd = int((tier[idx] == 2).sum())
        assert src.calls[before:] == ([] if n_ssd == 0 else [{1: 1, 2: 2}.get(n_ssd, 6)]), (idx, src.calls)


@pytest.mark.parametrize("n_host", [0, 1, 2, 3, 5, 6])
def test_host_tier_moves_give_each_flagged_entry_its_expert(n_host):
    """Host-only layer (every expert in the pinned-host stack, whose rows encode the expert id): whatever the number
    of host entries among the K = 6, each gets its own expert's rows, in the gathered form (select_experts, alone
    and vmapped) and in the compact moves of 1, 2, 4 or all 6 rows of the union form (host_selected_rows)."""
    host_ids = np.arange(E)[::-1]  # host row r holds expert E - 1 - r: local index != expert id
    local = np.empty(E, np.int32)
    local[host_ids] = np.arange(E)
    host = {n: QTensor(jnp.asarray(np.stack([_expert_rows(int(e), i) for e in host_ids])), F32, (E, OUT, IN))
            for i, n in enumerate(STACKS)}
    tier = np.zeros(E, np.int32)
    idx = np.array([5, 3, 7, 0, 2, 6], np.int32)
    tier[idx[:n_host]] = 1
    tl = _layer(tier, None)
    tl = dataclasses.replace(tl, host=host, local_E=jnp.asarray(np.where(tier == 1, local, np.asarray(tl.local_E))),
                             has_host=True, host_fetch="selected")
    sel = jax.jit(lambda i: select_experts(tl, i))(jnp.asarray(idx))
    # Vmapped (the batched serving step: no branch, all K host rows moved), the same rows.
    both = jax.jit(jax.vmap(lambda i: select_experts(tl, i)))(jnp.asarray(np.stack([idx, idx])))
    on_host = jnp.asarray(tier[idx] == 1)
    moved = jax.jit(lambda loc, f: host_selected_rows(tl, loc, f))(jnp.asarray(local[idx]), on_host)
    for s, n in enumerate(STACKS):
        for k, e in enumerate(idx):
            np.testing.assert_array_equal(np.asarray(sel[n].data)[k], _expert_rows(int(e), s), err_msg=f"{n}, {k}")
            np.testing.assert_array_equal(np.asarray(both[n].data)[1, k], _expert_rows(int(e), s), err_msg=f"{n} {k}")
            if tier[e] == 1:
                np.testing.assert_array_equal(np.asarray(moved[s])[k], _expert_rows(int(e), s), err_msg=f"{n} {k}")
