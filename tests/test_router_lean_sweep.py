"""experiments/router_lean/sweep.py on the shipped tiny model (random weights: the numbers say nothing about a real
model's quality, only that the sweep measures what it claims): margin 0 is the unbiased reference, and a wider
margin trades agreement for traffic in the fast tiers, monotonically, on one compiled engine."""

from __future__ import annotations

import json
import sys

import pytest
from serve_harness import REPO

sys.path.insert(0, str(REPO / "experiments" / "router_lean"))
import sweep as S  # noqa: E402


@pytest.mark.slow
def test_sweep_margins(tmp_path):
    rows = S.main([str(REPO / "checkpoints" / "tiny-deepseek41-q8.gguf"), "--profile", "lucebox",
                   "--margins", "0.02,0.1,1.0", "--random-tokens", "96", "--seq-len", "32", "--generate", "12",
                   "--workdir", str(tmp_path), "--table", str(tmp_path / "t.md")])
    assert [r["margin"] for r in rows] == [0.0, 0.02, 0.1, 1.0]  # the reference is added first
    ref = rows[0]
    assert ref["topk_agreement"] == 1.0 and "kl_nats" not in ref
    agree = [r["topk_agreement"] for r in rows]
    ssd = [r["tier_share"]["ssd"] for r in rows]
    assert agree == sorted(agree, reverse=True) and agree[-1] < 1.0
    assert ssd == sorted(ssd, reverse=True) and ssd[-1] < ssd[0]
    for r in rows[1:]:
        assert r["kl_nats"] >= 0 and 0 <= r["greedy_agreement"] <= 1 and r["roofline_speedup"] >= 1.0
    assert (tmp_path / "t.md").read_text().count("\n") == 2 + len(rows)


def test_report_groups_series_and_finds_the_pareto_front(tmp_path):
    import report as R

    def row(profile, kind, margin, speed, agree):
        return {"profile": profile, "kind": kind, "margin": margin, "full_size_speedup": speed,
                "topk_agreement": agree, "bits_per_token": 4.0, "full_size_roofline_tok_s": 2.0 * speed,
                "tier_share": {"hbm": 0.1, "host": 0.6, "ssd": 0.3}}

    pts = [row("lucebox", "code", 0.0, 1.0, 1.0), row("lucebox", "code", 0.05, 1.3, 0.89),
           row("lucebox", "code", 0.02, 1.1, 0.95), row("lucebox", "code", 0.07, 1.2, 0.80),  # dominated by 0.05
           row("h200", "code", 0.0, 1.0, 1.0)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in pts[:3]))
    b.write_text("".join(json.dumps(r) + "\n" for r in pts[3:] + [row("lucebox", "code", 0.0, 9.0, 0.1)]))
    series = R.load([str(a), str(b)])  # the second file's margin-0 lucebox row repeats a margin: first file wins
    assert list(series) == [("h200", "code"), ("lucebox", "code")]
    assert [r["margin"] for r in series[("lucebox", "code")]] == [0.0, 0.02, 0.05, 0.07]
    assert [r["margin"] for r in R.pareto(series[("lucebox", "code")])] == [0.0, 0.02, 0.05]
    text = R.table(series)
    assert text.count("\n") == 2 + 5 and "| lucebox | code | 0.07 | 0.8000 |" in text
