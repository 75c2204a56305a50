"""experiments/profile_decode.py: the trace arithmetic (busy time as a union of intervals, the per-kernel table),
reading the model part of a fusion off XLA's stack-frame tables, and a CPU smoke run end to end (its code path
only: on the CPU the 'device' is XLA's thread pool, and timings are not speed figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import REPO

sys.path.insert(0, str(REPO / "experiments"))
import profile_decode as P  # noqa: E402


def _ev(name, ts, dur):
    return {"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur}


def test_busy_time_counts_overlapping_kernels_once_and_the_table_sums_per_token():
    events = [_ev("a", 0, 10), _ev("b", 5, 10), _ev("a", 30, 10), _ev("c", 32, 2)]  # union: [0,15] + [30,40]
    assert P.busy_us(events) == 25
    table = P.kernel_table(events, tokens=2)
    assert table[0] == {"name": "a", "per_token": 1.0, "us_per_token": 10.0, "mean_us": 10.0}
    assert [r["name"] for r in table] == ["a", "b", "c"]
    s = P.summarize(events, tokens=2, wall_s=50e-6, sources={})
    assert s["device_busy_us_per_token"] == 12.5 and s["device_idle_us_per_token"] == 12.5
    assert s["kernels_per_token"] == 2.0 and s["parts"]["unattributed"]["kernels_per_token"] == 2.0


def test_one_token_lists_a_middle_tokens_kernels_in_order_with_the_gap_before_each():
    events = []
    for tok in range(4):  # per token: head (once, longest), then "a" twice; a 7 us gap before the second "a"
        t0 = 100.0 * tok
        events += [_ev("head", t0, 20), _ev("a", t0 + 21, 3), _ev("a", t0 + 31, 3)]
    got = P.one_token(list(reversed(events)), tokens=4)  # the trace's order is not launch order
    assert got["marker"] == "head" and got["kernels"] == 3 and got["span_us"] == 100.0
    assert got["sequence"] == [["head", 20.0, 0.0, ""], ["a", 3.0, 1.0, ""], ["a", 3.0, 7.0, ""]]
    assert got["gap_us"] == 74.0 and got["gaps_over_5us"] == [[7.0, "a"], [66.0, "head (next token)"]]
    assert P.one_token([_ev("a", 0, 1), _ev("a", 5, 1)], tokens=1) is None  # "a" runs twice a token: no marker


HLO = """HloModule jit__loop

FileNames
1 "/x/jds41/quant/qtensor.py"
2 "/x/jds41/layers/attention.py"
3 "/x/jds41/model.py"

FunctionNames
1 "_row_dot"
2 "query"
3 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=2}
3 {file_name_id=3 function_name_id=3 line=30 end_line=30 column=1 end_column=2}

StackFrames
1 {file_location_id=3 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=1 parent_frame_id=2}

ENTRY %main {
  %input_reduce_fusion.3 = f32[8]{0} fusion(%p), kind=kInput, calls=%c, METADATA
  %add.1 = f32[8]{0} add(%a, %b)
}
""".replace("METADATA", 'metadata={op_name="jit(_loop)/while/body/attn/reduce" stack_frame_id=3}')


def test_a_fusion_is_attributed_to_its_jds41_source_and_model_part(tmp_path):
    (tmp_path / "module_0001.jit__loop.sm_90_gpu_after_optimizations.txt").write_text(HLO)
    sources = P.hlo_sources(str(tmp_path))
    want = ("quant/qtensor.py:10 _row_dot", "layers/attention.py:20 query", "attn")
    assert sources["input_reduce_fusion.3"] == want and sources["input_reduce_fusion_3"] == want  # GPU spelling
    assert P.part_of("input_reduce_fusion_3", sources) == "attn/layers/attention.py"
    assert P.part_of("MemcpyD2H", sources) == "copies" and P.part_of("rows_matvec_q8_0_planar", {}).startswith("quant")


def test_the_named_pallas_kernels_are_attributed_to_the_modules_that_launch_them():
    root = Path(REPO) / "jds41"
    for name, module in P.NAMED_KERNELS.items():
        assert f'name="{name}"' in (root / module).read_text(), (name, module)  # the pallas_call's own name
        assert P.part_of(f"{name}_3", {}) == module


@pytest.mark.slow
def test_profile_decode_runs_on_the_cpu(tmp_path):
    # its own process: XLA reads the dump flags when the backend starts, before any test of this one's started it
    out = tmp_path / "profile.jsonl"
    res = subprocess.run([sys.executable, str(REPO / "experiments" / "profile_decode.py"), "--arch", "deepseek4",
                          "--size", "tiny", "--layers", "2", "--quant", "mxfp4", "--prompt", "8", "--decode", "4",
                          "--workdir", str(tmp_path), "--hlo-dump", str(tmp_path / "hlo"), "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["decode_tokens"] == 4 and row["kernels_per_token"] > 0 and row["unprofiled_tok_s"] > 0
    assert 0 < row["device_busy_us_per_token"] and len(row["predictions_sha256"]) == 16
    assert any(part.startswith(("attn/", "ffn/", "head/")) for part in row["parts"]), row["parts"]
