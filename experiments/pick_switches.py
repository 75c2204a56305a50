"""Which opt-in product switches earned a decode A/B: reads bench_kernels rows and the GPU tests' output of one device
call (experiments/device_next.sh lease) and prints, on its last line, the environment assignments to time against
the defaults (empty when none earned it).

A switch earns the A/B only when its GPU tests passed in that call and its products, on the same machine, took at
least MIN_GAIN less time than the engine's default path for those products (summed over the measured shapes):
- JDS41_LOOP_STAGES=TYPE=S (quant/loop_stages.py) for a format whose staged rows were marked (`stages_marked`),
  gave the unstaged bits (`bits_equal_unstaged`) and beat stages 0 on the path the engine takes under int8
  numerics (the int8 kernel for the two-bit experts, the f32 kernel on planar rows for Q8_0);
- JDS41_MOSAIC_Q8=1 (quant/mgpu_matvec.py) when the Mosaic kernel beat the unstaged Triton kernel on planar Q8_0
  rows and agreed with XLA to f32 rounding; where staging Q8_0 also earned its place, only the faster of the two.

    python experiments/pick_switches.py ROWS.jsonl GPU_TESTS.txt
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

MIN_GAIN = 0.03  # a smaller difference is within what two runs of one kernel give on these machines
AGREE_REL = 1e-4  # the Mosaic kernel's max relative difference to XLA (it sums in another order: f32 rounding)
ENGINE_PATH = {"IQ2_XXS": "int8", "Q2_K": "int8", "Q8_0": "triton"}  # the default path under int8 numerics


def tests_passed(text: str, test_file: str) -> bool:
    """Whether pytest's output shows a summary with passes and no failure or error in `test_file`."""
    if not re.search(r"\d+ passed", text):
        return False
    return not re.search(rf"(FAILED|ERROR) tests/{re.escape(test_file)}", text)


def totals(rows: list[dict]) -> dict:
    """{(qtype, path, stages): [net us summed over shapes, shapes, whether every row passed its checks]}."""
    out: dict = defaultdict(lambda: [0.0, 0, True])
    for r in rows:
        if "error" in r or r.get("layout") != "planar":  # the engine's layout for these formats
            continue
        key = (r["qtype"], r["path"], r.get("stages"))
        out[key][0] += r["net_us"]
        out[key][1] += 1
        if r["path"] != "mgpu" and r.get("stages"):
            ok = r.get("stages_marked") is True and r.get("bits_equal_unstaged") is True
            out[key][2] = out[key][2] and ok
        if r["path"] == "mgpu":
            out[key][2] = out[key][2] and r["max_rel_diff_vs_xla"] <= AGREE_REL
    return out


def pick(rows: list[dict], tests: str) -> tuple[list[str], list[str]]:
    """(assignments, reasons): the switches that earned a decode A/B and one line per comparison."""
    t = totals(rows)
    reasons, staged, mosaic = [], {}, None
    stages_ok, mgpu_ok = tests_passed(tests, "test_loop_stages.py"), tests_passed(tests, "test_mgpu_matvec.py")
    for (qtype, path, stages), (us, n, ok) in sorted(t.items(), key=lambda kv: str(kv[0])):
        base = t.get((qtype, "triton" if path == "mgpu" else path, 0))  # the unstaged default kernel
        if not stages or path not in (ENGINE_PATH.get(qtype), "mgpu") or not base or base[1] != n:
            continue
        gain = 1 - us / base[0]
        reasons.append(f"{qtype} {path} stages {stages}: {us:.1f} us against {base[0]:.1f} over {n} shapes "
                       f"({gain:+.1%}), checks {'ok' if ok else 'failed'}")
        if gain < MIN_GAIN or not ok:
            continue
        if path == "mgpu" and mgpu_ok and (mosaic is None or us < mosaic[1]):
            mosaic = (stages, us)
        elif path != "mgpu" and stages_ok and (qtype not in staged or us < staged[qtype][1]):
            staged[qtype] = (stages, us)
    if mosaic and "Q8_0" in staged:  # one of the two for Q8_0: the faster
        if staged["Q8_0"][1] <= mosaic[1]:
            mosaic = None
        else:
            del staged["Q8_0"]
    reasons.append(f"GPU tests: loop_stages {'passed' if stages_ok else 'not passed'}, "
                   f"mgpu {'passed' if mgpu_ok else 'not passed'}")
    env = []
    if staged:
        env.append("JDS41_LOOP_STAGES=" + ",".join(f"{q}={s}" for q, (s, _) in sorted(staged.items())))
    if mosaic:
        env.append("JDS41_MOSAIC_Q8=1")
    return env, reasons


def _text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("tests")
    a = ap.parse_args()
    # a part the call's time cut short may have left no file: nothing measured, nothing earned
    rows = [json.loads(line) for line in _text(a.rows).splitlines() if line.strip()]
    tests = _text(a.tests)
    env, reasons = pick(rows, tests)
    print("\n".join(reasons))
    print(" ".join(env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
