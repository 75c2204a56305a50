"""Where a DSpark verify step's time goes (issue #6; issue #5 item 4's "timed variants"): each part of the drafting
loop's iteration (jds41/speculative_loop.py) timed alone, on the device, beside the whole loop.

A jax.profiler trace of the device loops poisons the CUDA context on the H200 (CUDA_ERROR_LAUNCH_FAILED, cf.
jax-ml/jax#40260), so every part runs instead as its own jitted `lax.fori_loop` of n iterations whose carry
threads the part's output into its next input (nothing loop-invariant for XLA to hoist); a part's time is the
difference of the loop's wall time at two n over the difference of n (dispatch and sync cancel out), best of 3:
- `step`: one plain decode step at the engine's decode width (block_step.step_at_width: the W-row pass and the
  rollback to one position), the unit plain decode pays per token;
- `verify`: verify_block over a W-row block (the session's verify mode) + greedy argmax + rollback to 2 positions;
- `propose`: the drafter's block pass (dspark.propose, Markov head included);
- `inject`: the drafter's feature injection of one verify block (dspark.inject);
- `engram_rows`: the loop's host call that hashes and reads a block's Engram rows (models with Engram only);
- `loop_verify_step`: the real device loop (speculative_generate) on a held-out or random prompt, its wall time
  over its verify steps; `loop_plain_step`: the plain device loop (decode_loop.greedy_generate) per token.
`unexplained` = loop_verify_step - (propose + engram_rows + verify + inject): the loop's own bookkeeping and
what fusing the parts into one program adds or saves.

One JSON line per profile (printed; appended to --out). CPU timings check the code path only.

GPU: python experiments/bench_draft_parts.py MODEL.gguf --draft DRAFT.gguf --profiles none,lucebox --decode-width 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit  # noqa: E402  (sibling script)
from heldout import text_prompts  # noqa: E402

from jds41.block_step import step_at_width  # noqa: E402
from jds41.decode_loop import _history, greedy_generate  # noqa: E402
from jds41.engine import Engine  # noqa: E402
from jds41.engram_host_call import step_rows_fn  # noqa: E402
from jds41.speculative import DSparkDrafter, SpeculativeSession, rollback, verify_block  # noqa: E402
from jds41.speculative_loop import speculative_generate  # noqa: E402


def time_part(body, carry, n_small: int, n_big: int, repeats: int = 3) -> float:
    """Seconds per iteration of `body(i, carry) -> carry` on the device (see the module docstring)."""
    run = jax.jit(lambda c, n: jax.lax.fori_loop(0, n, body, c))

    def wall(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(carry, jnp.int32(n)))
            best = min(best, time.perf_counter() - t0)
        return best

    wall(n_small)  # compiles
    return max(wall(n_big) - wall(n_small), 0.0) / (n_big - n_small)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def bench_parts(args, profile: str | None) -> dict:
    engine = Engine.open(args.model, max_ctx=args.ctx, profile=profile, decode_width=args.decode_width)
    drafter = DSparkDrafter.open(engine, args.draft)
    prompt = (text_prompts(engine.tokenizer, args.texts, 1, args.prompt_len)[0] if args.texts
              else [int(t) for t in np.random.default_rng(args.seed).integers(16, engine.vocab_size, args.prompt_len)])
    session = SpeculativeSession(engine, drafter)
    first = int(np.argmax(session.feed(prompt)))
    plan, params, trace = session.plan, engine.params, engine.tiers is not None
    spec, dparams = drafter.device_spec(), drafter.device_params()
    fl, how, k, V = tuple(spec.feature_layers), session.verify_mode, spec.block_size, engine.vocab_size
    W = k + 1
    state0, dstate0, pos0 = session.state, drafter.state, jnp.int32(len(session.tokens))
    block0 = [first] + [(first + i) % V for i in range(1, W)]
    rows_W = session._engram_rows(block0)  # fixed Engram rows of a block (the host call is timed on its own)
    rows_1 = None if rows_W is None else rows_W[0]
    feats = verify_block(plan, params, jax.tree.map(jnp.copy, state0), jnp.asarray(block0, jnp.int32), rows_W,
                         trace, fl, how)[-1]
    n1, n2 = args.iters

    def step(i, c):
        st, tok = c
        logits, st, *_ = step_at_width(plan, params, st, tok, rows_1, trace, fl)
        return st, jnp.argmax(logits).astype(jnp.int32)

    def verify(i, c):
        st, last = c
        block = (last + jnp.arange(W, dtype=jnp.int32)) % V
        logits, st, undo, small, *_ = verify_block(plan, params, st, block, rows_W, trace, fl, how)
        targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return rollback(plan, st, undo, small, jnp.int32(2)), targets[1]

    def propose(i, last):
        return spec.propose(dparams, dstate0, last, pos0 + 2 * i)[-1].astype(jnp.int32)

    def inject(i, c):
        dst, pos = c
        return spec.inject(dparams, dst, feats, pos, jnp.int32(2)), pos + 2

    tok0 = jnp.int32(first)
    parts = {"step": time_part(step, (state0, tok0), n1, n2),
             "verify": time_part(verify, (state0, tok0), n1, n2),
             "propose": time_part(propose, tok0, n1, n2),
             "inject": time_part(inject, (dstate0, pos0), n1, n2)}
    if engine.engram is not None:
        rows_fn, (_, hist, n_hist) = step_rows_fn(engine), _history(session)  # the loops' own host call

        def engram(i, c):
            last, acc = c
            block = (last + jnp.arange(W, dtype=jnp.int32)) % V
            r = rows_fn(block, hist, n_hist)
            return (last + 1) % V, acc + r[0, 0, 0, 0].astype(jnp.int32)

        parts["engram_rows"] = time_part(engram, (tok0, jnp.int32(0)), n1, n2)

    # the whole loops, on the same prompt (warm-up compiles, then timed)
    def loop_run(spec_loop: bool) -> tuple[float, int]:
        drafter.reset()
        s = SpeculativeSession(engine, drafter) if spec_loop else engine.session()
        f = int(np.argmax(s.feed(prompt)))
        t0 = time.perf_counter()
        out = speculative_generate(s, drafter, f, args.tokens) if spec_loop else greedy_generate(s, f, args.tokens)
        sec = time.perf_counter() - t0
        return sec, (s.stats.steps + s.stats.plain_steps) if spec_loop else len(out) - 1

    loops = {}
    for name, spec_loop in (("loop_plain_step", False), ("loop_verify_step", True)):
        loop_run(spec_loop)
        sec, steps = min(loop_run(spec_loop) for _ in range(2))
        loops[name] = sec / steps
    explained = sum(parts[p] for p in ("propose", "engram_rows", "verify", "inject") if p in parts)
    row = {"bench": "bench_draft_parts", "profile": profile or "none", "decode_width": args.decode_width,
           "verify": how, "block_size": k, "iters": list(args.iters), "tokens": args.tokens,
           **{f"{p}_ms": _ms(t) for p, t in parts.items()}, **{f"{p}_ms": _ms(t) for p, t in loops.items()},
           "unexplained_ms": _ms(loops["loop_verify_step"] - explained)}
    if engine.tiers is not None:
        engine.tiers.close()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--draft", default="self", help="draft GGUF, or 'self' for the model's own mtp.* stages")
    ap.add_argument("--profiles", default="none", help="comma separated; 'none' = resident")
    ap.add_argument("--decode-width", type=int, default=1, help="the engine's decode width (block size + 1, or 1)")
    ap.add_argument("--iters", default="8,40", help="the two loop lengths whose difference times a part")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens of each whole-loop run")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--texts", default=None, help="the prompt from this held-out text (JSON Lines) instead of ids")
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    args = ap.parse_args(argv)
    args.iters = tuple(int(x) for x in args.iters.split(","))
    if len(args.iters) != 2 or not 0 < args.iters[0] < args.iters[1]:
        ap.error("--iters: two loop lengths, the first smaller")
    meta = {"bench": "bench_draft_parts", "meta": True, "commit": _commit(), "machine": platform.node(),
            "devices": [str(d) for d in jax.devices()], "command": " ".join([sys.executable, *sys.argv])}
    rows = [meta] + [bench_parts(args, None if p in ("", "none") else p) for p in args.profiles.split(",")]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
