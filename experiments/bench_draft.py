"""DSpark drafting against plain greedy decode, per tier profile (issue #6, item 4): acceptance, tokens per verify
step, decode tok/s of both and the net speedup, plus whether the tokens are identical (they must be).

For each profile (`none` = every weight resident, no tier machinery; or a shipped profile name / JSON path) the
model is opened once; each mode is warmed up (compiles) on a short run, then timed on `--tokens` new tokens for
every prompt:
- `plain`:  Session.generate (the reference, one jitted step per token); its row also times the plain device loop
  (decode_loop.greedy_generate) as `device_loop_tok_s`;
- `dspark`: SpeculativeSession with the DSpark drafter (`--draft self` or a draft file), greedy drafting as one
  device loop (jds41/speculative_loop.py): the real acceptance, and `speedup_vs_device_loop`, the number that says
  whether drafting pays;
- `dspark-host`: the same drafter through the host-orchestrated reference (step_loop=True: propose, verify,
  accept, rollback and inject as separate dispatches per verify step); `device_loop_speedup` = dspark / this;
- `oracle-right` / `oracle-wrong`: drafts replayed from the plain run (all accepted / none accepted), in the device
  loop, with the features injected into the DSpark drafter's state as in `dspark` (the draft pass itself is not
  run). They bound the speedup: full acceptance, and the pure verification cost under offload (every block
  rejected). With synthetic weights only these two mean anything; acceptance needs the trained model.
Every drafting mode runs once per `--verify` choice (default `auto`; `--verify token-major,layer-major` compares
both): the row's `verify` is the resolved one, and a layer-major row carries `speedup_vs_token_major` and
`same_draft_stats_as_token_major` against the token-major row of its mode (same profile). Layer-major verify
moves each host / SSD expert a block needs once instead of once per position (speculative.verify_block).
`--decode-widths 1,5` repeats everything with the engine decoding at each row width (jds41/block_step.py): at width
W > 1 plain decode runs the W-row batched pass and every verify block (block size W - 1) is one batched pass
(`verify` "batched"), drafting being exact against plain decode AT THAT WIDTH; rows carry `decode_width`.
Under a profile the draft tokens' hash-layer experts are prefetched before each verify (tiers.prefetch_tokens, in
the Engram rows' host call) and their Engram rows are hashed and read ahead of the pass.

Prints one JSON line per (profile, mode) and appends each to $OUT/bench_draft.jsonl as it is made, when OUT is
set. CPU timings check the code path only: they are not speed figures (experiments/README.md).

GPU: python experiments/bench_draft.py MODEL.gguf --draft DRAFT.gguf --profiles none,all-hbm,lucebox,h200 \
         --tokens 256 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit  # noqa: E402  (sibling script)
from heldout import text_prompts  # noqa: E402

from jds41.decode_loop import greedy_generate  # noqa: E402
from jds41.engine import Engine  # noqa: E402
from jds41.speculative import VERIFY_MODES, DSparkDrafter, SpeculativeSession, resolve_verify  # noqa: E402
from jds41.speculative_loop import ForcedDrafter  # noqa: E402

MODES = ("plain", "dspark", "dspark-host", "oracle-right", "oracle-wrong")


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(16, vocab, length)] for _ in range(n)]


def draft_summary(stats: list[dict], tokens: int) -> dict:
    """Acceptance over runs: `stats` holds each run's DraftStats.to_dict(), `tokens` the tokens they generated after
    their first one (the prompt's argmax, which no verify step made). Also used by router_lean/draft.py."""
    steps = sum(x["verify_steps"] for x in stats)
    drafted = sum(x["drafted"] for x in stats)
    accepted = sum(x["accepted"] for x in stats)
    return {"verify_steps": steps, "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_step": round(tokens / steps, 4) if steps else None}


def _timed(session, prompt: list[int], n: int) -> tuple[list[int], float]:
    """(tokens, decode seconds): from the first generated token (the prompt's last logits) to the last one."""
    out, t_first = [], None
    for t in session.generate(prompt, n):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(t)
    return out, time.perf_counter() - t_first


def _device_loop_tok_s(engine, prompts: list[list[int]], n: int) -> float:
    def run(prompt):
        s = engine.session()
        first = int(np.argmax(s.feed(prompt)))
        t0 = time.perf_counter()
        out = greedy_generate(s, first, n)  # `first` included: len(out) - 1 decode steps, as _timed counts
        return len(out) - 1, time.perf_counter() - t0

    run(prompts[0])  # warm-up: compiles
    done = [run(p) for p in prompts]
    return round(sum(k for k, _ in done) / sum(t for _, t in done), 3)


def bench_profile(args, profile: str | None, width: int = 1) -> list[dict]:
    engine = Engine.open(args.model, max_ctx=args.ctx, profile=profile, decode_width=width)
    drafter = DSparkDrafter.open(engine, args.draft)
    prompts = (text_prompts(engine.tokenizer, args.texts, args.prompts, args.prompt_len) if args.texts
               else _prompts(engine.vocab_size, args.prompts, args.prompt_len, args.seed))
    plain_out: list[list[int]] = []
    mode_stats: dict[tuple, list[dict]] = {}  # per (mode, verify), each prompt's draft statistics
    results = []
    # every drafting mode once per --verify choice, resolved for this profile (auto: layer-major when tiered)
    # (at a decode width > 1 every verify is the one batched pass the width implies)
    runs = [(m, None if m == "plain" else "batched" if width > 1 else resolve_verify(v, engine.params))
            for m in args.modes for v in (args.verify if m != "plain" else [None])]
    for mode, verify in dict.fromkeys(runs):  # an auto that resolves like an explicit choice runs once
        def session(i, mode=mode, verify=verify):
            if mode == "plain":
                return engine.session()
            drafter.reset()
            if mode in ("dspark", "dspark-host"):
                return SpeculativeSession(engine, drafter, step_loop=mode == "dspark-host",
                                          verify="auto" if verify == "batched" else verify)
            stream = prompts[i] + plain_out[i]
            return SpeculativeSession(engine, ForcedDrafter(engine, stream, mode == "oracle-right", drafter.block_size,
                                                            drafter.feature_layers, inner=drafter),
                                      verify="auto" if verify == "batched" else verify)

        if mode != "plain" and not plain_out:
            raise SystemExit("modes must start with plain (the reference)")
        # warm-up: compiles (the device loops compile per max_new, so it generates as many tokens as the timed runs)
        _timed(session(0), prompts[0], args.tokens)
        tokens, seconds, stats = 0, 0.0, []
        identical = True
        for i, prompt in enumerate(prompts):
            s = session(i)
            out, sec = _timed(s, prompt, args.tokens)
            if mode == "plain":
                plain_out.append(out)
            else:
                identical &= out == plain_out[i]
                stats.append(s.stats.to_dict())
            tokens += len(out) - 1
            seconds += sec
        mode_stats[(mode, verify)] = stats
        row = {"bench": "bench_draft", "profile": profile or "none", "decode_width": width, "mode": mode,
               "tokens": tokens, "decode_tok_s": round(tokens / seconds, 3) if seconds > 0 else None}
        if mode != "plain":
            row["verify"] = verify
            row.update(identical_to_plain=identical, **draft_summary(stats, tokens), block_size=drafter.block_size)
            plain_row = results[0]
            if plain_row["decode_tok_s"] and row["decode_tok_s"]:
                row["speedup_vs_plain"] = round(row["decode_tok_s"] / plain_row["decode_tok_s"], 4)
        if mode == "plain":  # the fastest plain path too: greedy decode as one device loop (no host round trips)
            row["device_loop_tok_s"] = _device_loop_tok_s(engine, prompts, args.tokens)
        elif results[0].get("device_loop_tok_s") and row["decode_tok_s"]:
            row["speedup_vs_device_loop"] = round(row["decode_tok_s"] / results[0]["device_loop_tok_s"], 4)
        if mode == "dspark-host":  # what moving the drafting loop onto the device bought
            device = next((r for r in results if r["mode"] == "dspark" and r["verify"] == verify), None)
            if device is not None and device["decode_tok_s"] and row["decode_tok_s"]:
                row["device_loop_speedup"] = round(device["decode_tok_s"] / row["decode_tok_s"], 4)
            if device is not None:  # the two paths must draft and accept exactly the same tokens
                row["same_draft_stats_as_device_loop"] = mode_stats[("dspark", verify)] == stats
        if verify == "layer-major":  # what verifying layer by layer bought (same drafts, same tokens)
            tm = next((r for r in results if r["mode"] == mode and r.get("verify") == "token-major"), None)
            if tm is not None and tm["decode_tok_s"] and row["decode_tok_s"]:
                row["speedup_vs_token_major"] = round(row["decode_tok_s"] / tm["decode_tok_s"], 4)
            if tm is not None:
                row["same_draft_stats_as_token_major"] = mode_stats[(mode, "token-major")] == stats
        if engine.tiers is not None:
            row["tiers"] = engine.tiers.stats()
        results.append(row)
        args.emit(row)
    if engine.tiers is not None:
        engine.tiers.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--draft", default="self", help="draft GGUF, or 'self' for the model's own mtp.* stages")
    ap.add_argument("--profiles", default="none,all-hbm,lucebox,h200", help="comma separated; 'none' = resident")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma separated, plain first ({', '.join(MODES)})")
    ap.add_argument("--verify", default="auto", help="comma separated verify modes, each drafting mode runs once "
                    f"per mode ({', '.join(VERIFY_MODES)}; auto = layer-major when the profile tiers the experts)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--texts", default=None, help="prompts from this held-out text (JSON Lines: code documents) "
                    "instead of random ids: acceptance needs real text and a trained model")
    ap.add_argument("--decode-widths", default="1", help="comma separated engine decode widths (1 = the one-token "
                    "step; W > 1 = the W-row batched pass, for a drafter of block size W - 1)")
    args = ap.parse_args(argv)
    args.widths = [int(w) for w in args.decode_widths.split(",") if w]
    if not args.widths or min(args.widths) < 1:
        ap.error("--decode-widths: positive integers")
    args.modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in args.modes) or args.modes[0] != "plain":
        ap.error(f"--modes: plain first, then any of {', '.join(MODES[1:])}")
    args.verify = [v for v in args.verify.split(",") if v]
    if not args.verify or any(v not in VERIFY_MODES for v in args.verify):
        ap.error(f"--verify: any of {', '.join(VERIFY_MODES)}")
    import jax

    meta = {"bench": "bench_draft", "meta": True, "commit": _commit(), "machine": platform.node(),
            "devices": [str(d) for d in jax.devices()], "command": " ".join([sys.executable, *sys.argv])}
    out = os.environ.get("OUT")
    path = os.path.join(out, "bench_draft.jsonl") if out else None
    if path:
        open(path, "w").close()

    def emit(row: dict) -> None:  # each line as soon as it exists: a run stopped by a time limit keeps its rows
        print(json.dumps(row), flush=True)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    args.emit = emit
    emit(meta)
    for p in args.profiles.split(","):
        for width in args.widths:
            bench_profile(args, None if p in ("", "none") else p, width)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
