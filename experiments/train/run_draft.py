"""Train the DSpark drafter of a trained target model in one command, inside a wall-clock budget, export the draft
file and measure it with the jds41 engine.

    python -m experiments.train.run_draft --model checkpoints/code-deepseek41-small-00001-of-00004.gguf \
        --out $OUT --time-budget-s 300

1. open the target GGUF, decode it into the training forward's float trees (frozen.py: the drafter learns the
   file's features), build the draft config (target keys + 2 stages of 16 experts top-2 for the small model);
2. compile the frozen target's forward (features + logits, no gradient) and the drafter's train step in
   background threads while the data is collected (data.py: the main model's training split, the same held-out
   rules) and tokenized with the GGUF's own tokenizer;
3. train to the deadline minus the reserve (draft_train.py; the step count is planned from the first timed steps);
4. quantize and write the draft file into OUT first (draft_export.py), so an overshooting run still returns it;
5. measure on held-out code with the engine at temperature 0: speculative decoding (SpeculativeSession with
   DSparkDrafter.open on the written file) gives the acceptance rate (accepted drafts / proposed) and tokens per
   verify step; for the first prompts, plain greedy decode (jds41.generate's plain path: feed + the device greedy
   loop) must give bit-identical tokens;
6. write the manifest (data, steps, losses, acceptance, tokens/verify, sha256 of the draft file) after each stage.
Progress: one JSON line per event on stdout, also appended to OUT/draft_log.jsonl. Exit status 1 when any
speculative output differs from plain decode.
`--size tiny` trains a tiny drafter against checkpoints/tiny-deepseek41-q8.gguf on a CPU in a couple of minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import threading
import time

import numpy as np

from experiments.train import data, evaluate, tokenizer
from experiments.train.draft_train import DraftTrainConfig
from experiments.train.run import _sha256
from experiments.train.train import TrainConfig, json_log

TINY_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "tiny-deepseek41-q8.gguf")
_SIZES = {  # stages, experts, top-k (MODEL.md §6), then the training shape
    "small": {"stages": 2, "experts": 16, "top_k": 2, "batch": 16, "seq_len": 1024, "reserve": 110.0,
              "max_train_mb": 30.0, "prompts": 8, "identical": 3, "prompt_tokens": 128, "new_tokens": 128},
    "tiny": {"stages": 2, "experts": 4, "top_k": 2, "batch": 4, "seq_len": 64, "reserve": 60.0, "max_train_mb": 1.0,
             "prompts": 2, "identical": 2, "prompt_tokens": 24, "new_tokens": 32},
}


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.train.run_draft", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the target GGUF (any shard; default for --size tiny: the tiny "
                    "synthetic checkpoint)")
    ap.add_argument("--out", required=True, help="result folder (draft GGUF, manifest, log)")
    ap.add_argument("--size", default="small", choices=tuple(_SIZES))
    ap.add_argument("--time-budget-s", type=float, default=300.0)
    ap.add_argument("--reserve-s", type=float, default=None, help="time kept for export + measurement")
    ap.add_argument("--name", default=None, help="draft file stem (default: the model's stem + '-dspark')")
    ap.add_argument("--heldout", default=None, help="held-out .jsonl.xz (default: the model's, next to it; else "
                    "held-out code from data.py)")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--draft-experts", type=int, default=None)
    ap.add_argument("--draft-top-k", type=int, default=None)
    ap.add_argument("--experts", default="mxfp4", choices=("mxfp4", "q8"), help="storage of the draft experts")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--max-train-mb", type=float, default=None, help="cap on tokenized training text")
    ap.add_argument("--target-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=None, help="held-out code prompts for the acceptance measurement")
    ap.add_argument("--identical", type=int, default=None, help="of them, how many are also decoded plainly and "
                    "compared token for token")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autotune-level", type=int, default=None, help="XLA GPU autotuning level (0 = off)")
    ap.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache folder")
    return ap.parse_args(argv)


def _configs(a) -> tuple[dict, DraftTrainConfig]:
    size = dict(_SIZES[a.size])
    for key in ("stages", "batch", "seq_len", "max_train_mb", "prompts", "identical", "prompt_tokens", "new_tokens"):
        if getattr(a, key) is not None:
            size[key] = getattr(a, key)
    size["experts"] = a.draft_experts or size["experts"]
    size["top_k"] = a.draft_top_k or size["top_k"]
    size["reserve"] = a.reserve_s if a.reserve_s is not None else size["reserve"]
    if a.size == "tiny":
        train = TrainConfig(batch=size["batch"], seq_len=size["seq_len"], peak_lr=3e-3, warmup=5, moe_block=16,
                            remat=False, dtype="float32", seed=a.seed)
    else:
        train = TrainConfig(batch=size["batch"], seq_len=size["seq_len"], peak_lr=1e-3, warmup=50, moe_block=256,
                            remat=False, seed=a.seed)
    if a.lr is not None:
        train = dataclasses.replace(train, peak_lr=a.lr)
    return size, DraftTrainConfig(train=train, target_dtype=a.target_dtype)


def _model_stem(path: str) -> str:
    from jds41.checkpoints.reader import SHARD_NAME

    base = os.path.basename(path)
    m = SHARD_NAME.match(base)
    return m["stem"] if m else (base[:-5] if base.endswith(".gguf") else base)


def measure(model_path: str, draft_path: str, prompts: list[list[int]], n_new: int, n_identical: int, deadline: float,
            log) -> dict:
    """Acceptance over all prompts (speculative, greedy) and token-for-token equality with plain greedy decode for
    the first `n_identical`; stops adding prompts when the next would pass the deadline."""
    from jds41.decode_loop import greedy_generate
    from jds41.engine import Engine
    from jds41.speculative import DraftStats, DSparkDrafter, SpeculativeSession

    t0 = time.time()
    ctx = max(len(p) for p in prompts) + n_new + 16
    engine = Engine.open(model_path, max_ctx=ctx)
    drafter = DSparkDrafter.open(engine, draft_path)
    total = DraftStats()
    per_prompt, identical = [], []
    t_prompt = None
    for i, prompt in enumerate(prompts):
        if t_prompt is not None and time.time() + t_prompt > deadline:
            log({"event": "measure_cut", "prompts_done": i, "reason": "budget"})
            break
        t1 = time.time()
        drafter.reset()
        spec = SpeculativeSession(engine, drafter)
        got = list(spec.generate(prompt, n_new))
        st = spec.stats
        for f in dataclasses.fields(DraftStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(st, f.name))
        row = {"prompt": i, "prompt_tokens": len(prompt), **st.to_dict()}
        if i < n_identical:  # jds41.generate's plain greedy path
            plain = engine.session()
            first = int(np.argmax(plain.feed(prompt)))
            want = greedy_generate(plain, first, n_new)
            row["identical_to_plain"] = got == want
            identical.append(got == want)
            if got != want:
                row["first_difference"] = next(j for j, (x, y) in enumerate(zip(got, want, strict=False)) if x != y)
        per_prompt.append(row)
        log({"event": "measured", **row, "seconds": round(time.time() - t1, 1)})
        # the first prompt's time includes compiling every engine program: half of it bounds the next one
        t_prompt = 0.5 * (time.time() - t1) if t_prompt is None else 1.2 * (time.time() - t1)
    return {**total.to_dict(), "prompts": len(per_prompt), "new_tokens": n_new, "per_prompt": per_prompt,
            "identical_checked": len(identical), "all_identical": all(identical) if identical else None,
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:  # noqa: C901 (one linear pipeline, as run.py)
    a = parse(argv)
    t_start = time.time()
    deadline = t_start + a.time_budget_s
    os.makedirs(a.out, exist_ok=True)
    log = json_log(os.path.join(a.out, "draft_log.jsonl"))
    size, tc = _configs(a)
    model_path = a.model or (TINY_MODEL if a.size == "tiny" else None)
    if model_path is None:
        raise SystemExit("--model is required for --size small")
    if a.autotune_level is not None:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level={a.autotune_level}"
    import jax
    import jax.numpy as jnp

    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log({"event": "start", "devices": [str(d) for d in jax.devices()], "budget_s": a.time_budget_s,
         "reserve_s": size["reserve"], "model": model_path, "draft": {k: size[k] for k in ("stages", "experts",
                                                                                          "top_k")},
         "train_config": dataclasses.asdict(tc)})

    # 1. the frozen target and the draft config
    from experiments.train import draft_train as dt
    from experiments.train.frozen import decoded_trees, draft_config, token_map
    from jds41.checkpoints import open_model
    from jds41.layers.engram_rows import EngramHasher
    from jds41.tokenizer import Tokenizer

    model = open_model(model_path)
    cfg = model.config
    jtok = Tokenizer.from_metadata(model.metadata, model_path)
    tparams, tbuffers = decoded_trees(model)
    hasher = EngramHasher(cfg.engram, token_map(model))
    dcfg = draft_config(cfg, size["stages"], size["experts"], size["top_k"])
    layers = tuple(dcfg.dspark.target_layer_ids)
    tparams = jax.device_put(jax.tree.map(jnp.asarray, tparams))
    tbuffers = jax.device_put(jax.tree.map(jnp.asarray, tbuffers))
    shared = dt.shared_of(tparams)
    dparams, dbuffers = dt.init_draft_params(dcfg, a.seed)
    from experiments.train.params import count_params

    log({"event": "config", "target_layers": list(layers), "block_size": dcfg.dspark.block_size,
         "markov_rank": dcfg.dspark.markov_rank, "noise_token_id": dcfg.dspark.noise_token_id,
         "draft_params": count_params(dparams), "elapsed_s": round(time.time() - t_start, 1)})

    # 2. compile both programs while the data is read
    B, T = tc.train.batch, tc.train.seq_len
    e = cfg.engram
    sds = jax.ShapeDtypeStruct
    compiled: dict = {}

    def compile_target():
        t0 = time.time()
        compiled["target"] = dt.target_fn.lower(
            cfg, layers, tc.target_dtype, tparams, tbuffers, sds((B, T), jnp.int32),
            sds((B, T, len(e.layer_ids), e.n_buckets), jnp.int32)).compile()
        compiled["target_s"] = time.time() - t0

    def compile_step():
        t0 = time.time()
        abstract = jax.eval_shape(lambda p, b: dt.init_state(tc, p, b), dparams, dbuffers)
        shapes = (sds((B, T, len(layers), cfg.dim), jnp.float32), sds((B, T, cfg.vocab_size), jnp.float32))
        shared_sds = jax.tree.map(lambda x: sds(x.shape, x.dtype), shared)
        compiled["step"] = dt.train_step.lower(dcfg, tc, abstract, shared_sds, sds((B, T + 1), jnp.int32), *shapes,
                                               sds((), jnp.float32)).compile()
        compiled["step_s"] = time.time() - t0

    threads = [threading.Thread(target=f) for f in (compile_target, compile_step)]
    for th in threads:
        th.start()
    code = data.collect_code()
    # hash order of the path and a byte cap, as run.py: a spread over packages of the main model's training split
    texts = [t for _, _, t in sorted(code["train"], key=lambda x: hashlib.sha1(x[1].encode()).hexdigest())]
    cap, kept = size["max_train_mb"] * 1e6, []
    for t in texts:
        if cap <= 0:
            break
        kept.append(t)
        cap -= len(t)
    # evaluate.doc_ids' encoding ([bos] + ids, special-token text read as plain text), batched
    stream = tokenizer.encode_stream(jtok._literal_backend, kept, bos_id=jtok.bos_id)
    heldout_path = a.heldout or os.path.join(os.path.dirname(model_path), f"{_model_stem(model_path)}-heldout.jsonl.xz")
    if os.path.exists(heldout_path):
        docs = [d for d in evaluate.read_heldout(heldout_path) if d["kind"] == "code"]
        heldout_src = os.path.basename(heldout_path)
    else:
        docs = data.eval_documents(code["heldout"], [], 400_000, 0)
        heldout_src = "data.py held-out code (eval_documents order)"
    prompts = []
    for d in docs:
        ids = evaluate.doc_ids(jtok, d["text"])
        if len(ids) >= size["prompt_tokens"] + size["new_tokens"]:
            prompts.append(ids[:size["prompt_tokens"]])
        if len(prompts) == size["prompts"]:
            break
    data_info = {"train_files": len(kept), "train_bytes": sum(len(t.encode()) for t in kept),
                 "train_tokens": int(len(stream)), "code_stats": {k: v for k, v in code["stats"].items()
                                                                   if k != "roots"},
                 "held_out_packages": list(data.HELD_OUT_PACKAGES), "eval_source": heldout_src,
                 "eval_prompts": len(prompts), "prompt_tokens": size["prompt_tokens"]}
    del code, texts
    log({"event": "data", **data_info, "elapsed_s": round(time.time() - t_start, 1)})
    for th in threads:
        th.join()
    log({"event": "compiled", "target_compile_s": round(compiled["target_s"], 1),
         "step_compile_s": round(compiled["step_s"], 1), "elapsed_s": round(time.time() - t_start, 1)})

    # 3. train
    state = dt.init_state(tc, dparams, dbuffers)
    state, summary = dt.train_draft(
        dcfg, tc, state, shared, stream, hasher, step_fn=compiled["step"],
        target_call=lambda tok, ids: compiled["target"](tparams, tbuffers, tok, ids),
        deadline=deadline - size["reserve"], max_steps=a.max_steps, plan_after=20 if a.size == "small" else 5,
        log=log)
    hist = summary.pop("history")
    last = hist[-20:]
    final = {k: np.mean(np.asarray([h[k] for h in last], np.float64), axis=0).round(4).tolist()
             for k in ("loss", "kl", "ce", "agree", "bce")}
    log({"event": "trained", **{k: v for k, v in summary.items()}, "final_last20": final,
         "elapsed_s": round(time.time() - t_start, 1)})

    # 4. export
    from experiments.train.draft_export import plan_bytes, quantized_draft, write_draft_gguf

    trained_p = jax.tree.map(np.asarray, state["params"])
    trained_b = jax.tree.map(np.asarray, state["buffers"])
    del state
    name = a.name or f"{_model_stem(model_path)}-dspark"
    stored, types, _, _ = quantized_draft(dcfg, trained_p, trained_b, a.experts)
    extra = {"general.name": (name, "str"), "jds41.train.draft_steps": (summary["steps"], "u32"),
             "jds41.train.seq_len": (T, "u32")}
    draft_path = write_draft_gguf(os.path.join(a.out, f"{name}.gguf"), dcfg, stored, types, model_path, extra)
    files = {os.path.basename(draft_path): {"bytes": os.path.getsize(draft_path), "sha256": _sha256(draft_path)}}
    manifest = {
        "draft": os.path.basename(draft_path), "target": os.path.basename(model_path),
        "target_sha256_first_shard": _sha256(model_path),
        "config": {"stages": size["stages"], "experts": size["experts"], "top_k": size["top_k"],
                   "expert_ff": dcfg.expert_ff, "block_size": dcfg.dspark.block_size,
                   "markov_rank": dcfg.dspark.markov_rank, "target_layer_ids": list(layers),
                   "noise_token_id": dcfg.dspark.noise_token_id, "window": dcfg.window},
        "storage": {"experts": a.experts.upper(), "tensor_bytes": plan_bytes(dcfg, a.experts)},
        "data": data_info,
        "training": {**dataclasses.asdict(tc), **summary, "final_last20": final,
                     "loss_per_step": [round(h["loss"], 4) for h in hist],
                     "agree_per_step": [h["agree"] for h in hist[::max(1, len(hist) // 200)]],
                     "loss": "sum_i w_i [(1-h) KL(target||draft) + h CE + c BCE(conf)], w_i = exp(-i/5)/sum",
                     "agree": "teacher-forced top-1 agreement of draft row i with the target's argmax at p+i"},
        "files": files,
    }
    manifest_path = os.path.join(a.out, f"{name}-manifest.json")

    def write_manifest(stage: str) -> None:
        manifest.update(stage=stage, elapsed_s=round(time.time() - t_start, 1))
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=1)

    write_manifest("exported")
    log({"event": "exported", "files": files, "elapsed_s": round(time.time() - t_start, 1)})

    # 5. measure with the engine
    tparams = tbuffers = shared = None  # the engine opens the target itself: free the training copies
    result = measure(model_path, draft_path, prompts, size["new_tokens"], size["identical"], deadline - 5, log)
    manifest["acceptance"] = {**result, "how": "SpeculativeSession (temperature 0) with DSparkDrafter.open on the "
                              "draft file: acceptance_rate = accepted / drafted, tokens_per_step = emitted / verify "
                              "steps (accepted + 1 each); identical_to_plain compares with feed + greedy_generate"}
    write_manifest("done")
    total = sum(os.path.getsize(os.path.join(a.out, p)) for p in os.listdir(a.out))
    log({"event": "done", "acceptance_rate": result["acceptance_rate"], "tokens_per_step": result["tokens_per_step"],
         "all_identical": result["all_identical"], "files": files, "out_bytes": total,
         "elapsed_s": round(time.time() - t_start, 1)})
    return 0 if result["all_identical"] in (True, None) else 1


if __name__ == "__main__":
    raise SystemExit(main())
