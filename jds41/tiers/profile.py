"""`python -m jds41.tiers.profile MODEL.gguf --prompts FILE --out usage.json`: measure expert and Engram usage.

Runs each prompt of a calibration corpus through the model and counts, per layer, which routed experts the
router (or, on hash layers, tid2eid) selected for every prompt position, plus the Engram rows every position
reads; writes a `jds41.tiers.usage.Usage` JSON that `python -m jds41.tiers.placement` turns into a placement.

Prompts file: one prompt per line, or JSON Lines of {"text": ...} (chosen by the first non-empty line). Each
prompt is tokenized as `Engine.tokenizer.encode` does (BOS per the file), cut to --max-tokens-per-prompt, and
read from a fresh state: usage reflects prompt processing of independent requests.

The model runs through `traced_prefill`, the engine's prefill scan with `model.step(..., trace_routing=True)`:
the same per-token arithmetic, with the expert ids it computes anyway returned beside the state. The last chunk
of a prompt is padded to the chunk length so one program serves every length; padded positions come after the
real ones, cannot change their routing (the model is causal), and are not counted.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jds41 import model as M
from jds41.errors import Jds41Error
from jds41.tiers.usage import ENGRAM_TOP_N, ModelIdentity, Usage, UsageCounter

CHUNK = 32  # positions per traced prefill call (the engine's PREFILL_CHUNK): one compiled program
DEFAULT_MAX_TOKENS = 4096


@functools.partial(jax.jit, static_argnums=0, static_argnames="with_logits", donate_argnums=2)
def traced_prefill(plan: M.ModelPlan, params: dict, state: dict, tokens: jax.Array, engram_rows=None,
                   with_logits: bool = False):
    """`model.prefill` that also returns the expert ids: (logits [T, V] or None, state, ids int32 [T, n_layers, K]).

    Without `with_logits` the output head is dead code and XLA drops it: profiling does not need next-token logits.
    """
    def body(st, xs):
        tok, rows = xs
        logits, st, routing = M.step(plan, params, st, tok, rows, trace_routing=True)
        return st, (logits if with_logits else None, routing["experts"])

    state, (logits, idx) = jax.lax.scan(body, state, (tokens, engram_rows))
    return logits, state, idx


def read_prompts(path: str) -> list[str]:
    """Prompts of a text file (one per line) or of JSON Lines with a "text" field; blank lines are skipped."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [(i, ln.rstrip("\n")) for i, ln in enumerate(fh, 1) if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise Jds41Error(f"cannot read prompts file {path}: {e}") from None
    if not lines:
        raise Jds41Error(f"prompts file {path} has no prompts")
    if not _is_jsonl_record(lines[0][1]):
        return [ln for _, ln in lines]
    prompts = []
    for i, ln in lines:
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise Jds41Error(f"{path}:{i}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise Jds41Error(f"{path}:{i}: expected an object with a string field \"text\"")
        prompts.append(rec["text"])
    return prompts


def _is_jsonl_record(line: str) -> bool:
    if not line.lstrip().startswith("{"):
        return False
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(rec, dict) and "text" in rec


def profile_prompts(engine, prompts_ids: list[list[int]], counter: UsageCounter, progress=None) -> None:
    """Add the routing and Engram rows of every prompt (token ids) to `counter`."""
    plan, params = engine.plan, engine.params
    for ids in prompts_ids:
        if engine.engram is not None:
            counter.add_engram(engine.engram[0].row_ids_seq(ids))
        done: list[int] = []
        state = M.init_state(plan)
        for start in range(0, len(ids), CHUNK):
            real = ids[start:start + CHUNK]
            chunk = real + [real[-1]] * (CHUNK - len(real))
            rows = engine.engram_rows(chunk, done)
            _, state, idx = traced_prefill(plan, params, state, jnp.asarray(chunk, jnp.int32),
                                           None if rows is None else jnp.asarray(rows))
            counter.add_routing(np.asarray(idx)[:len(real)])
            done += real
            if progress is not None:
                progress.update(len(real))


def run(model_path: str, prompts_path: str, max_tokens: int = DEFAULT_MAX_TOKENS, top_n: int = ENGRAM_TOP_N,
        progress: bool = True) -> Usage:
    from tqdm import tqdm

    from jds41.engine import Engine

    if max_tokens < 1:
        raise Jds41Error(f"--max-tokens-per-prompt must be >= 1, got {max_tokens}")
    prompts = read_prompts(prompts_path)
    engine = Engine.open(model_path, max_ctx=-(-max_tokens // CHUNK) * CHUNK)
    cfg = engine.cfg
    # Padded chunks must fit the state the engine sized for its context.
    limit = min(max_tokens, engine.max_ctx // CHUNK * CHUNK)
    if limit < 1:
        raise Jds41Error(f"{model_path}: context {engine.max_ctx} is shorter than one chunk of {CHUNK} tokens")
    if engine.tokenizer is None:
        raise Jds41Error(f"{model_path} has no tokenizer: cannot read text prompts")
    encoded = [engine.tokenizer.encode(p) for p in prompts]
    prompts_ids = [ids[:limit] for ids in encoded if ids]
    e = cfg.engram
    counter = UsageCounter(ModelIdentity.of(engine.gguf), [i for i in range(cfg.n_layers) if cfg.is_hash_layer(i)],
                           e.layer_ids if e else (), e.rows if e else (), top_n)
    with tqdm(total=sum(map(len, prompts_ids)), unit="tok", desc="profiling", disable=not progress,
              file=sys.stderr) as bar:
        profile_prompts(engine, prompts_ids, counter, bar)
    with open(prompts_path, "rb") as fh:
        corpus_sha = hashlib.sha256(fh.read()).hexdigest()
    corpus = {"file": os.path.basename(prompts_path), "sha256": corpus_sha, "max_tokens_per_prompt": limit,
              "truncated_prompts": sum(len(ids) > limit for ids in encoded), "engram_top_n": top_n}
    return counter.finish(prompts=len(prompts_ids), corpus=corpus)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jds41.tiers.profile", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file (any shard of a split file)")
    ap.add_argument("--prompts", required=True, help="one prompt per line, or JSON Lines of {\"text\": ...}")
    ap.add_argument("--out", required=True, help="usage JSON to write")
    ap.add_argument("--max-tokens-per-prompt", type=int, default=DEFAULT_MAX_TOKENS,
                    help=f"cut each prompt to this many tokens (default {DEFAULT_MAX_TOKENS})")
    ap.add_argument("--engram-top", type=int, default=ENGRAM_TOP_N,
                    help=f"Engram rows kept with exact counts per layer (default {ENGRAM_TOP_N})")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        usage = run(args.model, args.prompts, args.max_tokens_per_prompt, args.engram_top, not args.quiet)
        usage.save(args.out)
    except (Jds41Error, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{usage.prompts} prompts, {usage.tokens} tokens -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
