"""`python -m jds41.generate MODEL (-p TEXT | --tokens ID,ID,...) [-n N] ...`: generate from the command line.

Greedy at temperature 0. Prints the text (or the ids, for a file whose tokenizer is `none`) and the speed; `--json`
prints one JSON object instead (prompt ids, generated ids, text, timings); `--logits FILE.npy` saves the logits of
every prompt position followed by one row per decode step ([n_prompt + n_generated - 1, V]: the last generated
token is never fed back). Bad files, bad token ids and over-long prompts end with a one-line message and exit 1.

`--draft DRAFT` drafts with DSpark (DRAFT = a separate draft GGUF, or `self` for the model file's own `mtp.*`
stages) and verifies each block in one target pass: the tokens are exactly those without `--draft`; `--json`
adds "draft" (acceptance rate, tokens per verify step, the verify mode). Greedy only: `--draft` with temperature
> 0 is an error. `--verify` picks how a block is verified: `token-major` (a scan of the decode step), `layer-major`
(layer by layer, each host / SSD expert the block needs moved once), or `auto` (the default: layer-major when a
`--profile` places the experts across tiers); the tokens are the same either way.

`--decode-width W` decodes every position through the W-row batched pass (jds41/block_step.py) instead of the
one-token step: the numerics that a DSpark verify of W rows shares bit for bit, so with `--draft` (block size W-1)
each verify block is ONE batched pass instead of W steps, and the tokens equal those of `--decode-width W` without
`--draft`. (Width 1 and width W are each exact against themselves; they agree to float rounding, not bitwise.)

`--prompt-width R` (R >= 2) reads the prompt in R-row blocks with each group's routed experts computed expert by
expert (ModelPlan.prompt_width, jds41/layers/grouped_experts.py): several times faster prefill, bits that do not
depend on how the prompt is cut, within f32 rounding of decode's arithmetic but not its bits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jds41.compile_cache import enable_compile_cache
from jds41.decode_loop import greedy_generate
from jds41.engine import Engine, SamplingParams
from jds41.errors import Jds41Error
from jds41.numerics import NUMERICS
from jds41.speculative import VERIFY_MODES, DSparkDrafter, SpeculativeSession


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jds41.generate", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file (any shard of a split file)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("--tokens", help="prompt token ids, comma separated")
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default 32)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=None, help="context size (default min(model context, 8192))")
    ap.add_argument("--profile", default=None, help="place experts across HBM / host / SSD by a profile (name or JSON)")
    ap.add_argument("--usage", default=None, help="usage.json from python -m jds41.tiers.profile (placement source)")
    ap.add_argument("--prefill-chunk", type=int, default=4096,
                    help="prompt tokens per layer-major prefill group (default 4096; 0 = token-major only)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR|off",
                    help="keep compiled programs here across runs (default $JAX_COMPILATION_CACHE_DIR, else "
                         "~/.cache/jds41/xla; 'off': compile every run; jds41/compile_cache.py)")
    ap.add_argument("--numerics", default="jds41", choices=sorted(NUMERICS),
                    help="activation numerics (default jds41: f32; int8: the two-bit experts' products read int8 "
                    "activations, faster on the GPU, not the same bits)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--logits", metavar="FILE.npy", help="save the logits of every prompt position and step")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    ap.add_argument("--step-loop", action="store_true",
                    help="greedy decode one jitted step per token (with --draft: one verify step per host iteration; "
                         "the reference paths) instead of one device loop")
    ap.add_argument("--draft", default=None, help="DSpark draft: a draft GGUF, or 'self' for the model's own stages")
    ap.add_argument("--verify", default="auto", choices=VERIFY_MODES,
                    help="with --draft: verify blocks token-major or layer-major (auto: layer-major when a --profile "
                         "tiers the experts)")
    ap.add_argument("--decode-width", type=int, default=1,
                    help="decode through the W-row batched pass (with --draft: W = block size + 1, one-pass verify)")
    ap.add_argument("--prompt-width", type=int, default=0,
                    help="read the prompt in R-row blocks with grouped expert products (R >= 2: faster prefill, "
                         "its own bits for any cut of the prompt; default 0: decode's arithmetic)")
    return ap.parse_args(argv)


def _prompt_ids(args: argparse.Namespace, engine: Engine) -> list[int]:
    tok = engine.tokenizer
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise Jds41Error(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
    if tok is None:
        raise Jds41Error(f"{args.model} has no tokenizer (tokenizer.ggml.model = none): use --tokens")
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


def run(args: argparse.Namespace) -> dict:
    if args.decode_width < 1:
        raise Jds41Error(f"--decode-width must be >= 1, got {args.decode_width}")
    if args.prompt_width < 0 or args.prompt_width == 1:
        raise Jds41Error(f"--prompt-width must be 0 (the decode width) or >= 2, got {args.prompt_width}")
    enable_compile_cache(args.compile_cache)  # before anything compiles
    engine = Engine.open(args.model, max_ctx=args.ctx, profile=args.profile, usage=args.usage, progress=True,
                         prefill_chunk=args.prefill_chunk, decode_width=args.decode_width,
                         prompt_width=args.prompt_width, numerics=args.numerics)
    prompt = _prompt_ids(args, engine)
    if not prompt:
        raise Jds41Error("the prompt is empty")
    tok = engine.tokenizer
    stop = () if args.ignore_eos or tok is None or tok.eos_id is None else (tok.eos_id,)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    logits: list | None = [] if args.logits else None
    session = engine.session()
    if args.draft is not None:
        if args.temperature > 0:
            raise Jds41Error("--draft supports greedy decoding only (temperature 0): speculative sampling is not "
                             "implemented")
        if args.logits:
            raise Jds41Error("--draft does not record per-step logits: drop --logits or --draft")
        # greedy drafting runs as one device loop (jds41/speculative_loop.py); --step-loop: the host-orchestrated path
        session = SpeculativeSession(engine, DSparkDrafter.open(engine, args.draft), step_loop=args.step_loop,
                                     verify=args.verify)
    t0 = time.perf_counter()
    out: list[int] = []
    t_first = None
    stream = tok.stream() if tok is not None and not args.json else None
    if args.draft is None and sampling.temperature <= 0 and logits is None and not args.step_loop:
        # greedy: the whole generation in one device loop (jds41/decode_loop.py), tokens identical to the step loop
        first = int(np.argmax(session.feed(prompt)))
        t_first = time.perf_counter()
        out = greedy_generate(session, first, args.n_predict, stop)
        if stream is not None:
            print("".join(stream.feed(t) for t in out), end="", flush=True)
    else:
        for t in session.generate(prompt, args.n_predict, sampling, stop, logits):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(t)
            if stream is not None:
                print(stream.feed(t), end="", flush=True)
    t_end = time.perf_counter()
    if stream is not None:
        print(stream.flush())
    if args.logits:
        np.save(args.logits, np.stack(logits).astype(np.float32))
    decode_s = t_end - (t_first or t_end)
    return {
        "model": args.model, "prompt_tokens": prompt, "tokens": out,
        "text": tok.decode(out) if tok is not None else None,
        "timings": {"load_s": round(engine.load_seconds, 3), "load": engine.load_stats,
                    "prompt_s": round((t_first or t_end) - t0, 3),
                    "decode_tok_s": round((len(out) - 1) / decode_s, 2) if len(out) > 1 and decode_s > 0 else None},
        "tiers": engine.tiers.stats() if engine.tiers is not None else None,
        **({"draft": {"source": args.draft, "verify": session.verify_mode, **session.stats.to_dict()}}
           if args.draft is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        result = run(args)
    except Jds41Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        if result["text"] is None:
            print(",".join(map(str, result["tokens"])))
        t = result["timings"]
        print(f"[{len(result['prompt_tokens'])} prompt tokens in {t['prompt_s']} s, {len(result['tokens'])} generated,"
              f" {t['decode_tok_s']} tok/s decode (CPU timings are not speed figures)]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
