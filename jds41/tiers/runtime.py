"""A model's routed experts placed by a profile, for the engine: placement -> stores -> tiered parameters, plus
the per-tier statistics the CLIs and the server report.

`open_tiers(gguf, params, profile)` plans the placement (tiers/placement.py), reads tiers 0 and 1 into their stores
and opens the SSD tier (tiers/stores.py, O_DIRECT reader pool and slot cache), and swaps each layer's routed
stacks for its `TieredLayer` (tiers/experts.py). `record(routing)` counts, from the expert ids every step already
computes, how many selections each tier served: the hit rates and bytes per token of DESIGN.md §8.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jds41.tiers.experts import place_experts
from jds41.tiers.lean_guard import LeanGuard
from jds41.tiers.placement import Placement, placement_for_model
from jds41.tiers.profiles import Profile, load_profile
from jds41.tiers.ssd import ExpertReader
from jds41.tiers.stores import ExpertLayout, Stores, build_stores

TIER_NAMES = ("hbm", "host", "ssd")


@dataclasses.dataclass
class TierRuntime:
    profile: Profile
    placement: Placement
    layout: ExpertLayout
    reader: ExpertReader
    stores: Stores
    tier_LE: np.ndarray  # int8 [L, E]
    expert_bytes: np.ndarray  # [L] bytes of one expert (gate + up + down)
    lookups: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3, np.int64))
    bytes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3, np.int64))
    hash_tables: dict = dataclasses.field(default_factory=dict)  # hash layer -> tid2eid [V, K] (numpy)
    routing_k: int = 0  # experts per token per layer
    n_scored_layers: int = 0  # layers routed by score (the lean never touches hash layers)
    tokens: int = 0
    lean_swaps: int = 0
    predictions: int = 0  # look-ahead: experts predicted for the next layer
    predictions_correct: int = 0  # ... that the next layer did select
    guard: LeanGuard | None = None  # the router lean's live quality guard (None: lean off)

    def record(self, routing: dict) -> None:
        """Count the selections of T tokens (traced routing: experts [T, n_layers, K], swaps [T, n_layers]) by the
        tier that served them, and the router lean's swaps."""
        routing_TLK = np.asarray(routing["experts"])
        swaps = np.asarray(routing["swaps"])
        self.lean_swaps += int(swaps.sum())
        if self.guard is not None:
            self.guard.observe(swaps[:, [i for i in range(swaps.shape[1]) if i not in self.hash_tables]])
        guess = np.asarray(routing["predicted_next"])[:, :-1]  # layer l's guess for layer l+1
        made = guess[..., 0] >= 0
        if made.any():
            actual = routing_TLK[:, 1:]
            hits = (guess[..., :, None] == actual[..., None, :]).any(-1).sum(-1)
            self.predictions += int(made.sum() * guess.shape[-1])
            self.predictions_correct += int(hits[made].sum())
        layers = np.arange(routing_TLK.shape[1])[None, :, None]
        tiers = self.tier_LE[layers, routing_TLK]
        sizes = np.broadcast_to(self.expert_bytes[layers], routing_TLK.shape)
        for t in range(3):
            self.lookups[t] += int((tiers == t).sum())
            self.bytes[t] += int(sizes[tiers == t].sum())
        self.tokens += routing_TLK.shape[0]

    def prefetch_tokens(self, tokens) -> None:
        """Exact prefetch: hash-layer experts depend on token ids alone, so their SSD reads start before the step."""
        if self.stores.ssd is None:
            return
        keys = [(layer, int(e)) for layer, table in self.hash_tables.items() for t in tokens for e in table[int(t)]]
        self.stores.ssd.prefetch(keys)

    def expect_union_passes(self, n: int) -> None:
        """A feed about to run `n` union passes (SsdStore.expect_passes); nothing without an SSD tier."""
        if self.stores.ssd is not None:
            self.stores.ssd.expect_passes(n)

    def stats(self) -> dict:
        total = max(int(self.lookups.sum()), 1)
        scored = self.tokens * self.routing_k * self.n_scored_layers  # selections the lean could have changed
        out = {"profile": self.profile.name, "tokens": self.tokens, "router_lean_swaps": self.lean_swaps,
               "router_lean_topk_agreement": round(1 - self.lean_swaps / scored, 6) if scored else None,
               "lookahead": {"predictions": self.predictions, "correct": self.predictions_correct,
                             "accuracy": round(self.predictions_correct / max(self.predictions, 1), 4)},
               "router_lean": self.guard.stats() if self.guard is not None else None,
               "placement_experts": dict(zip(TIER_NAMES, map(int, self.placement.tier_experts))),
               "placement_bytes": dict(zip(TIER_NAMES, map(int, self.placement.tier_bytes)))}
        for t, name in enumerate(TIER_NAMES):
            out[name] = {"lookups": int(self.lookups[t]), "share": round(int(self.lookups[t]) / total, 4),
                         "bytes_per_token": round(int(self.bytes[t]) / max(self.tokens, 1))}
        if self.stores.ssd is not None:
            out["ssd"]["slot_cache"] = self.stores.ssd.stats.to_dict()
        return out

    def close(self) -> None:
        if self.stores.ssd is not None:
            self.stores.ssd.close()
        self.reader.close()


def open_tiers(gguf, params: dict, profile_name: str, usage_path: str | None = None,
               planar: bool = False) -> tuple[dict, TierRuntime]:
    """(params with experts placed by the profile, the runtime that owns the stores). `params` need not hold the
    routed stacks: the stores read the placed experts themselves. `planar`: the stores hold PLANAR_TYPES stacks in
    planar rows (the engine's resident weights are planar: quant/planar.py)."""
    profile = load_profile(profile_name)
    placement = placement_for_model(gguf, profile, usage_path)
    layout = ExpertLayout.from_model(gguf)
    reader = ExpertReader(layout)
    stores = build_stores(layout, placement, reader, n_slots=max(profile.slot_cache_slots, 1), planar=planar)
    tier_LE, _ = stores.tier_table(layout)
    sizes = np.zeros(tier_LE.shape[0], np.int64)
    for layer in layout.layers:
        sizes[layer] = sum(s.expert_bytes for s in layout.stacks[layer])
    cfg = gguf.config
    hash_tables = {i: np.asarray(gguf.typed(f"blk.{i}.ffn_gate_tid2eid.weight")).reshape(cfg.vocab_size, -1)
                   for i in range(cfg.n_layers) if cfg.is_hash_layer(i)}
    runtime = TierRuntime(profile, placement, layout, reader, stores, tier_LE.astype(np.int64), sizes,
                          hash_tables=hash_tables, routing_k=cfg.n_experts_used,
                          n_scored_layers=cfg.n_layers - len(hash_tables))
    lean = profile.router_lean
    if lean.enabled:
        runtime.guard = LeanGuard(lean.margin, lean.agreement_floor, lean.check_every,
                                  cfg.n_experts_used * runtime.n_scored_layers)
    return place_experts(params, stores, layout, profile.host_fetch, lean.margin if lean.enabled else 0.0), runtime
