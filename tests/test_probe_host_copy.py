"""experiments/probe_host_copy.py on the CPU (its code path only: the CPU's "pinned host" is ordinary memory, so
its timings say nothing): the moved bytes check out and every program, `tied` included, ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # every probe program compiled (~60 s on 2 cores)
def test_probe_runs_every_program_and_moves_the_right_bytes(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    from probe_host_copy import main

    row = main(["--gib", "0.004", "--reps", "1", "--matmuls", "2", "--out", str(tmp_path / "probe.jsonl")])
    assert row["moved_ok"] is True
    assert "tied_error" not in row and row["tied_s"] > 0
    assert row["both_s"] > 0 and row["move_s"] > 0 and row["matmuls"] == 2
    assert (tmp_path / "probe.jsonl").read_text().count("\n") == 1
