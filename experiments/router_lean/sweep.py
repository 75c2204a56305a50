"""Router-lean sweep (issue #11 item 1): for each lean margin, what the lean costs in quality and what it buys in
tier traffic, on one engine (the margin is a parameter leaf, so the whole sweep compiles once).

    python experiments/router_lean/sweep.py MODEL.gguf --profile lucebox --margins 0,0.01,0.02,0.05,0.1 \
        [--texts heldout.txt | --random-tokens 512] [--generate 256] --out sweep.jsonl [--table sweep.md]

Per margin (margin 0 is the unbiased reference, bit for bit):
- quality, teacher-forced over the evaluation tokens: mean KL(unbiased || leaned) of the next-token distribution,
  top-1 agreement, bits per token of the actual next tokens (and bits per byte when the tokens come from text);
- top-k agreement of the routing (1 - swaps / selections), counted by the step itself;
- greedy agreement: tokens of `--generate`-token greedy continuations equal to the unbiased ones, position by
  position, and the length of the common prefix;
- speed side: the share of selections and expert bytes per token each tier served, and the roofline tok/s of those
  bytes (experiments/bench_decode.py's bandwidths; the GPU box measures tok/s, this script on the CPU does not).
- with `--draft DRAFT.gguf` (or `self`): draft acceptance, the DSpark drafter's greedy acceptance rate and tokens per
  verify step on `--draft-prompts` held-out prompts (code, unless --kind says otherwise) of `--draft-prompt-len`
  tokens for `--draft-tokens` new tokens, and whether the drafted tokens equal plain greedy decode's under the same
  margin (they must, at every margin): draft.py.
The live guard is off here (floor 0): the sweep measures the margins themselves. `--prompts 0` skips the greedy
continuations (`--max-sequences 1` keeps the teacher-forced part small), for a run that is mostly about drafting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import BW, _commit, _machine, emit, full_model_bytes, static_bytes  # noqa: E402  (sibling script)
from draft import draft_prompts, greedy_continuation, measure_draft  # noqa: E402  (this folder: --draft)
from heldout import read_texts  # noqa: E402
from report import plot, table  # noqa: E402  (this folder's report: one table and plot for one or many sweeps)

from jds41.engine import Engine  # noqa: E402
from jds41.tiers.experts import with_lean_margin  # noqa: E402
from jds41.tiers.profiles import load_profile  # noqa: E402


def sweep_profile(name: str, max_margin: float, workdir: str) -> str:
    """The profile with the lean compiled in (its margin is set per point) and the guard off."""
    doc = load_profile(name).to_json()
    doc["name"] = f"{doc['name']}-lean-sweep"
    doc["router_lean"] = {"enabled": True, "margin": max_margin, "agreement_floor": 0.0, "check_every": 1 << 30}
    path = os.path.join(workdir, f"{doc['name']}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    return path


def full_size_traffic(arch: str = "deepseek41", quant: str = "ds4-q2") -> dict:
    """Per-token bytes of the FULL model of `arch` in `quant` that do not depend on placement: the dense weights
    the GPU reads (embedding: one row), one routed expert, selections per token, Engram row bytes."""
    from jds41.checkpoints import presets
    from jds41.checkpoints.schema import model_tensors
    from jds41.checkpoints.synth import choose_types, tensor_nbytes

    cfg = presets.preset(arch, "full")
    b = full_model_bytes(arch, quant)
    types, _ = choose_types(cfg, quant)
    embd = tensor_nbytes(model_tensors(cfg)["token_embd.weight"].shape, types["token_embd.weight"])
    engram = len(cfg.engram.layer_ids) * cfg.engram.n_buckets * cfg.engram.row_bytes if cfg.engram else 0
    return {"arch": arch, "quant": quant, "dense": b["dense"] + b["shared"] - embd + embd // cfg.vocab_size,
            "expert": b["expert"], "selections": cfg.n_experts_used * cfg.n_layers, "engram": engram}


def projected_roofline(share: dict, full: dict) -> float:
    """Roofline tok/s of the full model when its selections fall on the tiers in the measured shares (every
    selected expert is read from HBM once it is there; host and SSD ones cross PCIe, SSD ones are read from disk;
    no slot-cache hits counted, so the SSD term is an upper bound on traffic)."""
    sel = full["selections"] * full["expert"]
    hbm = full["dense"] + sel
    pcie = sel * (share["host"] + share["ssd"]) + full["engram"]
    ssd = sel * share["ssd"]
    return 1.0 / max(hbm / BW["hbm"], pcie / BW["pcie"], ssd / BW["ssd"])


FULL = full_size_traffic()


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _snapshot(tiers) -> dict:
    return {"lookups": tiers.lookups.copy(), "bytes": tiers.bytes.copy(), "tokens": tiers.tokens,
            "swaps": tiers.lean_swaps}


def evaluate_margin(engine, margin: float, sequences: list[list[int]], prompts: list[list[int]], n_gen: int,
                    reference: dict | None, text_bytes: int | None) -> dict:
    engine.params = with_lean_margin(engine.params, margin)
    tiers = engine.tiers
    before = _snapshot(tiers)
    logps, nll_bits = [], 0.0
    for seq in sequences:
        lp = _log_softmax(engine.session().feed(seq[:-1], all_logits=True))
        logps.append(lp)
        nll_bits += float(-lp[np.arange(len(seq) - 1), seq[1:]].sum() / np.log(2))
    after = _snapshot(tiers)
    gens = [greedy_continuation(engine, p, n_gen) for p in prompts]
    tok = max(after["tokens"] - before["tokens"], 1)
    lk = after["lookups"] - before["lookups"]
    per_tier = (after["bytes"] - before["bytes"]) / tok
    dense, engram_bytes = static_bytes(engine)
    hbm = dense + per_tier.sum()
    pcie = per_tier[1] + per_tier[2] + engram_bytes
    ssd = per_tier[2]  # upper bound: every SSD-tier selection read from the SSD (no slot-cache hits counted)
    roofline = 1.0 / max(hbm / BW["hbm"], pcie / BW["pcie"], ssd / BW["ssd"])
    n_tok = sum(len(s) - 1 for s in sequences)
    selections = tok * engine.cfg.n_experts_used * tiers.n_scored_layers
    row = {"margin": margin, "topk_agreement": round(1 - (after["swaps"] - before["swaps"]) / max(selections, 1), 6),
           "bits_per_token": round(nll_bits / n_tok, 5),
           "tier_share": {t: round(float(lk[i] / max(lk.sum(), 1)), 4) for i, t in enumerate(("hbm", "host", "ssd"))},
           "expert_bytes_per_token": {t: int(per_tier[i]) for i, t in enumerate(("hbm", "host", "ssd"))},
           "roofline_tok_s": round(roofline, 2)}
    row["full_size_roofline_tok_s"] = round(projected_roofline(row["tier_share"], FULL), 2)
    if text_bytes:
        row["bits_per_byte"] = round(nll_bits / text_bytes, 5)
    row["_logps"], row["_gens"] = logps, gens
    if reference is not None:
        kl = [float((np.exp(a) * (a - b)).sum(-1).mean()) for a, b in zip(reference["_logps"], logps)]
        top1 = np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(reference["_logps"], logps)]))
        same = [np.asarray(a[:min(len(a), len(b))]) == np.asarray(b[:min(len(a), len(b))])
                for a, b in zip(reference["_gens"], gens)]
        prefix = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
        if same:  # none with --prompts 0
            row.update({"greedy_agreement": round(float(np.mean(np.concatenate(same))), 5),
                        "greedy_common_prefix_mean": round(float(np.mean(prefix)), 2)})
        row.update({"kl_nats": round(float(np.mean(kl)), 7), "top1_agreement": round(float(top1), 5),
                    "bits_per_token_delta_pct": round(100 * (row["bits_per_token"] / reference["bits_per_token"] - 1),
                                                      4),
                    "roofline_speedup": round(roofline / reference["roofline_tok_s"], 4),
                    "full_size_speedup": round(row["full_size_roofline_tok_s"] / reference["full_size_roofline_tok_s"],
                                               4)})
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--profile", default="lucebox")
    ap.add_argument("--usage", default=None, help="usage.json to place by (default: the profile's source)")
    ap.add_argument("--margins", default="0,0.01,0.02,0.05,0.1")
    ap.add_argument("--texts", default=None, help="evaluation text, one document per line (needs a tokenizer)")
    ap.add_argument("--kind", default=None, help="with JSON Lines texts: only documents of this `kind` (code, prose)")
    ap.add_argument("--max-docs", type=int, default=None, help="with --texts: the first N documents")
    ap.add_argument("--max-sequences", type=int, default=None, help="score at most this many sequences")
    ap.add_argument("--random-tokens", type=int, default=256, help="without --texts: this many random token ids")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per teacher-forced sequence")
    ap.add_argument("--generate", type=int, default=64, help="greedy tokens per continuation")
    ap.add_argument("--prompts", type=int, default=2, help="greedy continuations (first tokens of sequences)")
    ap.add_argument("--draft", default=None, help="draft GGUF (or 'self'): measure draft acceptance per margin")
    ap.add_argument("--draft-prompts", type=int, default=3, help="with --draft: prompts (held-out, as bench_draft)")
    ap.add_argument("--draft-prompt-len", type=int, default=128, help="with --draft: tokens per prompt")
    ap.add_argument("--draft-tokens", type=int, default=48, help="with --draft: new tokens per prompt")
    ap.add_argument("--workdir", default="/tmp/jds41-lean-sweep")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    margins = [float(m) for m in a.margins.split(",")]
    if margins[0] != 0.0:
        margins = [0.0, *margins]  # the unbiased reference comes first
    ctx = max(a.seq_len + a.generate, a.draft_prompt_len + a.draft_tokens if a.draft else 0) + 64
    engine = Engine.open(a.model, max_ctx=ctx, profile=sweep_profile(a.profile, max(margins), a.workdir),
                         usage=a.usage)
    text_bytes = None
    if a.texts:
        docs = read_texts(a.texts, a.kind)[:a.max_docs]
        ids = [t for d in docs for t in engine.tokenizer.encode(d)]
    else:
        ids = [int(t) for t in np.random.default_rng(0).integers(0, engine.vocab_size, a.random_tokens)]
    sequences = [ids[i:i + a.seq_len + 1] for i in range(0, len(ids) - a.seq_len, a.seq_len)] or [ids]
    sequences = sequences[:a.max_sequences]
    if a.texts and engine.tokenizer is not None:
        text_bytes = sum(len(engine.tokenizer.decode(s[1:]).encode()) for s in sequences)
    prompts = [s[:16] for s in sequences[:a.prompts]]
    common = {"bench": "router_lean_sweep", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv),
              "model": os.path.basename(a.model), "profile": a.profile, "kind": a.kind,
              "full_size_model": {k: v for k, v in FULL.items()},
              "tokens_scored": sum(len(s) - 1 for s in sequences), "generate": a.generate}
    drafter, d_prompts, d_ref = None, [], None
    if a.draft:
        from jds41.speculative import DSparkDrafter

        drafter = DSparkDrafter.open(engine, a.draft)
        d_prompts = draft_prompts(engine, a.texts, a.kind, a.draft_prompts, a.draft_prompt_len)
        common.update({"draft": os.path.basename(a.draft), "draft_prompts": len(d_prompts),
                       "draft_prompt_len": a.draft_prompt_len, "draft_new_tokens": a.draft_tokens,
                       "draft_block_size": drafter.block_size})
    rows, ref = [], None
    for m in margins:  # each row is written when measured: a run cut short by a time limit keeps its points
        row = evaluate_margin(engine, m, sequences, prompts, a.generate, ref, text_bytes)
        ref = ref or row
        if drafter is not None:  # same engine, placement and fixed margin
            row.update(measure_draft(engine, drafter, m, d_prompts, a.draft_tokens, d_ref))
            d_ref = d_ref or row
        rows.append({**common, **{k: v for k, v in row.items() if not k.startswith("_")}})
        emit(rows[-1], a.out)
    out = rows
    series = {(a.profile, a.kind or "tokens"): out}
    if a.table:
        with open(a.table, "w") as fh:
            fh.write(table(series))
    if a.plot and not plot(series, a.plot):
        print("matplotlib is not installed: no plot written", file=sys.stderr)
    engine.tiers.close()
    return out


if __name__ == "__main__":
    main()
