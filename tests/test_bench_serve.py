"""experiments/bench_serve.py runs on the CPU against a real server process (the lead runs it on the GPU): one JSON
line per concurrency level, with every request's completion tokens counted and the tier traffic /metrics saw
during that level (a three-tier profile, so the SSD tier is read)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {"name": "three-tiers", "tier0_bytes": 0.25, "tier1_bytes": 0.25, "placement_source": "uniform",
           "slot_cache_slots": 2, "lookahead": False, "router_lean": {"enabled": False}, "engram_tables": "ssd"}


@pytest.fixture
def bench(monkeypatch):
    """experiments/bench_serve.py as a module; the server it starts runs on the CPU and imports this checkout."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "experiments" / "bench_serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_runs_on_cpu(bench, tmp_path, capsys):
    model = tmp_path / "m.gguf"
    write_synthetic(model, preset("deepseek41", "tiny", layers=2), quant="q8", progress=False)
    profile = tmp_path / "three-tiers.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "serve.jsonl"
    assert bench.main([str(model), "--profile", str(profile), "--concurrency", "1,2", "--requests", "3",
                       "--prompt-len", "6", "--max-tokens", "5", "--ctx", "128", "--slots", "2",
                       "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert capsys.readouterr().out.count("\n") == len(rows) == 2
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["requests"] == 3 and 3 <= r["completion_tokens"] <= 15 and r["tok_s"] > 0
        assert r["ttft_ms"]["p50"] > 0 and r["tiers"]["ssd_bytes"] > 0 and r["profile"] == str(profile)
        m = r["metrics"]
        assert m["ssd_lookups"] > 0 and m["host_lookups"] > 0 and 0 <= m["ssd_hits"] <= m["ssd_lookups"], m
    assert (tmp_path / "serve.serve.log").stat().st_size > 0  # the server's own log is kept beside --out


@pytest.mark.timeout(300)
def test_a_server_that_dies_is_reported_with_its_log(bench, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(RuntimeError, match="no-such-model.gguf") as err:
        bench.main([str(missing), "--out", str(tmp_path / "rows.jsonl"), "--ready-timeout", "200"])
    assert "the server exited with" in str(err.value)
    assert not (tmp_path / "rows.jsonl").exists()
