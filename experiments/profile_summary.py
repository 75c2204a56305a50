"""Where a traced run's device time goes, by the named scopes of the decode graph (issue #5 item 4, #6).

`bench_draft.py --xla-profile DIR` (and any jax.profiler trace) leaves `*.xplane.pb` files; this reads one with
xprof's `hlo_stats` tool (the `xprof` package: `pip install xprof`, only needed here, on the machine that reads the
trace) and sums every kernel's self time under the named scopes the graph sets:
- the drafting loop (jds41/speculative_loop.py): draft_propose, engram_rows, target_verify, accept, rollback,
  draft_inject;
- a model pass (jds41/model.py step, jds41/block_step.py step_rows): engram, mhc, attention, ffn, head.
A kernel counts under the first loop scope and the first pass scope its op name carries ("-" where none).

Prints a table and one JSON line: per (loop scope, pass scope) the kernels' total self time, their launches, and
with `--steps N` (the traced run's decode or verify steps) both per step. The sum of kernel time beside the run's
wall time (`--seconds`) says how much of a step is kernels at all: on a launch-bound step the rest is gaps between
launches and host round trips.

    python experiments/profile_summary.py DIR/none-w5-dspark-batched --steps 14 --seconds 0.11
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

LOOP_SCOPES = ("draft_propose", "engram_rows", "target_verify", "accept", "rollback", "draft_inject")
PASS_SCOPES = ("engram", "mhc", "attention", "ffn", "head")


def scope_of(op_name: str, scopes: tuple[str, ...]) -> str:
    """The first of `scopes` that is a path component of a framework op name (jit(f)/scope/... ), else "-"."""
    parts = op_name.split("/")
    for part in parts:
        if part in scopes:
            return part
    return "-"


def table_rows(table: dict) -> list[dict]:
    """A Google DataTable ({"cols": [{"id"}], "rows": [{"c": [{"v"}]}]}), as xprof's tools return, as dicts."""
    ids = [c["id"] for c in table["cols"]]
    return [{k: (cell or {}).get("v") for k, cell in zip(ids, r["c"], strict=False)} for r in table.get("rows", [])]


def summarize(ops: list[dict], steps: int | None = None, seconds: float | None = None) -> dict:
    """`ops`: hlo_stats rows (tf_op_name, occurrences, total_self_time in us). Sums per (loop scope, pass scope)."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for op in ops:
        name = op.get("tf_op_name") or op.get("hlo_op_name") or ""
        g = groups[(scope_of(name, LOOP_SCOPES), scope_of(name, PASS_SCOPES))]
        g[0] += float(op.get("total_self_time") or 0.0)
        g[1] += int(op.get("occurrences") or 0)
    total = sum(g[0] for g in groups.values())
    out = {"kernel_us": round(total, 1), "launches": sum(g[1] for g in groups.values()), "groups": []}
    for (loop, part), (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        row = {"loop": loop, "pass": part, "kernel_us": round(us, 1), "launches": n,
               "share": round(us / total, 4) if total else None}
        if steps:
            row.update(us_per_step=round(us / steps, 1), launches_per_step=round(n / steps, 1))
        out["groups"].append(row)
    if steps:
        out.update(steps=steps, kernel_us_per_step=round(total / steps, 1),
                   launches_per_step=round(out["launches"] / steps, 1))
        if seconds:
            out.update(wall_us_per_step=round(seconds * 1e6 / steps, 1),
                       kernel_share_of_wall=round(total / (seconds * 1e6), 4))
    return out


def load_ops(trace_dir: str) -> list[dict]:
    """hlo_stats rows of the newest xplane.pb under `trace_dir` (needs xprof)."""
    from xprof.convert import raw_to_tool_data

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise SystemExit(f"{trace_dir}: no *.xplane.pb under it")
    data, _ = raw_to_tool_data.xspace_to_tool_data([paths[-1]], "hlo_stats", {})
    table = json.loads(data)
    return table_rows(table[0] if isinstance(table, list) else table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--steps", type=int, default=None, help="decode / verify steps of the traced run")
    ap.add_argument("--seconds", type=float, default=None, help="the traced run's wall seconds")
    args = ap.parse_args(argv)
    s = summarize(load_ops(args.trace_dir), args.steps, args.seconds)
    unit = "us/step" if args.steps else "us"
    print(f"{'loop scope':16} {'pass scope':10} {unit:>10} {'launches':>9} {'share':>6}")
    for g in s["groups"]:
        us = g["us_per_step"] if args.steps else g["kernel_us"]
        n = g["launches_per_step"] if args.steps else g["launches"]
        print(f"{g['loop']:16} {g['pass']:10} {us:10.1f} {n:9.1f} {g['share'] or 0:6.3f}")
    print(json.dumps({"trace": args.trace_dir, **s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
