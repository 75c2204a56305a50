"""experiments/probe_side_stream.py's cases on the CPU, in this process with the switch on (its code path only: the
CPU ignores the stream annotation): each graph lowers with the annotation, compiles and gives the bits of the same
graph without the region, and a case that cannot compile here (a compiled Pallas call) is a row with its error,
not a crash. Which cases the GPU accepts is what the probe measures there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jds41.layers import side_stream

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setattr(side_stream, "ENABLED", True)
    spec = importlib.util.spec_from_file_location("probe_side_stream", ROOT / "experiments" / "probe_side_stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["while", "while_weight_arg", "while_weight_platform", "while_cond_inside",
                                  "callback_while"])
def test_a_case_lowers_annotated_and_keeps_the_bits(probe, case):
    row = probe.run_case(case)
    assert row["case"] == case
    assert row.get("error") is None and row["ok"]
    assert row["annotated"] and row["same_bits"]


def test_a_case_that_cannot_compile_is_a_row_with_its_error(probe):
    row = probe.run_case("pallas_top")  # a compiled (not interpreted) Pallas call: GPU only
    assert row["ok"] is False and "interpret" in row["error"]
