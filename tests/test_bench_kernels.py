"""experiments/bench_kernels.py on the CPU (its code path only: the kernel runs in Pallas' interpreter on shrunk
shapes): one row per shape, path and row layout (planar only for the formats that have it), every kernel row
within f32 rounding of the XLA spelling over GGML rows, XLA over planar rows equal to it; the two-bit formats' int8
kernel within its activation rounding of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_kernels_reports_both_paths_for_every_shape(tmp_path):
    out = tmp_path / "kernels.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--reps", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_kernels import SHAPES

    from jds41.quant.planar import PLANAR_TYPES
    from jds41.quant.triton_int8 import supported as int8_supported
    from jds41.quant.triton_matvec import supported

    want = []
    for name, qt, *_ in SHAPES:
        want += [(name, qt.name, "xla", lay) for lay in ("ggml", "planar") if lay == "ggml" or qt in PLANAR_TYPES]
        want += [(name, qt.name, "triton", lay) for lay in ("ggml", "planar") if supported(qt, 0, lay)]
        want += [(name, qt.name, "int8", "planar")] if int8_supported(qt, 0, "planar") else []
    assert [(r["shape"], r["qtype"], r["path"], r["layout"]) for r in rows] == want
    for r in rows:
        assert "error" not in r and r["us"] > 0 and r["bytes"] > 0 and r["loop_us"] > 0
        assert r["net_us"] == pytest.approx(max(r["us"] - r["loop_us"], 1e-3), abs=0.02)
        # XLA reads both layouts to the same bits; the kernel sums in its own order; int8 rounds x (a few 1e-3)
        assert r["max_rel_diff_vs_xla"] < {"triton": 1e-6, "int8": 3e-2}.get(r["path"], 1e-30)
    assert any(r["path"] == "int8" and r["max_rel_diff_vs_xla"] > 1e-5 for r in rows)  # the rounding is real
