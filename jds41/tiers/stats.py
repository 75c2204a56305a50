"""Counters of the byte-moving side of the tiers: one plain dataclass per tier and one for the SSD reader pool.

Owners update them under their own locks (reader threads and the step thread both write); readers of the numbers
call `to_dict()` for a snapshot that goes into benchmark JSON lines and /metrics. Nothing here computes policy.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TierStats:
    """Per-tier traffic. `lookups` counts expert keys asked for, `hits` those already resident (tiers 0/1 always
    hit: residency is their definition), `bytes` the bytes brought in to serve misses, `stall_s` the time a step
    waited for them (the number that says whether prefetch works)."""

    tier: int
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    stall_s: float = 0.0
    prefetches: int = 0  # keys whose read a look-ahead started
    prefetch_used: int = 0  # prefetched keys that a later lookup hit before they were evicted
    set_ahead: int = 0  # of the prefetches, those a prefill group's next-layer read-ahead started (SsdStore)
    failures: int = 0  # fills that ended in ExpertReadError
    host_calls: int = 0  # graph-to-host calls answered (SsdStore.fetch): one per layer that streams an expert
    answer_rows: int = 0  # expert rows those answers carried into the graph (padding rows included)
    host_call_s: float = 0.0  # time spent inside those calls, waits for reads included (stall_s is part of it)
    copy_s: float = 0.0  # of host_call_s, the copies of answer rows out of the slots

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


@dataclasses.dataclass
class ReaderStats:
    """The reader pool (experts and the loader). `direct_io` turns False, with the reason, when the file system
    refused O_DIRECT and reads went through the page cache instead (DESIGN.md §6 wants them around it)."""

    requests: int = 0
    chunks: int = 0
    bytes_read: int = 0  # including the alignment padding O_DIRECT forces
    bytes_useful: int = 0  # the bytes callers asked for
    read_s: float = 0.0  # summed over threads: read_s / wall time = achieved parallelism
    errors: int = 0
    direct_io: bool = True
    fallback_reason: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
