"""experiments/extrapolate_depth.py: rows made from a known line in the depth (plus noise) give that line back, the
full depth's bytes give bench_decode's roofline rule re-derived here, a single depth is never extrapolated, and
rows of different calls are never mixed."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from serve_harness import REPO

sys.path.insert(0, str(REPO / "experiments"))
import extrapolate_depth as X  # noqa: E402

BW = {"hbm": 4.4e12, "pcie": 48e9, "ssd": 1.9e9}  # DESIGN.md §7, written out so the test re-derives the rule


def _rows(fixed_ms, layer_ms, fixed_b, layer_b, depths, commit="c1", noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for d in depths:
        ms = fixed_ms + layer_ms * d + noise * rng.standard_normal()
        rows.append({"bench": "decode", "commit": commit, "machine": "m", "arch": "deepseek41", "quant": "ds4-q2",
                     "profile": "plain", "numerics": "int8", "layers": d, "decode_ms_per_token": ms,
                     "decode_tok_s": 1e3 / ms,
                     "bytes_per_token": {k: fixed_b[k] + layer_b[k] * d for k in BW}})
    return rows


def test_a_line_in_the_depth_comes_back_and_is_evaluated_at_the_full_depth():
    fixed_b, layer_b = {"hbm": 7.0e8, "pcie": 0, "ssd": 0}, {"hbm": 2.8e8, "pcie": 1.0e6, "ssd": 0}
    rows = _rows(0.29, 0.264, fixed_b, layer_b, [2, 4, 4, 8], noise=0.002)
    [group] = X.groups(rows + [{"bench": "prefill"}])
    got = X.extrapolate(group)
    assert got["target_layers"] == 40 and got["depths"] == [2, 4, 8] and got["method"].startswith("extrapolated")
    assert got["per_layer_ms"] == pytest.approx(0.264, abs=2e-3) and got["fixed_ms"] == pytest.approx(0.29, abs=1e-2)
    assert got["fit_max_residual_ms"] < 0.01
    ms = got["fixed_ms"] + 40 * got["per_layer_ms"]
    assert got["extrapolated_tok_s"] == pytest.approx(1e3 / ms, rel=1e-3)
    want_bytes = {k: fixed_b[k] + 40 * layer_b[k] for k in BW}
    assert got["extrapolated_bytes_per_token"] == pytest.approx(want_bytes, rel=1e-9)
    roofline = 1 / max(want_bytes[k] / BW[k] for k in BW)
    assert got["roofline_tok_s"] == pytest.approx(roofline, rel=1e-3)
    assert got["ratio"] == pytest.approx(1e3 / ms / roofline, rel=1e-3)


def test_rows_that_measured_their_gpu_get_its_roofline_at_the_fastest_measurement():
    fixed_b, layer_b = {"hbm": 7.0e8, "pcie": 0, "ssd": 0}, {"hbm": 2.4e8, "pcie": 0, "ssd": 0}
    rows = _rows(0.3, 0.29, fixed_b, layer_b, [2, 4, 8])
    assert "ratio_device_hbm" not in X.extrapolate(rows)  # no row measured a GPU
    for r, bw in zip(rows, (2.70e12, 2.75e12, 2.72e12)):
        r["device_hbm_read_bps"] = bw
    got = X.extrapolate(rows)
    roofline = 2.75e12 / (fixed_b["hbm"] + 40 * layer_b["hbm"])  # only HBM is read: it binds
    assert got["device_hbm_read_bps"] == 2.75e12
    assert got["roofline_device_hbm_tok_s"] == pytest.approx(roofline, rel=1e-3)
    assert got["ratio_device_hbm"] == pytest.approx(got["extrapolated_tok_s"] / roofline, rel=1e-3)
    del rows[0]["device_hbm_read_bps"]
    assert "ratio_device_hbm" not in X.extrapolate(rows)  # a row without it: no mixed claim


def test_one_depth_is_not_extrapolated_and_calls_are_not_mixed(tmp_path, capsys):
    b = {"hbm": 1e9, "pcie": 0, "ssd": 0}
    rows = _rows(0.3, 0.25, b, b, [4, 4], commit="c1") + _rows(0.3, 0.25, b, b, [2, 8], commit="c2")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert X.main([str(path), "--layers", "40", "--out", str(tmp_path / "out.jsonl")]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["commit"] for o in out] == ["c1", "c2"]
    assert out[0]["method"].startswith("not extrapolated") and "extrapolated_tok_s" not in out[0]
    assert out[1]["depths"] == [2, 8] and out[1]["per_layer_ms"] == pytest.approx(0.25, rel=1e-6)
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_the_committed_single_depth_rows_are_reported_not_extrapolated():
    path = REPO / "experiments" / "results" / "bench_decode_final26_v41_4L_h200.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = X.groups(rows)
    assert len(found) == 2  # jds41 and int8 numerics
    assert all(X.extrapolate(g)["method"].startswith("not extrapolated") for g in found)
