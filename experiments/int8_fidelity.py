"""What the "int8" activation numerics (jds41/quant/int8_act.py) costs in fidelity: the same tokens through an engine
with f32 activations (numerics "jds41", the reference) and one with int8 ones, compared logit by logit.

    python experiments/int8_fidelity.py checkpoints/code-deepseek41-small-00001-of-00004.gguf \
        --texts checkpoints/code-deepseek41-small-heldout.jsonl.xz [--steps] [--out FILE]
    python experiments/int8_fidelity.py /tmp/jds41-bench/deepseek41-full-4L-ds4-q2.gguf --random 256 --steps

Reported per run (one JSON line): top-1 agreement of the two engines' next-token predictions, the mean KL
divergence of the int8 distribution from the f32 one, the largest logit difference relative to the position's
largest logit, and, with real text, each engine's next-token cross-entropy on it.

The numerics rounds the routed experts' formats' products (IQ2_XXS, Q2_K: V4.1's experts as ds4 ships them;
MXFP4: V4-Flash's, and the shipped small model's, since the forty-first session with an integer product of its
own). `--round-formats Q8_0` rounds the activation of the dense Q8_0 products too (as JDS41_INT8_Q8_0=1 does).
`--steps` feeds one token a step (decode's products: the integer product, on the GPU the dp4a kernel) instead of
one prompt pass (prefill's products, the same rounding through `dot`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _round_more_formats(names: str) -> None:
    """Make the int8 numerics round the activation of `names`' products too (through `qtensor._act`); the integer
    product stays the routed formats' own."""
    from gguf import GGMLQuantizationType as T

    from jds41.quant import int8_act, qtensor

    extra = frozenset(T[n] for n in names.split(",") if n)
    qtensor.INT8_TYPES = int8_act.INT8_TYPES | extra
    qtensor._int8 = lambda w: w.act_round == "int8" and w.qtype in int8_act.INT8_TYPES


def _logits(engine, tokens: list[int], steps: bool) -> np.ndarray:
    s = engine.session()
    if not steps:
        return np.asarray(s.feed(tokens, all_logits=True), np.float64)
    return np.stack([np.asarray(s.feed([t]), np.float64) for t in tokens])


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray, tokens: list[int]) -> dict:
    """Per-position metrics of `got` against `ref` ([T, V] logits for `tokens`)."""
    lp, lq = _log_softmax(ref), _log_softmax(got)
    nxt = np.asarray(tokens[1:])
    return {"positions": len(ref), "top1": (ref.argmax(-1) == got.argmax(-1)).tolist(),
            "kl": (np.exp(lp) * (lp - lq)).sum(-1).tolist(),
            "rel": (np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).tolist(),
            "ce_ref": (-lp[np.arange(len(nxt)), nxt]).tolist(), "ce_int8": (-lq[np.arange(len(nxt)), nxt]).tolist()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--texts", default=None, help="held-out documents (experiments/heldout.py formats)")
    ap.add_argument("--kind", default="code")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--length", type=int, default=256, help="tokens a document")
    ap.add_argument("--random", type=int, default=0, help="instead of texts: this many random token ids")
    ap.add_argument("--steps", action="store_true", help="one token a step (decode) instead of a prompt pass")
    ap.add_argument("--round-formats", default="", help="also round these formats' products (module docstring)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax
    from bench_decode import emit

    from jds41.engine import Engine
    from jds41.quant import qtensor

    if a.round_formats:
        _round_more_formats(a.round_formats)
    ref_engine = Engine.open(a.model, max_ctx=a.length + a.random + 8)
    int8_engine = Engine.open(a.model, max_ctx=a.length + a.random + 8, numerics="int8")
    if a.random:
        docs = [[int(t) for t in np.random.default_rng(7).integers(8, ref_engine.vocab_size, a.random)]]
    else:
        from heldout import text_prompts

        docs = text_prompts(ref_engine.tokenizer, a.texts, a.docs, a.length, a.kind)
    t0 = time.perf_counter()
    per = [compare(_logits(ref_engine, d, a.steps), _logits(int8_engine, d, a.steps), d) for d in docs]
    pool = {k: np.concatenate([np.asarray(p[k], np.float64) for p in per]) for k in ("top1", "kl", "rel", "ce_ref",
                                                                                     "ce_int8")}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    row = {"bench": "int8_fidelity", "commit": os.environ.get("JDS41_COMMIT", commit),
           "machine": f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind} jax {jax.__version__}",
           "command": " ".join(sys.argv), "model": os.path.basename(a.model),
           "tokens": "random" if a.random else f"{len(docs)} held-out {a.kind} documents of {a.length}",
           "products": "decode steps" if a.steps else "prompt pass", "also_rounded": a.round_formats or None,
           "int8_types": sorted(t.name for t in qtensor.INT8_TYPES),
           "positions": int(pool["top1"].size), "top1_agreement": round(float(pool["top1"].mean()), 5),
           "kl_mean": float(pool["kl"].mean()), "kl_max": float(pool["kl"].max()),
           "rel_logit_diff_mean": float(pool["rel"].mean()), "rel_logit_diff_max": float(pool["rel"].max()),
           "seconds": round(time.perf_counter() - t0, 1)}
    if not a.random:
        row["ce_f32_act"], row["ce_int8_act"] = float(pool["ce_ref"].mean()), float(pool["ce_int8"].mean())
    emit(row, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
