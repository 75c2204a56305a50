"""experiments/profile_summary.py: kernel time summed under the decode graph's named scopes."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
from profile_summary import scope_of, summarize, table_rows  # noqa: E402


def test_scope_of_takes_the_first_listed_path_component():
    name = "jit(_loop)/while/body/cond/branch_1_fun/target_verify/ffn/dot_general"
    assert scope_of(name, ("draft_propose", "target_verify")) == "target_verify"
    assert scope_of(name, ("attention", "ffn")) == "ffn"
    assert scope_of(name, ("attention",)) == "-"
    assert scope_of("jit(f)/ffnx/add", ("ffn",)) == "-"  # whole components only


def test_summarize_groups_kernels_by_loop_and_pass_scope():
    ops = [
        {"tf_op_name": "jit(_loop)/while/body/draft_propose/attention/fusion", "occurrences": 10,
         "total_self_time": 50.0},
        {"tf_op_name": "jit(_loop)/while/body/target_verify/ffn/dot", "occurrences": 20, "total_self_time": 300.0},
        {"tf_op_name": "jit(_loop)/while/body/target_verify/ffn/gather", "occurrences": 10, "total_self_time": 100.0},
        {"tf_op_name": "jit(_loop)/while/body/rollback/scatter", "occurrences": 40, "total_self_time": 50.0},
    ]
    s = summarize(ops, steps=10, seconds=0.001)
    assert s["kernel_us"] == 500.0 and s["launches"] == 80
    g = {(r["loop"], r["pass"]): r for r in s["groups"]}
    assert set(g) == {("draft_propose", "attention"), ("target_verify", "ffn"), ("rollback", "-")}
    assert g[("target_verify", "ffn")]["kernel_us"] == 400.0 and g[("target_verify", "ffn")]["launches"] == 30
    assert g[("target_verify", "ffn")]["share"] == 0.8 and g[("target_verify", "ffn")]["us_per_step"] == 40.0
    assert s["groups"][0]["loop"] == "target_verify"  # largest first
    assert s["wall_us_per_step"] == 100.0 and s["kernel_share_of_wall"] == 0.5


def test_table_rows_reads_a_datatable():
    table = {"cols": [{"id": "tf_op_name"}, {"id": "total_self_time"}],
             "rows": [{"c": [{"v": "a/b"}, {"v": 1.5}]}, {"c": [{"v": "c"}, None]}]}
    assert table_rows(table) == [{"tf_op_name": "a/b", "total_self_time": 1.5}, {"tf_op_name": "c",
                                                                                 "total_self_time": None}]
