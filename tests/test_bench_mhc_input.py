"""experiments/bench_mhc_input.py on the CPU (its code path only: the kernels run in Pallas' interpreter on a shrunk
shape): one row for XLA and one for each layout asked, every kernel row within f32 rounding of XLA's output, and a
layout the kernels refuse reported as an error row, not a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_mhc_input_reports_xla_and_each_layout(tmp_path):
    out = tmp_path / "mhc.jsonl"
    layouts = "128:4,32:1,48:4"  # the last: 48 columns are not a power of two
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_mhc_input.py"), "--chain", "1",
                          "--layouts", layouts, "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["path"], r["cols"], r["partial_warps"]) for r in rows] == [("xla", None, None), ("kernels", 128, 4),
                                                                        ("kernels", 32, 1), ("kernels", 48, 4)]
    assert rows[0]["max_rel_diff_vs_xla"] == 0 and rows[0]["us"] > 0
    for r in rows[1:3]:
        assert "error" not in r and r["us"] > 0 and r["dim"] == 256
        assert 0 < r["max_rel_diff_vs_xla"] < 1e-5  # summed in another order, so not bit-equal, but f32-close
    assert "columns a power of two" in rows[3]["error"]
