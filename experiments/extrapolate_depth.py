"""The full-depth decode speed extrapolated from bench_decode rows at several depths, beside its roofline.

Issue #5 asks for the resident decode speed of the full model (V4.1: 40 layers; V4-Flash: 43), which the 64 GiB
disk of the GPU box cannot hold; bench_decode measures N-layer files of the same shapes. One layer of a decode step
costs about the same at any depth (same shapes, same kernels), and the head, the embedding and the loop's round
trips are paid once a token, so the time a token is a line in the depth: ms(L) = fixed + L * per_layer, and so are
the bytes a token reads (hence the roofline). This script fits both lines by least squares to rows of one call
(the same commit, machine, arch, quant, profile and numerics) at two or more depths and evaluates them at the full
depth: an extrapolation, and every output row says so ("method") with the fit's residual beside it. A group with
one depth is reported as not extrapolated (a single point cannot separate the fixed cost from the per-layer one).

    python experiments/extrapolate_depth.py results/bench_decode_depth_v41_h200.jsonl [...] [--layers 40] [--out F]

One JSON line per group. Bandwidths and the roofline rule are bench_decode's (DESIGN.md §8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import BW, Bytes, emit  # noqa: E402

GROUP_KEYS = ("commit", "machine", "arch", "quant", "profile", "numerics")


def full_layers(arch: str) -> int:
    """The full model's depth (the "full" preset bench_decode cuts N layers from)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jds41.checkpoints.presets import preset

    return preset(arch, "full").n_layers


def _line(depths: np.ndarray, values: np.ndarray) -> tuple[float, float, float]:
    """Least-squares (intercept, slope, largest |residual|) of values over depths."""
    slope, intercept = np.polyfit(depths, values, 1)
    residual = values - (intercept + slope * depths)
    return float(intercept), float(slope), float(np.abs(residual).max())


def extrapolate(rows: list[dict], layers: int | None = None) -> dict:
    """One group's rows (bench_decode "decode" rows of one call) -> the fit and its value at `layers` (default: the
    arch's full depth)."""
    first = rows[0]
    target = layers or full_layers(first["arch"])
    by_depth = defaultdict(list)
    for r in rows:
        by_depth[int(r["layers"])].append(r)
    out = {"bench": "extrapolate_depth", **{k: first.get(k) for k in GROUP_KEYS},
           "depths": sorted(by_depth), "rows": len(rows), "target_layers": target,
           "measured": {str(d): [r["decode_tok_s"] for r in rs] for d, rs in sorted(by_depth.items())}}
    if len(by_depth) < 2:
        return {**out, "method": "not extrapolated: one depth cannot separate fixed and per-layer costs"}
    # every row is a point (repeats at a depth weigh in as measured), the ms a token and the bytes alike
    depths = np.array([float(r["layers"]) for r in rows])
    fixed_ms, layer_ms, ms_residual = _line(depths, np.array([r["decode_ms_per_token"] for r in rows]))
    per_kind = {k: _line(depths, np.array([float(r["bytes_per_token"][k]) for r in rows])) for k in BW}
    at = Bytes(**{k: max(0.0, a + b * target) for k, (a, b, _) in per_kind.items()})
    ms = fixed_ms + layer_ms * target
    best, worst = at.roofline()
    fit = {**out, "method": f"extrapolated: least-squares lines over depths {sorted(by_depth)} evaluated at {target}",
           "fixed_ms": round(fixed_ms, 4), "per_layer_ms": round(layer_ms, 4),
           "fit_max_residual_ms": round(ms_residual, 4),
           "per_layer_bytes": {k: round(b) for k, (_, b, _) in per_kind.items()},
           "extrapolated_ms_per_token": round(ms, 3), "extrapolated_tok_s": round(1e3 / ms, 1),
           "extrapolated_bytes_per_token": {k: round(getattr(at, k)) for k in BW},
           "roofline_tok_s": round(best, 1), "roofline_no_overlap_tok_s": round(worst, 1),
           "ratio": round(1e3 / ms / best, 4)}
    measured_bw = [r["device_hbm_read_bps"] for r in rows if r.get("device_hbm_read_bps")]
    if len(measured_bw) == len(rows):  # every row measured its GPU (bench_decode.device_hbm_read_bps): the fastest
        hbm_bps = max(measured_bw)  # measurement gives the highest roofline, so the ratio is not flattered
        device_best = at.roofline({**BW, "hbm": hbm_bps})[0]
        fit.update({"device_hbm_read_bps": hbm_bps, "roofline_device_hbm_tok_s": round(device_best, 1),
                    "ratio_device_hbm": round(1e3 / ms / device_best, 4)})
    return fit


def groups(rows: list[dict]) -> list[list[dict]]:
    """bench_decode's decode rows, grouped by GROUP_KEYS, in first-seen order."""
    found: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("bench") == "decode" and "decode_ms_per_token" in r:
            found.setdefault(tuple(json.dumps(r.get(k)) for k in GROUP_KEYS), []).append(r)
    return list(found.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench_decode JSON-lines files")
    ap.add_argument("--layers", type=int, default=None, help="the depth to extrapolate to (default: the full model's)")
    ap.add_argument("--out", default=None, help="append the rows here (also printed)")
    a = ap.parse_args(argv)
    rows = []
    for path in a.files:
        with open(path) as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    found = groups(rows)
    if not found:
        ap.error("no bench_decode decode rows in those files")
    for group in found:
        emit({**extrapolate(group, a.layers), "command": " ".join(sys.argv)}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
