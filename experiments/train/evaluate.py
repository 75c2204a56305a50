"""Bits per byte of a trained model on the held-out set, reproducible on a CPU with the jds41 engine.

    python -m experiments.train.evaluate checkpoints/code-deepseek41-small-00001-of-00004.gguf \
        checkpoints/code-deepseek41-small-heldout.jsonl.xz --max-bytes 6000 [--complete 3]

Definition (the GPU run and this CLI use the same code for it):
- documents: the held-out JSONL (kind "code" / "prose", source, text) in file order; `--max-bytes` keeps the
  first documents of each kind up to that many UTF-8 bytes (data.subset);
- tokens: `[bos] + encode(text)` with the GGUF's own tokenizer (`jds41.tokenizer`, special tokens not parsed);
- chunks: chunk i feeds ids[i*T : i*T + T] from a fresh state and predicts ids[i*T + 1 : i*T + T + 1], T = the
  training sequence length, so every text token is predicted exactly once;
- bits per byte = sum of -log2 p(target) over all predicted tokens / UTF-8 bytes of the texts.
On the GPU the chunks run through the training forward with the exported (quantized, then decoded) weights in
f32 at "highest" matmul precision; here through `Engine` token by token. Expert-usage skew is the share of the
routed selections taken by the top 10% of experts of each layer.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import re
import sys
import time

import numpy as np

from experiments.train.data import subset


def read_heldout(path: str) -> list[dict]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_heldout(path: str, docs: list[dict]) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def doc_ids(tokenizer, text: str) -> list[int]:
    """[bos] + ids of the text with the model file's tokenizer (jds41.tokenizer.Tokenizer)."""
    return [tokenizer.bos_id] + tokenizer.encode(text, add_bos=False, parse_special=False)


def chunks(ids: list[int], T: int) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) pairs covering every token after the first exactly once."""
    out = []
    for s in range(0, len(ids) - 1, T):
        piece = ids[s:s + T + 1]
        out.append((piece[:-1], piece[1:]))
    return out


def skew(counts_E: np.ndarray, top_share: float = 0.1) -> float:
    """Share of selections taken by the top `top_share` of experts (by count)."""
    c = np.sort(np.asarray(counts_E, np.float64))[::-1]
    k = max(1, math.ceil(top_share * len(c)))
    return float(c[:k].sum() / max(c.sum(), 1e-12))


def bpb_summary(nll_nats: float, n_tokens: int, n_bytes: int) -> dict:
    bits = nll_nats / math.log(2)
    return {"bits_per_byte": bits / max(n_bytes, 1), "loss_per_token": nll_nats / max(n_tokens, 1),
            "tokens": n_tokens, "bytes": n_bytes}


# ---- GPU / training-forward evaluation -------------------------------------------------------------------------


class ForwardRunner:
    """The training forward at a fixed [batch, T] shape in f32 ("highest" matmul precision), parameters as
    arguments so it can be compiled from shapes alone (run.py compiles it while training runs)."""

    def __init__(self, cfg, batch: int, T: int):
        import jax
        import jax.numpy as jnp

        from experiments.train.forward import forward

        self.cfg, self.batch, self.T = cfg, batch, T

        def run(params, buffers, tokens, ids, mask, targets):
            with jax.default_matmul_precision("highest"):
                logits, aux = forward(cfg, params, buffers, tokens, ids, dtype=jnp.float32, block=64,
                                      count_mask=mask)
                logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * mask)
            return nll, aux["counts"], jnp.argmax(logits, axis=-1).astype(jnp.int32)

        self._jit = jax.jit(run)
        self._compiled = None

    def compile(self, params, buffers) -> None:
        """Compile for these parameter shapes (arrays or ShapeDtypeStructs)."""
        import jax
        import jax.numpy as jnp

        sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        e = self.cfg.engram
        n_eng = len(e.layer_ids) if e else 1
        nb = e.n_buckets if e else 1
        shape = (self.batch, self.T)
        self._compiled = self._jit.lower(
            jax.tree.map(sds, params), jax.tree.map(sds, buffers), jax.ShapeDtypeStruct(shape, jnp.int32),
            jax.ShapeDtypeStruct((*shape, n_eng, nb), jnp.int32), jax.ShapeDtypeStruct(shape, jnp.float32),
            jax.ShapeDtypeStruct(shape, jnp.int32)).compile()

    def __call__(self, params, buffers, tokens, ids, mask, targets):
        """(summed NLL of the masked targets, expert counts [n_layers, E] of masked positions, argmax [B, T])."""
        fn = self._compiled or self._jit
        return fn(params, buffers, tokens, ids, mask, targets)


def forward_eval(runner: ForwardRunner, params, buffers, hasher, tokenizer, docs: list[dict]) -> dict:
    """Per kind: bits per byte and per-layer expert counts, through the training forward."""
    import jax
    import jax.numpy as jnp

    from experiments.train.forward import engram_ids_batch

    params = jax.tree.map(jnp.asarray, params)
    buffers = jax.tree.map(jnp.asarray, buffers)
    B, T = runner.batch, runner.T
    out = {}
    for kind in sorted({d["kind"] for d in docs}):
        pairs, n_bytes = [], 0
        for d in docs:
            if d["kind"] == kind:
                pairs += chunks(doc_ids(tokenizer, d["text"]), T)
                n_bytes += len(d["text"].encode("utf-8"))
        nll, n_tok, counts = 0.0, 0, None
        for i in range(0, len(pairs), B):
            tok = np.zeros((B, T), np.int32)
            tgt = np.zeros((B, T), np.int32)
            mask = np.zeros((B, T), np.float32)
            for j, (inp, t) in enumerate(pairs[i:i + B]):
                tok[j, :len(inp)], tgt[j, :len(t)], mask[j, :len(t)] = inp, t, 1.0
            batch_nll, c, _ = runner(params, buffers, jnp.asarray(tok), jnp.asarray(engram_ids_batch(hasher, tok)),
                                     jnp.asarray(mask), jnp.asarray(tgt))
            nll += float(batch_nll)
            n_tok += int(mask.sum())
            counts = np.asarray(c) if counts is None else counts + np.asarray(c)
        out[kind] = {**bpb_summary(nll, n_tok, n_bytes), "docs": sum(d["kind"] == kind for d in docs),
                     "expert_skew_top10pct": [round(skew(c), 4) for c in counts],
                     "expert_counts": counts.astype(np.int64).tolist()}
    return out


def function_prompts(docs: list[dict], n: int, body_chars: int = 160) -> list[dict]:
    """The first `n` top-level functions with a docstring in the held-out code: prompt = source up to and
    including the docstring; reference = the next `body_chars` characters of the real body."""
    pat = re.compile(r'^def \w+\(.*?\).*?:\n(    [rRbBuU]?""".*?"""\n)', re.S | re.M)
    out = []
    for d in docs:
        if d["kind"] != "code":
            continue
        for m in pat.finditer(d["text"]):
            if m.end() - m.start() > 1200:
                continue
            out.append({"source": d["source"], "prompt": m.group(0),
                        "reference": d["text"][m.end():m.end() + body_chars]})
            break
        if len(out) >= n:
            break
    return out


def forward_greedy(runner: ForwardRunner, params, buffers, hasher, prompts: list[list[int]], n_new: int
                   ) -> list[list[int]]:
    """Greedy continuations of up to `runner.batch` prompts at once through the training forward (the whole
    prefix is recomputed for each new token; rows are independent, so batching does not change them)."""
    import jax
    import jax.numpy as jnp

    from experiments.train.forward import engram_ids_batch

    params = jax.tree.map(jnp.asarray, params)
    buffers = jax.tree.map(jnp.asarray, buffers)
    B, T = runner.batch, runner.T
    rows = [list(p) for p in prompts[:B]]
    out: list[list[int]] = [[] for _ in rows]
    for _ in range(n_new):
        tok = np.zeros((B, T), np.int32)
        for j, r in enumerate(rows):
            tok[j, :min(len(r), T)] = r[:T]
        zeros = jnp.zeros((B, T), jnp.int32)
        _, _, best = runner(params, buffers, jnp.asarray(tok), jnp.asarray(engram_ids_batch(hasher, tok)),
                            zeros.astype(jnp.float32), zeros)
        best = np.asarray(best)
        for j, r in enumerate(rows):
            if len(r) < T:
                nxt = int(best[j, len(r) - 1])
                r.append(nxt)
                out[j].append(nxt)
    return out


# ---- CPU / engine evaluation -----------------------------------------------------------------------------------


def engine_eval(engine, docs: list[dict], T: int, log=None) -> dict:
    """Per kind bits per byte through `jds41.engine` (a fresh session per chunk, all logits)."""
    out = {}
    for kind in sorted({d["kind"] for d in docs}):
        nll, n_tok, n_bytes = 0.0, 0, 0
        for d in docs:
            if d["kind"] != kind:
                continue
            n_bytes += len(d["text"].encode("utf-8"))
            for inp, tgt in chunks(doc_ids(engine.tokenizer, d["text"]), T):
                logits = engine.session().feed(inp, all_logits=True).astype(np.float64)
                m = logits.max(axis=-1, keepdims=True)
                logp = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
                nll -= float(logp[np.arange(len(tgt)), tgt].sum())
                n_tok += len(tgt)
            if log:
                log(f"{kind}: {d['source']} done, {n_tok} tokens")
        out[kind] = {**bpb_summary(nll, n_tok, n_bytes), "docs": sum(d["kind"] == kind for d in docs)}
    return out


def _forward_file_eval(path: str, tokenizer, docs: list[dict], batch: int, T: int) -> dict:
    """`forward_eval` on a GGUF's decoded weights (what the GPU run evaluates right after export)."""
    from experiments.train.frozen import decoded_trees, token_map
    from jds41.checkpoints import open_model
    from jds41.layers.engram_rows import EngramHasher

    model = open_model(path)
    params, buffers = decoded_trees(model)
    hasher = EngramHasher(model.config.engram, token_map(model))
    res = forward_eval(ForwardRunner(model.config, batch, T), params, buffers, hasher, tokenizer, docs)
    return {k: {kk: vv for kk, vv in v.items() if kk != "expert_counts"} for k, v in res.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.train.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="the GGUF (any shard of a split set)")
    ap.add_argument("heldout", help="the held-out .jsonl.xz")
    ap.add_argument("--max-bytes", type=int, default=6000, help="per kind; 0 = the whole set")
    ap.add_argument("--seq-len", type=int, default=None, help="chunk length (default: the file's training length)")
    ap.add_argument("--complete", type=int, default=0, help="also show greedy completions of N held-out functions")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--backend", default="engine", choices=("engine", "forward"),
                    help="engine: token by token through jds41.engine, the shipped path (about 50 tokens/s on a "
                         "2-core CPU); forward: the training forward on the file's decoded weights, --batch chunks "
                         "per call, also the per-layer expert skew (the whole set in about 22 minutes there)")
    ap.add_argument("--batch", type=int, default=8, help="chunks per forward call (--backend forward)")
    a = ap.parse_args(argv)
    from jds41.engine import Engine, SamplingParams

    t0 = time.time()
    engine = Engine.open(a.model, max_ctx=4096)
    T = a.seq_len or int(engine.gguf.metadata.get("jds41.train.seq_len", 1024))
    docs = subset(read_heldout(a.heldout), a.max_bytes or None)
    if a.backend == "forward":
        evaluation = _forward_file_eval(a.model, engine.tokenizer, docs, a.batch, T)
    else:
        evaluation = engine_eval(engine, docs, T, log=lambda s: print(s, file=sys.stderr))
    result = {"model": a.model, "heldout": a.heldout, "max_bytes": a.max_bytes, "seq_len": T, "backend": a.backend,
              "eval": evaluation}
    if a.complete:
        comps = []
        for fp in function_prompts(read_heldout(a.heldout), a.complete):
            prompt = doc_ids(engine.tokenizer, fp["prompt"])
            new = list(engine.session().generate(prompt, a.new_tokens, SamplingParams(temperature=0.0)))
            comps.append({**fp, "completion": engine.tokenizer.decode(new)})
        result["completions"] = comps
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
