"""experiments/pick_switches.py: a switch earns the decode A/B only with passing GPU tests, checked rows and a gain."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("pick_switches", Path(__file__).parent.parent / "experiments" /
                                               "pick_switches.py")
pick_switches = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_switches)

PASSED = "16 passed, 2 warnings in 40.1s"


def _row(shape, qtype, path, stages, net_us, **extra):
    row = {"shape": shape, "qtype": qtype, "path": path, "layout": "planar", "stages": stages, "net_us": net_us,
           "max_rel_diff_vs_xla": 1e-7}
    if path != "mgpu" and stages:
        row.update(stages_marked=True, bits_equal_unstaged=True)
    return {**row, **extra}


def _twobit(gate_up_3, down_3, **extra):
    return [_row("gu", "IQ2_XXS", "int8", 0, 40.0), _row("gu", "IQ2_XXS", "int8", 3, gate_up_3, **extra),
            _row("dn", "Q2_K", "int8", 0, 20.0), _row("dn", "Q2_K", "int8", 3, down_3),
            # the f32 kernel's rows of the same formats are not the engine's path under int8 numerics
            _row("gu", "IQ2_XXS", "triton", 0, 90.0), _row("gu", "IQ2_XXS", "triton", 3, 10.0)]


def _q8(staged, mosaic):
    rows = []
    for shape, base in (("q_b", 20.0), ("o_b", 18.0)):
        rows += [_row(shape, "Q8_0", "triton", 0, base), _row(shape, "Q8_0", "triton", 3, base * staged),
                 _row(shape, "Q8_0", "mgpu", 4, base * mosaic)]
    return rows


def test_a_format_is_staged_only_where_its_engine_path_gained():
    env, reasons = pick_switches.pick(_twobit(30.0, 19.8), PASSED)  # IQ2_XXS -25%, Q2_K -1%
    assert env == ["JDS41_LOOP_STAGES=IQ2_XXS=3"]
    assert any("IQ2_XXS int8 stages 3: 30.0 us against 40.0" in r for r in reasons)


def test_unmarked_or_changed_bits_or_failed_tests_earn_nothing():
    assert pick_switches.pick(_twobit(30.0, 10.0, stages_marked=False), PASSED)[0] == [
        "JDS41_LOOP_STAGES=Q2_K=3"]
    assert pick_switches.pick(_twobit(30.0, 10.0, bits_equal_unstaged=False), PASSED)[0] == [
        "JDS41_LOOP_STAGES=Q2_K=3"]
    failed = "FAILED tests/test_loop_stages.py::test_x - assert\n1 failed, 15 passed"
    assert pick_switches.pick(_twobit(30.0, 10.0), failed)[0] == []
    assert pick_switches.pick(_twobit(30.0, 10.0), "collecting ... (cut by the call's timeout)")[0] == []


def test_the_faster_of_staging_and_mosaic_takes_q8_0():
    assert pick_switches.pick(_q8(staged=0.9, mosaic=0.6), PASSED)[0] == ["JDS41_MOSAIC_Q8=1"]
    assert pick_switches.pick(_q8(staged=0.6, mosaic=0.9), PASSED)[0] == ["JDS41_LOOP_STAGES=Q8_0=3"]
    assert pick_switches.pick(_q8(staged=1.1, mosaic=0.99), PASSED)[0] == []
    mosaic_failed = "ERROR tests/test_mgpu_matvec.py::test_y - RuntimeError\n1 error, 15 passed"
    assert pick_switches.pick(_q8(staged=0.9, mosaic=0.6), mosaic_failed)[0] == ["JDS41_LOOP_STAGES=Q8_0=3"]


def test_a_mosaic_product_that_disagrees_with_xla_earns_nothing():
    rows = [{**r, "max_rel_diff_vs_xla": 0.5} if r["path"] == "mgpu" else r for r in _q8(staged=1.0, mosaic=0.5)]
    assert pick_switches.pick(rows, PASSED)[0] == []


def test_a_shape_whose_staged_kernel_failed_to_compile_leaves_the_format_out():
    rows = _twobit(30.0, 10.0)
    rows[1] = {**rows[1], "error": "CompilationError: ..."}
    assert pick_switches.pick(rows, PASSED)[0] == ["JDS41_LOOP_STAGES=Q2_K=3"]


def test_cli_prints_the_assignments_last(tmp_path, capsys, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in _twobit(30.0, 10.0) + _q8(0.9, 0.6)) + "\n")
    tests = tmp_path / "tests.txt"
    tests.write_text(PASSED)
    monkeypatch.setattr("sys.argv", ["pick_switches.py", str(rows), str(tests)])
    assert pick_switches.main() == 0
    assert capsys.readouterr().out.splitlines()[-1] == "JDS41_LOOP_STAGES=IQ2_XXS=3,Q2_K=3 JDS41_MOSAIC_Q8=1"


def test_cli_with_no_rows_written_earns_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pick_switches.py", str(tmp_path / "none.jsonl"), str(tmp_path / "none.txt")])
    assert pick_switches.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "" and "loop_stages not passed" in out[-2]
