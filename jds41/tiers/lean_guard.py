"""The router lean's live quality guard (DESIGN.md §3, issue #11 item 3): keep measuring how often the leaned top-k
agrees with the unbiased one, and back the margin off when agreement falls below the profile's floor.

Measuring costs nothing extra: the lean selects from the plain top-k plus the near-ties (layers/router.py), so
every step already knows how many kept experts lie outside the unbiased top-k (`swaps`, traced per layer). The
guard therefore sees every step, and decides every `check_every` steps: agreement over those steps below
`agreement_floor` multiplies the margin by `backoff` (a margin under `off_below` becomes 0, the exact unbiased
routing). It never raises the margin again by itself: a back-off is a measured quality problem on this traffic,
and the profile's margin comes back only with a new engine (or an explicit `reset`).

The margin is a traced leaf of every tiered layer (`TieredLayer.lean_margin`), so a back-off swaps an array in the
parameter pytree and never recompiles the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class LeanGuard:
    margin: float  # current margin (the profile's at start)
    agreement_floor: float
    check_every: int  # steps per decision
    selections_per_step: int  # K x score-routed layers: what one step's swaps are out of
    backoff: float = 0.5
    off_below: float = 1e-4
    initial_margin: float = dataclasses.field(init=False)
    backoffs: int = 0
    steps: int = 0
    swaps: int = 0
    last_agreement: float | None = None  # agreement over the last decided window
    _window_steps: int = 0
    _window_swaps: int = 0

    def __post_init__(self):
        if self.check_every < 1 or self.selections_per_step < 1:
            raise ValueError("check_every and selections_per_step must be >= 1")
        if not 0 < self.backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {self.backoff}")
        self.initial_margin = self.margin

    def observe(self, swaps_per_step) -> bool:
        """Swaps of consecutive steps ([T] or [T, layers]); True when the margin changed."""
        per_step = np.asarray(swaps_per_step, np.int64).reshape(len(swaps_per_step), -1).sum(axis=1)
        changed = False
        for s in per_step:
            self.steps += 1
            self.swaps += int(s)
            self._window_steps += 1
            self._window_swaps += int(s)
            if self._window_steps == self.check_every:
                changed |= self._decide()
        return changed

    def _decide(self) -> bool:
        agreement = 1.0 - self._window_swaps / (self._window_steps * self.selections_per_step)
        self.last_agreement = agreement
        self._window_steps = self._window_swaps = 0
        if agreement >= self.agreement_floor or self.margin == 0.0:
            return False
        self.margin *= self.backoff
        if self.margin < self.off_below:
            self.margin = 0.0
        self.backoffs += 1
        return True

    def reset(self) -> None:
        """Back to the profile's margin (an operator's decision, e.g. after the traffic changed)."""
        self.margin = self.initial_margin
        self._window_steps = self._window_swaps = 0

    def stats(self) -> dict:
        total = self.steps * self.selections_per_step
        return {"margin": self.margin, "initial_margin": self.initial_margin, "backoffs": self.backoffs,
                "steps": self.steps, "agreement_floor": self.agreement_floor,
                "topk_agreement": round(1 - self.swaps / total, 6) if total else None,
                "last_window_agreement": None if self.last_agreement is None else round(self.last_agreement, 6)}
