"""Placement: which tier and slot every routed expert gets, planned from usage and byte budgets. No jax.

`plan(usage, expert_bytes, budgets) -> Placement` is pure and deterministic:
1. rank every (layer, expert) by its selection count, most used first; ties by lower expert id, then lower
   layer, so equal counts (a uniform placement, experts a short corpus never saw) spread round-robin across
   layers instead of leaving whole layers on the SSD;
2. walk the ranking: an expert goes to tier 0 if it fits tier 0's remaining budget, else to tier 1 if it fits
   there, else to tier 2 (SSD). First fit: a colder, smaller expert may still use bytes a hotter, larger one could
   not, which only adds fast-tier hits (experts differ in size only when layers use different quant types);
3. within each (layer, tier) slots are numbered by expert id, so each tier's stack keeps the file's order and is
   loaded with sequential reads.
Hash-layer experts (fixed by tid2eid[token]) are ranked like the others by default: exact prefetch hides their
latency, not their bytes. `hash_weight` scales their counts for callers that measure otherwise; the placement
marks hash layers so the runtime prefetches them from token ids. Shared experts are always resident and never
placed. Expected hit rates (share of selections each tier serves) and expected expert bytes per token per tier
come with the placement: the roofline's inputs (DESIGN.md §8).

`python -m jds41.tiers.placement MODEL.gguf --profile NAME [--usage usage.json] --out placement.json` resolves a
profile's budgets for the model (`model_bytes` reads them from the GGUF tensor directory) and writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jds41.errors import Jds41Error
from jds41.tiers.profiles import Profile, load_profile
from jds41.tiers.usage import ModelIdentity, Usage, UsageError, check_schema, read_json, write_json

SCHEMA = "jds41.placement"
VERSION = 1
N_TIERS = 3
STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """Byte sizes the budgets are resolved against, from the tensor directory."""

    expert_bytes: tuple[int, ...]  # [n_layers] one routed expert: its gate + up + down rows
    n_experts: int
    shared_bytes: int  # every shared expert (always resident)
    engram_bytes: int  # the Engram tables
    dense_bytes: int  # everything else, MTP / draft blocks included

    @property
    def routed_total(self) -> int:
        return sum(self.expert_bytes) * self.n_experts

    @property
    def max_expert_bytes(self) -> int:
        return max(self.expert_bytes, default=0)

    def resident_bytes(self, engram_in_hbm: bool) -> int:
        return self.dense_bytes + self.shared_bytes + (self.engram_bytes if engram_in_hbm else 0)


def model_bytes(model) -> ModelBytes:
    """From an open `GGUFModel`: a stack [E, F, D] / [E, D, F] holds E experts of n_bytes / E each."""
    cfg, tensors = model.config, model.tensors
    per_layer, routed = [], set()
    for layer in range(cfg.n_layers):
        total = 0
        for stack in STACKS:
            t = tensors[f"blk.{layer}.{stack}.weight"]
            if t.n_bytes % cfg.n_experts:
                raise Jds41Error(f"{model.path}: tensor {t.name!r}: {t.n_bytes} bytes do not split into "
                                 f"{cfg.n_experts} experts")
            total += t.n_bytes // cfg.n_experts
            routed.add(t.name)
        per_layer.append(total)
    shared = sum(t.n_bytes for t in tensors.values() if "_shexp." in t.name)
    engram = sum(t.n_bytes for t in tensors.values() if t.name.endswith(".engram_embd.weight"))
    dense = sum(t.n_bytes for t in tensors.values()) - sum(tensors[n].n_bytes for n in routed) - shared - engram
    return ModelBytes(tuple(per_layer), cfg.n_experts, shared, engram, dense)


@dataclasses.dataclass(frozen=True)
class Placement:
    model: ModelIdentity
    source: str  # "usage:PATH" | "uniform" | "file:PATH" | what the caller says
    usage_tokens: int
    expert_bytes: tuple[int, ...]  # [n_layers]
    budgets: tuple[int, int]
    tier: tuple[tuple[int, ...], ...]  # [n_layers][n_experts] 0 HBM, 1 pinned host, 2 SSD
    slot: tuple[tuple[int, ...], ...]  # [n_layers][n_experts] index in that layer's stack of that tier
    hash_layers: tuple[int, ...]
    hit_rates: tuple[float, ...]  # [3] expected share of selections served by each tier
    layer_hit_rates: tuple[tuple[float, ...], ...]  # [n_layers][3]
    bytes_per_token: tuple[float, ...]  # [3] expected routed-expert bytes read from each tier per token
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # profile, resolved sizes (informative)

    @property
    def tier_experts(self) -> tuple[int, ...]:
        return tuple(sum(row.count(t) for row in self.tier) for t in range(N_TIERS))

    @property
    def tier_bytes(self) -> tuple[int, ...]:
        return tuple(sum(row.count(t) * b for row, b in zip(self.tier, self.expert_bytes)) for t in range(N_TIERS))

    def mapping(self) -> dict[tuple[int, int], tuple[int, int]]:
        """{(layer, expert): (tier, slot)}, the form jds41.tiers.stores builds its stacks from."""
        return {(layer, e): (t, self.slot[layer][e]) for layer, row in enumerate(self.tier) for e, t in enumerate(row)}

    def experts(self, layer: int, tier: int) -> tuple[int, ...]:
        """Expert ids of `layer` in `tier`, in slot order."""
        return tuple(e for e, t in enumerate(self.tier[layer]) if t == tier)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA, "version": VERSION, "model": self.model.to_json(), "source": self.source,
            "usage_tokens": self.usage_tokens, "budgets": list(self.budgets), "tier_bytes": list(self.tier_bytes),
            "tier_experts": list(self.tier_experts), "hit_rates": list(self.hit_rates),
            "bytes_per_token": list(self.bytes_per_token),
            "layers": [{"layer": i, "kind": "hash" if i in self.hash_layers else "scored",
                        "expert_bytes": self.expert_bytes[i], "tier": list(self.tier[i]), "slot": list(self.slot[i]),
                        "hit_rates": list(self.layer_hit_rates[i])} for i in range(len(self.tier))],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, d: Any, what: str = "placement") -> Placement:
        check_schema(d, SCHEMA, VERSION, what, "placement")
        try:
            model = ModelIdentity.from_json(d["model"], what)
            layers = d["layers"]
            tier = tuple(tuple(int(x) for x in lay["tier"]) for lay in layers)
            slot = tuple(tuple(int(x) for x in lay["slot"]) for lay in layers)
            p = cls(model, str(d["source"]), int(d["usage_tokens"]), tuple(int(lay["expert_bytes"]) for lay in layers),
                    tuple(int(b) for b in d["budgets"]), tier, slot,
                    tuple(lay["layer"] for lay in layers if lay["kind"] == "hash"),
                    tuple(float(x) for x in d["hit_rates"]),
                    tuple(tuple(float(x) for x in lay["hit_rates"]) for lay in layers),
                    tuple(float(x) for x in d["bytes_per_token"]), dict(d.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"{what}: malformed placement ({type(e).__name__}: {e})") from None
        _check_slots(p, what)
        return p

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Placement:
        return cls.from_json(read_json(path, "placement file"), what=str(path))


def _check_slots(p: Placement, what: str) -> None:
    """Every (layer, tier) stack numbers its experts 0..n-1 exactly once."""
    m = p.model
    if len(p.tier) != m.n_layers or any(len(r) != m.n_experts for r in p.tier + p.slot):
        raise UsageError(f"{what}: tier/slot tables must be {m.n_layers} layers x {m.n_experts} experts")
    for layer in range(m.n_layers):
        if any(t not in range(N_TIERS) for t in p.tier[layer]):
            raise UsageError(f"{what}: layer {layer}: tiers must be 0, 1 or 2")
        for t in range(N_TIERS):
            slots = sorted(s for s, tt in zip(p.slot[layer], p.tier[layer]) if tt == t)
            if slots != list(range(len(slots))):
                raise UsageError(f"{what}: layer {layer} tier {t}: slots {slots} are not 0..{len(slots) - 1}")


def plan(usage: Usage, expert_bytes: int | Sequence[int], budgets: Sequence[int], *, hash_weight: float = 1.0,
         source: str = "usage", meta: Mapping[str, Any] | None = None) -> Placement:
    """Place every routed expert of `usage.model` (see the module docstring). `expert_bytes`: one expert's bytes,
    per layer or one number for all; `budgets`: (tier 0, tier 1) bytes for routed experts."""
    m = usage.model
    L, E = m.n_layers, m.n_experts
    eb = (int(expert_bytes),) * L if np.ndim(expert_bytes) == 0 else tuple(int(b) for b in expert_bytes)
    if len(eb) != L or any(b < 0 for b in eb):
        raise ValueError(f"expert_bytes: need {L} non-negative sizes, got {expert_bytes!r}")
    if len(budgets) != 2 or any(isinstance(b, bool) or int(b) != b or b < 0 for b in budgets):
        raise ValueError(f"budgets: need (tier 0, tier 1) bytes >= 0, got {budgets!r}")
    counts = usage.array().astype(np.float64)
    rank_w = counts.copy()
    for h in usage.hash_layers:
        rank_w[h] *= hash_weight
    layer_ix, expert_ix = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")
    order = np.lexsort((layer_ix.ravel(), expert_ix.ravel(), -rank_w.ravel()))  # last key is the primary one

    tier = np.full((L, E), 2, np.int64)
    left = [int(budgets[0]), int(budgets[1])]
    for flat in order:
        layer, e = divmod(int(flat), E)
        for t in (0, 1):
            if eb[layer] <= left[t]:
                tier[layer, e] = t
                left[t] -= eb[layer]
                break
    slot = np.zeros((L, E), np.int64)
    for t in range(N_TIERS):
        slot = np.where(tier == t, np.cumsum(tier == t, axis=1) - 1, slot)

    # Each layer serves K selections per token, so per-layer shares average with equal weights. A layer without
    # counts (uniform source, no tokens) counts every expert as equally likely.
    basis = np.where(counts.sum(axis=1, keepdims=True) > 0, counts, 1.0)
    share = np.stack([(basis * (tier == t)).sum(axis=1) for t in range(N_TIERS)], axis=1) / basis.sum(axis=1)[:, None]
    hit = share.mean(axis=0) if L else np.zeros(N_TIERS)
    per_token = m.n_experts_used * (np.asarray(eb, np.float64)[:, None] * share).sum(axis=0)
    return Placement(m, source, usage.tokens, eb, (int(budgets[0]), int(budgets[1])),
                     tuple(map(tuple, tier.tolist())), tuple(map(tuple, slot.tolist())), usage.hash_layers,
                     tuple(float(x) for x in hit), tuple(tuple(float(x) for x in r) for r in share),
                     tuple(float(x) for x in per_token), dict(meta or {}))


def placement_for_model(model, profile: Profile, usage_path: str | None = None,
                        host_available: int | None = None) -> Placement:
    """The placement `profile` gives an open `GGUFModel`; `usage_path` overrides the profile's placement source."""
    ident = ModelIdentity.of(model)
    sizes = model_bytes(model)
    source = f"usage:{usage_path}" if usage_path else profile.placement_source
    budgets = profile.budgets(sizes, host_available)
    meta = {"profile": profile.to_json(), "model_bytes": {**dataclasses.asdict(sizes), "routed_total":
                                                          sizes.routed_total}}
    if source.startswith("file:"):
        p = Placement.load(source[5:])
        p.model.check_matches(ident, f"placement file {source[5:]}")
        for t in (0, 1):
            if p.tier_bytes[t] > budgets[t]:
                raise UsageError(f"placement file {source[5:]} puts {p.tier_bytes[t]} bytes in tier {t}, profile "
                                 f"{profile.name!r} allows {budgets[t]} on this machine")
        return dataclasses.replace(p, source=source, meta=meta)
    if source.startswith("usage:"):
        usage = Usage.load(source[6:])
        usage.model.check_matches(ident, f"usage file {source[6:]}")
    else:
        usage = Usage.uniform(ident, [i for i in range(model.config.n_layers) if model.config.is_hash_layer(i)])
    return plan(usage, sizes.expert_bytes, budgets, source=source, meta=meta)


def summary(p: Placement) -> str:
    gib = 1 << 30
    lines = [f"placement of {p.model.file} ({p.model.n_layers} layers x {p.model.n_experts} experts) from {p.source}"]
    for t, name in enumerate(("tier 0 (HBM)", "tier 1 (host)", "tier 2 (SSD)")):
        lines.append(f"  {name:14s} {p.tier_experts[t]:6d} experts {p.tier_bytes[t] / gib:9.3f} GiB  "
                     f"expected hits {100 * p.hit_rates[t]:5.1f}%  {p.bytes_per_token[t] / 2**20:9.2f} MiB/token")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jds41.tiers.placement", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file (any shard of a split file)")
    ap.add_argument("--profile", required=True, help="shipped profile name or a profile JSON path")
    ap.add_argument("--usage", help="usage.json from python -m jds41.tiers.profile (overrides the profile's source)")
    ap.add_argument("--host-available", type=int, help="plan as if the host had this many bytes available")
    ap.add_argument("--out", required=True, help="placement JSON to write")
    args = ap.parse_args(argv)
    from jds41.checkpoints import open_model  # after argument parsing: --help stays instant

    try:
        profile = load_profile(args.profile)
        with open_model(args.model) as model:
            p = placement_for_model(model, profile, args.usage, args.host_available)
        p.save(args.out)
    except (Jds41Error, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
