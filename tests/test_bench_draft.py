"""experiments/bench_draft.py runs on the CPU with a tiny model (the lead runs it on the GPU): one JSON line per
(profile, mode), every drafting mode gives plain decode's tokens, the oracles accept all / none of the drafts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_draft_runs_on_cpu(tmp_path, monkeypatch, capsys):
    model = tmp_path / "m.gguf"
    write_synthetic(model, preset("deepseek41", "tiny", draft_stages=2), quant="q8", progress=False)
    spec = importlib.util.spec_from_file_location("bench_draft", ROOT / "experiments" / "bench_draft.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    texts = tmp_path / "heldout.jsonl"  # the shipped held-out set's format: prompts come from its code documents
    texts.write_text("".join(json.dumps({"kind": kind, "text": text}) + "\n" for kind, text in
                             [("prose", "not code at all, skipped"), ("code", "x = 1"),
                              ("code", "def f(a, b):\n    return a + b\n" * 3), ("code", "class A:\n    pass\n" * 4)]))
    assert bench.main([str(model), "--profiles", "all-hbm", "--tokens", "12", "--prompts", "2",
                       "--prompt-len", "6", "--ctx", "256", "--texts", str(texts)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench_draft.jsonl").read_text().splitlines()]
    assert rows[0]["meta"] and capsys.readouterr().out.count("\n") == len(rows)
    runs = {(r["profile"], r["mode"]): r for r in rows[1:]}
    assert set(runs) == {("all-hbm", m) for m in bench.MODES}
    k = preset("deepseek41", "tiny").dspark.block_size
    for (_, mode), r in runs.items():
        assert r["tokens"] == 2 * 11 and r["decode_tok_s"] > 0
        if mode == "plain":
            assert r["device_loop_tok_s"] > 0
            continue
        assert r["verify"] == "layer-major"  # auto under a profile: the experts are tiered
        assert r["speedup_vs_device_loop"] > 0
        assert r["identical_to_plain"] is True and r["speedup_vs_plain"] > 0
        if mode == "dspark-host":
            assert r["device_loop_speedup"] > 0 and r["same_draft_stats_as_device_loop"] is True
        if mode == "oracle-right":
            assert r["acceptance_rate"] == 1.0 and r["verify_steps"] == 2 * -(-11 // (k + 1))
        if mode == "oracle-wrong":
            assert r["acceptance_rate"] == 0.0 and r["tokens_per_step"] == 1.0
    assert runs[("all-hbm", "dspark")]["tiers"]["tokens"] > 0  # the tier runtime counted the verified tokens

    # both verify modes side by side: same drafts and tokens, the layer-major row compared with the token-major one
    assert bench.main([str(model), "--profiles", "all-hbm", "--tokens", "12", "--prompts", "2", "--prompt-len", "6",
                       "--ctx", "256", "--modes", "plain,oracle-wrong", "--verify", "token-major,layer-major"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench_draft.jsonl").read_text().splitlines()][1:]
    assert [(r["mode"], r.get("verify")) for r in rows] == [("plain", None), ("oracle-wrong", "token-major"),
                                                           ("oracle-wrong", "layer-major")]
    assert rows[1]["identical_to_plain"] and rows[2]["identical_to_plain"]
    assert rows[2]["speedup_vs_token_major"] > 0 and rows[2]["same_draft_stats_as_token_major"] is True

    # at decode width k+1 every verify block is one batched pass, exact against plain decode at that width
    assert bench.main([str(model), "--profiles", "none", "--tokens", "12", "--prompts", "2", "--prompt-len", "6",
                       "--ctx", "256", "--modes", "plain,oracle-right", "--decode-widths", str(k + 1)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench_draft.jsonl").read_text().splitlines()][1:]
    assert [(r["mode"], r.get("verify"), r["decode_width"]) for r in rows] == [
        ("plain", None, k + 1), ("oracle-right", "batched", k + 1)]
    assert rows[1]["identical_to_plain"] is True and rows[1]["acceptance_rate"] == 1.0


def test_text_prompts_take_long_enough_code_documents(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    from heldout import text_prompts

    class Chars:  # one id per character: lengths are easy to reason about
        def encode(self, text):
            return [ord(c) for c in text]

    texts = tmp_path / "t.jsonl"
    docs = [("code", "ab"), ("prose", "long prose"), ("code", "abcdef"), ("code", "xyzw")]
    texts.write_text("".join(json.dumps({"kind": k, "text": t}) + "\n" for k, t in docs))
    assert text_prompts(Chars(), str(texts), 5, 4) == [[97, 98, 99, 100], [120, 121, 122, 119]]


@pytest.mark.slow
def test_bench_draft_parts_times_every_part_on_cpu(tmp_path, capsys):
    model = tmp_path / "m.gguf"
    cfg = preset("deepseek41", "tiny", draft_stages=2)
    write_synthetic(model, cfg, quant="q8", progress=False)
    spec = importlib.util.spec_from_file_location("bench_draft_parts", ROOT / "experiments" / "bench_draft_parts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "parts.jsonl"
    width = cfg.dspark.block_size + 1
    assert bench.main([str(model), "--profiles", "none,all-hbm", "--decode-width", str(width), "--iters", "1,3",
                       "--tokens", "9", "--prompt-len", "6", "--ctx", "256", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["meta"] and [r["profile"] for r in rows[1:]] == ["none", "all-hbm"]
    for r in rows[1:]:
        assert r["decode_width"] == width and r["verify"] == "batched" and r["block_size"] == width - 1
        parts = ("step", "verify", "propose", "inject", "engram_rows", "loop_plain_step", "loop_verify_step")
        assert all(r[f"{p}_ms"] >= 0 for p in parts) and r["loop_verify_step_ms"] > 0 and r["loop_plain_step_ms"] > 0
        explained = sum(r[f"{p}_ms"] for p in ("propose", "engram_rows", "verify", "inject"))
        assert abs(r["unexplained_ms"] - (r["loop_verify_step_ms"] - explained)) < 1e-3
    assert capsys.readouterr().out.count("\n") == len(rows)
