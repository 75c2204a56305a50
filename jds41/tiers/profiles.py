"""Named tier profiles (`--profile NAME`): budgets, placement source, slot cache, look-ahead, router lean. No jax.

Owns the frozen `Profile`, `load_profile(name_or_path)` (shipped profiles are `jds41/profiles/NAME.json`, any
other JSON file by path) and the resolution of a profile's budgets to bytes for one model (`Profile.budgets`).

Budget forms (routed experts only: shared experts are always resident and never placed):
- an int: bytes;
- a float in [0, 1]: that fraction of the model's routed expert bytes, so one profile keeps its proportions on
  a tiny test model and on the full checkpoint (1 means one byte, 1.0 means everything);
- "all": every routed expert;
- tier 0 only, {"hbm": BYTES, "reserve": BYTES}: the device's memory minus what is resident anyway (dense weights,
  shared experts, Engram tables when `engram_tables` is "hbm", the slot cache) minus a reserve for KV and
  workspace, computed from the model's tensor directory at plan time;
- tier 1 only, {"host_free_minus": BYTES}: the host's available memory at plan time (psutil, else
  /proc/meminfo MemAvailable) minus a reserve, minus the Engram tables when `engram_tables` is "host".
Unknown fields, wrong types and out-of-range values are errors that name the file and the field. A "comment"
field (string or list of strings) is allowed anywhere a profile documents its numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from jds41.errors import Jds41Error

if TYPE_CHECKING:
    from jds41.tiers.placement import ModelBytes

ENGRAM_PLACES = ("hbm", "host", "ssd")


class ProfileError(Jds41Error, ValueError):
    """A profile that cannot be found, parsed or validated (names the profile and the field)."""


@dataclasses.dataclass(frozen=True)
class RouterLean:
    """Cache-aware routing (DESIGN.md §3): prefer a faster-tier expert within `margin` of the k-th score; stop
    leaning when agreement with the unbiased top-k, checked every `check_every` steps, drops below the floor."""

    enabled: bool = False
    margin: float = 0.0
    agreement_floor: float = 0.99
    check_every: int = 64
    comment: str = ""


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    tier0_bytes: int | float | str | Mapping[str, int]
    tier1_bytes: int | float | str | Mapping[str, int]
    placement_source: str = "uniform"  # "usage:PATH" | "uniform" | "file:PATH"
    slot_cache_slots: int = 0
    lookahead: bool | int = False  # False / True (= 1): layer l guesses layer l+1's experts (deeper is not built)
    router_lean: RouterLean = RouterLean()
    engram_tables: str = "ssd"
    comment: str = ""
    # How tier-1 rows reach the device: "selected" (the default) moves only the selected host experts, in one
    # branch per layer that moves 1, 2, 4 or K rows (tiers/experts.flagged_rows); "all" moves K rows per layer
    # whenever the layer has any host expert, with no branch. H200, full V4.1 shape (results/
    # bench_decode_compact_v41_4L_h200.jsonl): h200 150.9 tok/s selected against 99.2 all; lucebox 22.5 against 21.1.
    host_fetch: str = "selected"

    @property
    def lookahead_depth(self) -> int:
        return int(self.lookahead)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["tier0_bytes"], d["tier1_bytes"] = _jsonable(self.tier0_bytes), _jsonable(self.tier1_bytes)
        return d

    def budgets(self, sizes: ModelBytes, host_available: int | None = None) -> tuple[int, int]:
        """(tier 0, tier 1) routed-expert byte budgets for this model; `host_available` overrides the reading
        of the host's free memory (tests, planning for another box)."""
        b0 = self._bytes("tier0_bytes", self.tier0_bytes, sizes, host_available)
        b1 = self._bytes("tier1_bytes", self.tier1_bytes, sizes, host_available)
        return b0, b1

    def _bytes(self, field: str, v: Any, sizes: ModelBytes, host_available: int | None) -> int:
        total = sizes.routed_total
        if v == "all":
            return total
        if isinstance(v, float):
            return int(v * total)
        if isinstance(v, int):
            return v
        if "hbm" in v:
            resident = sizes.resident_bytes(engram_in_hbm=self.engram_tables == "hbm")
            slots = self.slot_cache_slots * sizes.max_expert_bytes  # the slot cache lives in HBM (tier 0)
            return max(0, v["hbm"] - resident - slots - v["reserve"])
        free = host_available_bytes() if host_available is None else host_available
        engram = sizes.engram_bytes if self.engram_tables == "host" else 0
        return max(0, free - v["host_free_minus"] - engram)


def host_available_bytes() -> int:
    """Memory the host can hand out now (MemAvailable: free plus reclaimable page cache)."""
    try:
        import psutil  # a dev extra, not a core dependency: fall back to /proc/meminfo
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ProfileError("cannot read the host's available memory (no psutil, no /proc/meminfo MemAvailable): give "
                       "tier1_bytes in bytes or as a fraction instead of host_free_minus")


def _jsonable(v: Any) -> Any:
    return dict(v) if isinstance(v, Mapping) else v


# ---- loading ------------------------------------------------------------------------------------------------


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in jds41/profiles/."""
    root = resources.files("jds41") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | os.PathLike) -> Profile:
    """A shipped profile by name (`lucebox`) or any profile JSON file by path."""
    s = str(name_or_path)
    if s.endswith(".json") or os.sep in s or os.path.isfile(s):
        try:
            with open(s) as fh:
                text = fh.read()
        except OSError as e:
            raise ProfileError(f"cannot read profile {s}: {e.strerror or e}") from None
        base = os.path.dirname(os.path.abspath(s))
    else:
        res = resources.files("jds41") / "profiles" / f"{s}.json"
        if not res.is_file():
            raise ProfileError(f"unknown profile {s!r}; shipped profiles: {', '.join(shipped_profiles())} (or give "
                               "the path of a profile JSON file)")
        text, base = res.read_text(), None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {s} is not valid JSON: {e}") from None
    return profile_from_json(data, s, base)


_TOP = {"name", "tier0_bytes", "tier1_bytes", "placement_source", "slot_cache_slots", "lookahead", "router_lean",
        "engram_tables", "comment", "host_fetch"}
HOST_FETCH = ("all", "selected")
_LEAN = {"enabled", "margin", "agreement_floor", "check_every", "comment"}


def profile_from_json(d: Any, where: str, base_dir: str | None = None) -> Profile:
    """Validate a parsed profile; relative `usage:`/`file:` paths resolve against `base_dir` (the file's folder)."""
    def fail(field: str, msg: str):
        raise ProfileError(f"profile {where}: field {field!r}: {msg}")

    if not isinstance(d, dict):
        raise ProfileError(f"profile {where}: expected a JSON object")
    unknown = sorted(set(d) - _TOP)
    if unknown:
        raise ProfileError(f"profile {where}: unknown field(s) {unknown}; known: {sorted(_TOP)}")
    for req in ("tier0_bytes", "tier1_bytes"):
        if req not in d:
            raise ProfileError(f"profile {where}: missing required field {req!r}")
    name = d.get("name", os.path.splitext(os.path.basename(where))[0])
    if not isinstance(name, str) or not name:
        fail("name", "must be a non-empty string")
    b0 = _budget(d["tier0_bytes"], "tier0_bytes", {"hbm", "reserve"}, fail)
    b1 = _budget(d["tier1_bytes"], "tier1_bytes", {"host_free_minus"}, fail)
    source = d.get("placement_source", "uniform")
    if not isinstance(source, str) or not (source == "uniform" or source.startswith(("usage:", "file:"))):
        fail("placement_source", f"expected 'uniform', 'usage:PATH' or 'file:PATH', got {source!r}")
    if source != "uniform":
        kind, path = source.split(":", 1)
        if not path:
            fail("placement_source", "the path is empty")
        if base_dir is not None and not os.path.isabs(path):
            source = f"{kind}:{os.path.join(base_dir, path)}"
    slots = d.get("slot_cache_slots", 0)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        fail("slot_cache_slots", f"must be an integer >= 0, got {slots!r}")
    look = d.get("lookahead", False)
    if not isinstance(look, (bool, int)) or look not in (0, 1):
        fail("lookahead", f"must be true/false (or 1/0: one layer ahead, the only depth built), got {look!r}")
    engram = d.get("engram_tables", "ssd")
    if engram not in ENGRAM_PLACES:
        fail("engram_tables", f"must be one of {list(ENGRAM_PLACES)}, got {engram!r}")
    host_fetch = d.get("host_fetch", "selected")
    if host_fetch not in HOST_FETCH:
        fail("host_fetch", f"must be one of {list(HOST_FETCH)}, got {host_fetch!r}")
    return Profile(name, b0, b1, source, slots, look, _lean(d.get("router_lean", {}), fail), engram,
                   _comment(d.get("comment", ""), "comment", fail), host_fetch)


def _budget(v: Any, field: str, dict_keys: set[str], fail) -> Any:
    if v == "all":
        return v
    if isinstance(v, bool):
        fail(field, "must be bytes (int), a fraction (float in [0, 1]), 'all' or an object")
    if isinstance(v, int):
        if v < 0:
            fail(field, f"bytes must be >= 0, got {v}")
        return v
    if isinstance(v, float):
        if not 0.0 <= v <= 1.0:
            fail(field, f"a float is a fraction of routed expert bytes in [0, 1], got {v} (give bytes as an int)")
        return v
    if isinstance(v, dict):
        if set(v) != dict_keys:
            fail(field, f"the object form takes exactly the keys {sorted(dict_keys)}, got {sorted(v)}")
        for k, x in v.items():
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                fail(f"{field}.{k}", f"must be bytes (an integer >= 0), got {x!r}")
        return dict(v)
    fail(field, f"must be bytes (int), a fraction (float in [0, 1]), 'all' or an object, got {v!r}")


def _lean(v: Any, fail) -> RouterLean:
    if not isinstance(v, dict):
        fail("router_lean", "must be an object")
    unknown = sorted(set(v) - _LEAN)
    if unknown:
        fail("router_lean", f"unknown field(s) {unknown}; known: {sorted(_LEAN)}")
    lean = RouterLean(**{k: v[k] for k in v if k != "comment"},
                      comment=_comment(v.get("comment", ""), "router_lean.comment", fail))
    if not isinstance(lean.enabled, bool):
        fail("router_lean.enabled", "must be true or false")
    for k in ("margin", "agreement_floor"):
        x = getattr(lean, k)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
            fail(f"router_lean.{k}", f"must be a number >= 0, got {x!r}")
    if lean.agreement_floor > 1:
        fail("router_lean.agreement_floor", f"is a share of agreeing selections in [0, 1], got {lean.agreement_floor}")
    if isinstance(lean.check_every, bool) or not isinstance(lean.check_every, int) or lean.check_every < 1:
        fail("router_lean.check_every", f"must be an integer >= 1, got {lean.check_every!r}")
    return dataclasses.replace(lean, margin=float(lean.margin), agreement_floor=float(lean.agreement_floor))


def _comment(v: Any, field: str, fail) -> str:
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return "\n".join(v)
    if not isinstance(v, str):
        fail(field, "must be a string or a list of strings")
    return v
