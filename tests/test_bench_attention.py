"""experiments/bench_attention.py on the CPU (its code path only: the kernel runs in Pallas' interpreter on a shrunk
shape): one row for XLA and one for each tile asked, every kernel row within f32 rounding of XLA's output, and a
tile the kernel refuses reported as an error row, not a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_attention_reports_xla_and_each_tile(tmp_path):
    out = tmp_path / "attention.jsonl"
    tiles = "16:32:128:128:4,16:16:32:16:2,16:32:64:48:4"  # the last: blocks of 48 columns do not divide 64
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_attention.py"), "--reps", "1",
                          "--keys", "45", "--tiles", tiles, "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["path"], r["tile"]) for r in rows] == [("xla", None), ("kernel", [16, 32, 128, 128, 4]),
                                                      ("kernel", [16, 16, 32, 16, 2]), ("kernel", [16, 32, 64, 48, 4])]
    assert rows[0]["max_rel_diff_vs_xla"] == 0
    for r in rows[1:3]:
        assert "error" not in r and r["us"] > 0 and r["keys"] == 45
        assert 0 < r["max_rel_diff_vs_xla"] < 1e-5  # reassociated, so not bit-equal, but f32-close
    assert "do not divide" in rows[3]["error"]
