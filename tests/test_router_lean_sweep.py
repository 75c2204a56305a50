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


@pytest.mark.slow
def test_sweep_draft_acceptance(tmp_path, synthetic_model):
    """--draft: per margin the drafter's acceptance and tokens per verify step, and drafting gives plain greedy
    decode's tokens under the same margin at every margin (random weights: acceptance itself means nothing here)."""
    model = synthetic_model("deepseek41", "tiny", quant="q8", draft_stages=2)
    texts = tmp_path / "heldout.jsonl"  # the shipped held-out set's format: draft prompts come from code documents
    docs = [("prose", "not code, not a prompt " * 8)] + [("code", f"def f{i}(a, b):\n    return a + {i} * b\n" * 6)
                                                          for i in range(3)]
    texts.write_text("".join(json.dumps({"kind": k, "text": t}) + "\n" for k, t in docs))
    out = tmp_path / "d.jsonl"
    rows = S.main([str(model), "--profile", "lucebox", "--margins", "0.1,1.0", "--texts", str(texts), "--kind", "code",
                   "--max-sequences", "1", "--seq-len", "16", "--prompts", "0", "--draft", "self",
                   "--draft-prompts", "2", "--draft-prompt-len", "12", "--draft-tokens", "10",
                   "--workdir", str(tmp_path), "--out", str(out), "--table", str(tmp_path / "t.md")])
    assert [r["margin"] for r in rows] == [0.0, 0.1, 1.0] and rows[-1]["topk_agreement"] < 1.0  # the lean acts
    for r in rows:
        assert r["draft_prompts"] == 2 and r["draft_block_size"] >= 1 and "greedy_agreement" not in r
        assert 0.0 <= r["draft_acceptance_rate"] <= 1.0
        assert 1.0 <= r["draft_tokens_per_step"] <= r["draft_block_size"] + 1
        assert r["draft_identical_to_plain"] is True and r["draft_verify"] == "layer-major"
    assert "draft_plain_agreement" not in rows[0] and all(0 <= r["draft_plain_agreement"] <= 1 for r in rows[1:])
    assert [json.loads(line)["draft_identical_to_plain"] for line in out.read_text().splitlines()] == [True] * 3

    import report as R

    text = R.table(R.load([str(out)]))
    assert text.count("\n") == 2 + 3 and f"| {rows[0]['draft_acceptance_rate']:.4f} |" in text
    assert "| 0.1 |" in text and "| - |" in text  # margin 0.1 without greedy continuations


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
    assert all(line.endswith("| - | - |") for line in text.splitlines()[2:])  # no draft measurements

    # a --draft sweep beside them (fewer tokens scored): its draft fields join the rows of the same margins
    draft = [{**row("lucebox", "code", m, 1.0, 0.5), "tokens_scored": 1, "draft_acceptance_rate": acc,
              "draft_tokens_per_step": 1 + 4 * acc, "draft_identical_to_plain": True} for m, acc in ((0.0, 0.6),
                                                                                                  (0.05, 0.4))]
    a2 = tmp_path / "a2.jsonl"
    a2.write_text("".join(json.dumps({**r, "tokens_scored": 100}) + "\n" for r in pts[:3]))
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps(r) + "\n" for r in draft))
    for files in ([a2, c], [c, a2]):  # either order: the larger sweep keeps its numbers
        rows = R.load([str(f) for f in files])[("lucebox", "code")]
        assert [r["topk_agreement"] for r in rows] == [1.0, 0.95, 0.89]
        assert [r.get("draft_acceptance_rate") for r in rows] == [0.6, None, 0.4]
    text = R.table(R.load([str(a2), str(c)]))
    assert "| 0.6000 | 3.400 |" in text and "| 0.02 | 0.9500 |" in text and text.count("| - | - |") == 1
