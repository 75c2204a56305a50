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
    tokens: int = 0
    lean_swaps: int = 0

    def record(self, routing: dict) -> None:
        """Count the selections of T tokens (traced routing: experts [T, n_layers, K], swaps [T, n_layers]) by the
        tier that served them, and the router lean's swaps."""
        routing_TLK = np.asarray(routing["experts"])
        self.lean_swaps += int(np.asarray(routing["swaps"]).sum())
        layers = np.arange(routing_TLK.shape[1])[None, :, None]
        tiers = self.tier_LE[layers, routing_TLK]
        sizes = np.broadcast_to(self.expert_bytes[layers], routing_TLK.shape)
        for t in range(3):
            self.lookups[t] += int((tiers == t).sum())
            self.bytes[t] += int(sizes[tiers == t].sum())
        self.tokens += routing_TLK.shape[0]

    def stats(self) -> dict:
        total = max(int(self.lookups.sum()), 1)
        out = {"profile": self.profile.name, "tokens": self.tokens, "router_lean_swaps": self.lean_swaps,
               "placement_experts": dict(zip(TIER_NAMES, map(int, self.placement.tier_experts))),
               "placement_bytes": dict(zip(TIER_NAMES, map(int, self.placement.tier_bytes)))}
        for t, name in enumerate(TIER_NAMES):
            out[name] = {"lookups": int(self.lookups[t]), "share": round(int(self.lookups[t]) / total, 4),
                         "bytes_per_token": round(int(self.bytes[t]) / max(self.tokens, 1))}
        if self.stores.ssd is not None:
            out["ssd"]["slot_cache"] = self.stores.ssd.stats.to_dict()
        return out

    def close(self) -> None:
        self.reader.close()


def open_tiers(gguf, params: dict, profile_name: str, usage_path: str | None = None) -> tuple[dict, TierRuntime]:
    """(params with experts placed by the profile, the runtime that owns the stores)."""
    profile = load_profile(profile_name)
    placement = placement_for_model(gguf, profile, usage_path)
    layout = ExpertLayout.from_model(gguf)
    reader = ExpertReader(layout)
    stores = build_stores(layout, placement, reader, n_slots=max(profile.slot_cache_slots, 1))
    tier_LE, _ = stores.tier_table(layout)
    sizes = np.zeros(tier_LE.shape[0], np.int64)
    for layer in layout.layers:
        sizes[layer] = sum(s.expert_bytes for s in layout.stacks[layer])
    return place_experts(params, stores, layout), TierRuntime(profile, placement, layout, reader, stores,
                                                              tier_LE.astype(np.int64), sizes)
