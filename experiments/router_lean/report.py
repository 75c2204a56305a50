"""Router-lean report (issue #11 item 2): the sweeps' JSON lines as one markdown table and one plot.

    python experiments/router_lean/report.py results/lean_*.jsonl --table lean.md --plot lean.png

Series = (profile, text kind). The plot has two panels against the full-size roofline speed-up (the measured tier
shares applied to V4.1-Flash ds4-q2, sweep.projected_roofline): routing top-k agreement, and the change in bits
per token of the held-out text. The Pareto front of each series (points no other point beats on both speed and
agreement) is drawn as a line; dominated points are hollow.

Rows of one series at one margin from several files (a sweep with `--draft` beside the sweeps of the other measures)
make one row: the one with the most tokens scored (the first among equals) keeps its numbers, and the others add
the `draft_*` fields it lacks. The table's draft columns show "-" where a row has no draft measurement.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(paths: list[str]) -> dict[tuple[str, str], list[dict]]:
    """Rows grouped by (profile, kind), each group sorted by margin, duplicate margins merged into one row (the
    most tokens scored, first file among equals; draft_* fields from any of them)."""
    series: dict[tuple[str, str], dict[float, dict]] = defaultdict(dict)
    for path in paths:
        with open(path) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    group = series[(r["profile"], r.get("kind") or "tokens")]
                    old = group.get(r["margin"])
                    if old is not None and r.get("tokens_scored", 0) > old.get("tokens_scored", 0):
                        old, r = r, old
                    if old is not None:
                        r = {**old, **{k: v for k, v in r.items() if k.startswith("draft") and k not in old}}
                    group[r["margin"]] = r
    return {k: [v[m] for m in sorted(v)] for k, v in sorted(series.items())}


def pareto(rows: list[dict]) -> list[dict]:
    """Rows not dominated in (full-size speed-up, top-k agreement), by speed-up."""
    pts = sorted(rows, key=lambda r: (-r.get("full_size_speedup", 1.0), -r["topk_agreement"]))
    front, best = [], -1.0
    for r in pts:
        if r["topk_agreement"] > best:
            front.append(r)
            best = r["topk_agreement"]
    return sorted(front, key=lambda r: r.get("full_size_speedup", 1.0))


def table(series: dict[tuple[str, str], list[dict]]) -> str:
    head = ("| profile | text | margin | top-k agreement | KL (nats) | top-1 agreement | greedy agreement | "
            "bits/token (change) | bits/byte | HBM / host / SSD share | full-size roofline tok/s (x) | "
            "draft acceptance | draft tokens/step |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for (profile, kind), rows in series.items():
        for r in rows:
            sh, bpb = r["tier_share"], r.get("bits_per_byte", float("nan"))
            greedy = r.get("greedy_agreement", 1 if r["margin"] == 0 else None)  # none: run with --prompts 0
            acc = r.get("draft_acceptance_rate")
            if acc is not None and r.get("draft_identical_to_plain") is False:
                acc = f"{acc:.4f} (NOT plain's tokens)"
            lines.append(f"| {profile} | {kind} | {r['margin']} | {r['topk_agreement']:.4f} | "
                         f"{r.get('kl_nats', 0):.2e} | {r.get('top1_agreement', 1):.4f} | "
                         f"{_num(greedy)} | {r['bits_per_token']:.4f} "
                         f"({r.get('bits_per_token_delta_pct', 0):+.2f}%) | {bpb:.4f} | "
                         f"{sh['hbm']:.3f} / {sh['host']:.3f} / {sh['ssd']:.3f} | "
                         f"{r['full_size_roofline_tok_s']:.2f} ({r.get('full_size_speedup', 1):.3f}) | "
                         f"{_num(acc)} | {_num(r.get('draft_tokens_per_step'), '.3f')} |")
    return head + "\n".join(lines) + "\n"


def _num(x, fmt: str = ".4f") -> str:
    """A table cell: "-" for a missing number, text as it is."""
    return "-" if x is None else x if isinstance(x, str) else format(x, fmt)


def plot(series: dict[tuple[str, str], list[dict]], path: str) -> bool:
    """Two panels (agreement, bits-per-token change) against speed-up; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_a, ax_q) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, ((profile, kind), rows) in enumerate(series.items()):
        color = f"C{i}"
        front = {id(r) for r in pareto(rows)}
        x = [r.get("full_size_speedup", 1.0) for r in rows]
        for ax, key in ((ax_a, "topk_agreement"), (ax_q, "bits_per_token_delta_pct")):
            y = [r.get(key, 0.0 if key.endswith("pct") else 1.0) for r in rows]
            ax.scatter(x, y, facecolors=[color if id(r) in front else "none" for r in rows], edgecolors=color)
            for r, xi, yi in zip(rows, x, y):
                ax.annotate(f"{r['margin']:g}", (xi, yi), textcoords="offset points", xytext=(4, 3), fontsize=7)
        fr = pareto(rows)
        ax_a.plot([r.get("full_size_speedup", 1.0) for r in fr], [r["topk_agreement"] for r in fr], color=color,
                  label=f"{profile} / {kind}")
        ax_q.plot(x, [r.get("bits_per_token_delta_pct", 0.0) for r in rows], color=color, alpha=0.5)
    ax_a.axhline(0.99, color="grey", ls=":", lw=1)
    ax_q.axhline(1.0, color="grey", ls=":", lw=1)
    ax_a.set(xlabel="full-size roofline speed-up over unbiased routing", ylabel="top-k agreement",
             title="routing agreement (Pareto front: line)")
    ax_q.set(xlabel="full-size roofline speed-up over unbiased routing", ylabel="bits per token change (%)",
             title="quality cost on held-out text")
    ax_a.legend(fontsize=8)
    for ax in (ax_a, ax_q):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="+", help="JSON lines written by sweep.py")
    ap.add_argument("--table", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    series = load(a.sweeps)
    text = table(series)
    if a.table:
        with open(a.table, "w") as fh:
            fh.write(text)
    else:
        print(text)
    if a.plot and not plot(series, a.plot):
        print("matplotlib is not installed: no plot written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
