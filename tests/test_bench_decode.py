"""experiments/bench_decode.py runs end to end on CPU at the tiny size (the lead runs it on the GPU box): the
Zipf-like skew lands near its target, every profile's greedy predictions are identical (placement never changes a
token), and bytes, roofline and ratio agree with their definitions. Timings here are not speed figures."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from serve_harness import REPO

sys.path.insert(0, str(REPO / "experiments"))
import bench_decode as B  # noqa: E402


def test_fit_skew_reaches_its_target():
    for top10 in (0.3, 0.5):
        g = B.fit_skew(64, 4, top10)
        rng = np.random.default_rng(5)  # a fresh simulation, not the one the fit used
        s = np.sqrt(np.logaddexp(0, rng.standard_normal((4096, 64)))) - g * np.log1p(np.arange(64))
        sel = np.argpartition(-s, 3, axis=1)[:, :4]
        counts = np.sort(np.bincount(sel.reshape(-1), minlength=64))[::-1]
        assert counts[:6].sum() / counts.sum() == pytest.approx(top10, abs=0.03)


@pytest.mark.slow
def test_bench_decode_runs_and_profiles_agree(tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    B.main(["--arch", "deepseek41", "--size", "tiny", "--layers", "4", "--quant", "q8", "--profiles",
            "plain,lucebox,all-host", "--prompt", "40", "--decode", "6", "--usage-tokens", "512",
            "--skew-top10", "0.5", "--workdir", str(tmp_path), "--out", str(out)])
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["profile"] for r in runs] == ["plain", "lucebox", "all-host"]
    assert len({r["predictions_sha256"] for r in runs}) == 1 and all(r["same_predictions_as_first"] for r in runs)
    for r in runs:
        per = r["bytes_per_token"]
        best = 1 / max(per[k] / B.BW[k] for k in ("hbm", "pcie", "ssd"))
        assert r["roofline_tok_s"] == pytest.approx(best, rel=1e-3)
        assert r["ratio"] == pytest.approx(r["decode_tok_s"] / r["roofline_tok_s"], rel=1e-2, abs=1e-4)
        assert r["decode_tokens"] == 6 and r["prefill_tokens"] == 40
        assert r["compiles_while_timed"] == {"prefill": 0, "decode": 0}, r["profile"]  # timings exclude compiling
    host = runs[2]["tiers"]
    assert host["host_share"] == 1.0 and host["bytes_per_token"]["host"] > 0 and runs[2]["bytes_per_token"]["ssd"] == 0
    luce = runs[1]["tiers"]
    assert abs(luce["hbm_share"] + luce["host_share"] + luce["ssd_share"] - 1) < 1e-3
    sc = luce["slot_cache"]  # at most one SSD host call per layer per step, answering 1 (compact) or K = 2 rows
    assert sc["host_calls_per_token"] <= 4 and (sc["lookups"] > 0) == (sc["host_calls_per_token"] > 0)
    assert sc["host_calls_per_token"] <= sc["answer_rows_per_token"] <= 2 * sc["host_calls_per_token"]
    assert runs[0]["routing"]["measured"]["tokens"] == 512
    assert all("device_hbm_read_bps" not in r and "ratio_device_hbm" not in r for r in runs)  # no GPU here


def test_the_device_roofline_swaps_in_only_the_measured_hbm_bandwidth():
    assert B.device_hbm_read_bps() is None  # the CPU has no HBM to measure
    row = {"bytes_per_token": {"hbm": 1.8e9, "pcie": 6.0e6, "ssd": 0}, "decode_tok_s": 700.0}
    # an H100-like 2.75 TB/s: HBM still binds (1.8e9 / 2.75e12 > 6e6 / 48e9)
    got = B.device_roofline(row, 2.75e12)
    assert got["roofline_device_hbm_tok_s"] == pytest.approx(2.75e12 / 1.8e9, rel=1e-3)
    assert got["ratio_device_hbm"] == pytest.approx(700.0 * 1.8e9 / 2.75e12, rel=1e-3)
    # a fast enough HBM leaves PCIe binding, at the reference box's PCIe bandwidth
    assert B.device_roofline(row, 1e15)["roofline_device_hbm_tok_s"] == pytest.approx(B.BW["pcie"] / 6.0e6, rel=1e-3)
