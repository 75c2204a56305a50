"""experiments/probe_side_stream.py's cases on the CPU, in this process with the switch on (its code path only: the
CPU ignores the stream annotation): each graph lowers with the annotation, compiles and gives the bits of the same
graph without the region, and a case that cannot compile here (a compiled Pallas call) is a row with its error,
not a crash. Its engine mode in subprocesses: a row a JDS41_SIDE_STREAM value, each decoding with the predictions of
the run with the switch off. Which cases and sites the GPU accepts is what the probe measures there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jds41.layers import side_stream

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setattr(side_stream, "SITES", frozenset(side_stream.ALL_SITES))
    spec = importlib.util.spec_from_file_location("probe_side_stream", ROOT / "experiments" / "probe_side_stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["while", "while_weight_arg", "while_weight_platform", "while_cond_inside",
                                  "callback_while", "while_nested_jit", "while_nested_jit_raw"])
def test_a_case_lowers_annotated_and_keeps_the_bits(probe, case):
    row = probe.run_case(case)
    assert row["case"] == case
    assert row.get("error") is None and row["ok"]
    assert row["annotated"] and row["same_bits"]


def test_a_case_that_cannot_compile_is_a_row_with_its_error(probe):
    row = probe.run_case("pallas_top")  # a compiled (not interpreted) Pallas call: GPU only
    assert row["ok"] is False and "interpret" in row["error"]


def test_the_engine_mode_reports_each_site_set_against_the_switch_off(synthetic_model, tmp_path):
    model = synthetic_model("deepseek41", "tiny", "mxfp4")
    out = tmp_path / "engine.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "probe_side_stream.py"), "--engine",
                          "off,latent+engram", "--model", str(model), "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    off, on = (json.loads(line) for line in out.read_text().splitlines())
    assert off["mechanism"] == "off" and on["mechanism"].endswith("(latent,engram)")  # the sites really switched
    for row in (off, on):
        assert row["ok"] and row["repeats"] and row["same_predictions_as_off"] and row["mode"] == "engine"
        assert all(ms > 0 for ms in row["ms_per_token"])
