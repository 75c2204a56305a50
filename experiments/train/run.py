"""The whole pipeline in one command, inside a wall-clock budget: data, tokenizer, training, evaluation, export.

    python -m experiments.train.run --out $OUT --time-budget-s 540

1. collect code (training + held-out) and prose (held-out) from this machine's Python installation (data.py);
2. train the byte-level BPE tokenizer on training files; build the config (MODEL.md §6 small deepseek41, Engram
   tables sized to the byte budget) and refuse to start if the file would not fit;
3. compile the train step in a background thread while the corpus is tokenized;
4. train until the deadline minus the reserve for evaluation and export (train.py), checkpointing to --work;
5. quantize to the storage types, evaluate the decoded (shipped) weights on the held-out code and prose (bits per
   byte, expert skew, greedy completions), write the GGUF split set, the compressed held-out set, the manifest
   (sha256 of every file) and the log into --out.
Progress: one JSON line per event on stdout, also appended to OUT/train_log.jsonl.
`--size tiny --time-budget-s 120` runs the same pipeline on a CPU in minutes (tests and smoke runs).
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

from experiments.train import data, evaluate, export, tokenizer
from experiments.train.model_config import fit_engram
from experiments.train.train import TrainConfig, json_log, load_checkpoint, save_checkpoint, train


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.train.run", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="result folder (GGUF shards, manifest, held-out set, log)")
    ap.add_argument("--work", default="/tmp/jds41-train", help="local folder for checkpoints")
    ap.add_argument("--time-budget-s", type=float, default=540.0)
    ap.add_argument("--reserve-s", type=float, default=None, help="time kept for eval + export (default by size)")
    ap.add_argument("--size", default="small", choices=("small", "tiny"))
    ap.add_argument("--name", default=None, help="file stem (default code-deepseek41-SIZE)")
    ap.add_argument("--vocab", type=int, default=None, help="default 8192 (small) / 512 (tiny)")
    ap.add_argument("--expert-ff", type=int, default=None, help="expert width I (default 64 small, preset tiny)")
    ap.add_argument("--experts", default="mxfp4", choices=("mxfp4", "q8"))
    ap.add_argument("--max-tensor-mib", type=float, default=54.0, help="tensor bytes budget of the GGUF")
    ap.add_argument("--shard-mib", type=float, default=14.5, help="max tensor bytes per shard (0 = one file); the "
                    "fewest shards under it are written, balanced")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--tokenizer-sample-mb", type=float, default=20.0)
    ap.add_argument("--max-train-mb", type=float, default=120.0, help="cap on tokenized training text (0 = all)")
    ap.add_argument("--eval-code-kb", type=int, default=1500)
    ap.add_argument("--eval-prose-kb", type=int, default=600)
    ap.add_argument("--cpu-subset-bytes", type=int, default=6000, help="per kind, the CPU reproduction's subset")
    ap.add_argument("--completions", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ckpt-every", type=int, default=0, help="checkpoint to WORK/ckpt.npz every N steps and at the "
                    "end (0 = never: the GPU box is wiped after each call, so the one-shot run skips the writes)")
    ap.add_argument("--resume", action="store_true", help="continue from WORK/ckpt.npz if present (same lease)")
    ap.add_argument("--plan-train-s", type=float, default=None,
                    help="plan the schedule for this many seconds of training in all, over several calls: a call "
                         "that reaches its deadline first saves WORK/ckpt.npz and stops without exporting; the "
                         "next call, with --resume and the same WORK (an ignored folder of the repository survives "
                         "between calls on a warm device machine), continues and exports at the end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autotune-level", type=int, default=None,
                    help="XLA GPU autotuning level (0 = off): GEMM autotuning is the usual bulk of a long GPU "
                         "compile; the same step compiles in 58 s on 2 CPU cores against 270 s on the H200")
    ap.add_argument("--compile-cache", default=None,
                    help="JAX persistent compilation cache folder: the H200 smoke run spent 270 s compiling the train "
                         "step, so a cache carried into the call (or returned by an earlier one) saves half a run")
    return ap.parse_args(argv)


def _train_config(a) -> TrainConfig:
    if a.size == "tiny":
        base = TrainConfig(batch=4, seq_len=64, peak_lr=3e-3, warmup=5, moe_block=16, remat=False, dtype="float32")
    else:
        base = TrainConfig()
    over = {k: v for k, v in (("batch", a.batch), ("seq_len", a.seq_len), ("peak_lr", a.lr)) if v is not None}
    return dataclasses.replace(base, seed=a.seed, **over)


def main(argv=None) -> int:
    a = parse(argv)
    t_start = time.time()
    deadline = t_start + a.time_budget_s
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    log = json_log(os.path.join(a.out, "train_log.jsonl"))
    tc = _train_config(a)
    name = a.name or f"code-deepseek41-{a.size}"
    reserve = a.reserve_s if a.reserve_s is not None else (120.0 if a.size == "small" else 60.0)
    if a.autotune_level is not None:  # read when the backend starts, which the first jax call below does
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level={a.autotune_level}"
    import jax

    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log({"event": "start", "devices": [str(d) for d in jax.devices()], "budget_s": a.time_budget_s,
         "reserve_s": reserve, "train_config": dataclasses.asdict(tc)})

    # 1. data
    code = data.collect_code()
    prose = data.collect_prose()
    docs = data.eval_documents(code["heldout"], prose, a.eval_code_kb * 1000, a.eval_prose_kb * 1000)
    heldout_path = os.path.join(a.out, f"{name}-heldout.jsonl.xz")
    evaluate.write_heldout(heldout_path, docs)
    log({"event": "data", **code["stats"], "prose_docs": len(prose), "eval_docs": len(docs),
         "heldout_xz_bytes": os.path.getsize(heldout_path), "elapsed_s": round(time.time() - t_start, 1)})

    # 2. tokenizer and config
    # hash order of the path: the --max-train-mb cap then takes a spread over packages, not the first ones
    train_texts = [t for _, _, t in sorted(code["train"], key=lambda x: hashlib.sha1(x[1].encode()).hexdigest())]
    vocab = a.vocab or (8192 if a.size == "small" else 512)
    tok = tokenizer.cached_tokenizer(os.path.join(a.work, "tokenizer.json"), lambda: tokenizer.train_tokenizer(
        train_texts, vocab, int(a.tokenizer_sample_mb * 1e6))) if a.resume or a.plan_train_s else \
        tokenizer.train_tokenizer(train_texts, vocab, int(a.tokenizer_sample_mb * 1e6))
    from jds41.engram_hash import tokenizer_token_map

    token_map, n_classes = tokenizer_token_map(tok)
    expert_ff = a.expert_ff if a.expert_ff is not None else (64 if a.size == "small" else None)
    cfg = fit_engram(a.size, vocab, n_classes, int(a.max_tensor_mib * 2**20), a.experts, expert_ff,
                     max_bucket_start=20000 if a.size == "small" else 64, min_bucket_start=8 if a.size == "tiny"
                     else 500)
    plan = export.plan_bytes(cfg, a.experts)
    from experiments.train.train import flops_per_token

    fpt = flops_per_token(cfg, tc.seq_len)
    log({"event": "flops", "forward_flops_per_token": fpt, "train_flops_per_token": (4 if tc.remat else 3) * fpt,
         "tokens_per_s_at_30pct_of_790_tflops": round(0.3 * 790e12 / ((4 if tc.remat else 3) * fpt))})
    log({"event": "config", "vocab": vocab, "engram_classes": n_classes, "engram_rows": list(cfg.engram.rows),
         "expert_ff": cfg.expert_ff, "planned_bytes": plan, "elapsed_s": round(time.time() - t_start, 1)})

    # 3. compile the step while tokenizing
    from experiments.train.params import balanced_tid2eid, count_params, init_params
    from experiments.train.train import init_state, train_step

    params, buffers = init_params(cfg, a.seed)
    compiled: dict = {}

    def compile_step():
        import jax.numpy as jnp

        t0 = time.time()
        abstract = jax.eval_shape(lambda p, b: init_state(tc, p, b), params, buffers)
        e = cfg.engram
        compiled["step"] = train_step.lower(
            cfg, tc, abstract, jax.ShapeDtypeStruct((tc.batch, tc.seq_len + 1), jnp.int32),
            jax.ShapeDtypeStruct((tc.batch, tc.seq_len, len(e.layer_ids), e.n_buckets), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.float32)).compile()
        compiled["seconds"] = time.time() - t0

    th = threading.Thread(target=compile_step)
    th.start()
    if a.max_train_mb:
        cap, kept = a.max_train_mb * 1e6, []
        for t in train_texts:
            if cap <= 0:
                break
            kept.append(t)
            cap -= len(t)
        train_texts = kept
    stream = tokenizer.encode_stream(tok, train_texts)
    counts = np.bincount(stream, minlength=vocab)
    for layer in range(cfg.n_hash_layers):
        buffers["blocks"][layer]["ffn_gate_tid2eid"] = balanced_tid2eid(counts, cfg.n_experts, cfg.n_experts_used,
                                                                        a.seed * 1000 + layer)
    train_bytes = sum(len(t.encode()) for t in train_texts)
    log({"event": "tokenized", "train_tokens": int(len(stream)), "train_bytes": train_bytes,
         "bytes_per_token": round(train_bytes / max(1, len(stream)), 3), "params": count_params(params),
         "elapsed_s": round(time.time() - t_start, 1)})
    th.join()
    log({"event": "compiled", "compile_s": round(compiled["seconds"], 1), "elapsed_s": round(time.time() - t_start, 1)})

    # 4. train
    from jds41.layers.engram_rows import EngramHasher

    hasher = EngramHasher(cfg.engram, token_map)
    state = init_state(tc, params, buffers)
    ckpt = os.path.join(a.work, "ckpt.npz")
    start_step, total_steps = 0, None
    if a.resume and os.path.exists(ckpt):
        state, start_step, total_steps = load_checkpoint(ckpt, state)
        total_steps = total_steps or None
        log({"event": "resumed", "step": start_step, "total_steps": total_steps})
    runner = evaluate.ForwardRunner(cfg, 16 if a.size == "small" else 4, tc.seq_len)
    eval_compile = threading.Thread(target=runner.compile, args=(params, buffers))
    # CPU work that overlaps the GPU's training, started once the step count is planned (or now, when a resumed
    # run's schedule is already fixed)
    if total_steps is not None:
        eval_compile.start()
    state, summary = train(cfg, tc, state, stream, hasher, max_steps=a.max_steps, deadline=deadline - reserve,
                           ckpt_dir=a.work if a.ckpt_every else None, ckpt_every=a.ckpt_every or 1, log=log,
                           start_step=start_step, total_steps=total_steps, step_fn=compiled["step"],
                           plan_after=20 if a.size == "small" else 5, on_plan=eval_compile.start,
                           plan_s=a.plan_train_s)
    if not eval_compile.is_alive() and eval_compile.ident is None:
        eval_compile.start()  # training ended before the plan (a step cap or a short budget)
    # with --plan-train-s a call that stops before the end of the schedule (or before it was even planned: a
    # long compile) checkpoints instead of exporting; the resumed call plans or continues the same schedule
    unfinished = a.plan_train_s is not None and (summary["total_steps"] is None
                                                 or summary["steps"] < summary["total_steps"])
    if a.ckpt_every or unfinished:
        save_checkpoint(ckpt, state, summary["steps"], summary["total_steps"] or 0)
    if unfinished:
        log({"event": "paused", "steps": summary["steps"], "total_steps": summary["total_steps"],
             "median_step_s": summary["median_step_s"], "final_ce_mean_last20": float(np.mean(summary["losses"][-20:])),
             "next": "call again with --resume and the same --work", "elapsed_s": round(time.time() - t_start, 1)})
        return 0
    log({"event": "trained", **{k: v for k, v in summary.items() if k not in ("losses", "expert_counts")},
         "final_ce_mean_last20": float(np.mean(summary["losses"][-20:])), "elapsed_s": round(time.time() - t_start, 1)})

    # 5. export, evaluate the shipped weights, write everything
    trained_p = jax.tree.map(np.asarray, state["params"])
    trained_b = jax.tree.map(np.asarray, state["buffers"])
    del state
    stored, types, dec_p, dec_b = export.quantized_tensors(cfg, trained_p, trained_b, a.experts)
    from jds41.checkpoints.synth_tokenizer import gguf_fields
    from jds41.tokenizer import Tokenizer

    jtok = Tokenizer.from_metadata({k: v for k, v, _ in gguf_fields(tok)})
    # the file first: whatever happens later in the budget, the trained model is in OUT
    extra = {"general.name": (name, "str"), "jds41.train.seq_len": (tc.seq_len, "u32"),
             "jds41.train.steps": (summary["steps"], "u32"),
             "jds41.train.tokens_seen": (summary["tokens_seen"], "u64")}
    paths = export.write_gguf(os.path.join(a.out, f"{name}.gguf"), cfg, stored, types, tok, token_map, extra,
                              split_max_bytes=export.split_limit(cfg, types, int(a.shard_mib * 2**20))
                              if a.shard_mib else 0)
    del stored
    files = {os.path.basename(p): {"bytes": os.path.getsize(p), "sha256": _sha256(p)} for p in paths + [heldout_path]}
    first = os.path.basename(paths[0])
    manifest = {
        "model": first, "arch": cfg.arch, "config": {"dim": cfg.dim, "layers": cfg.n_layers, "vocab": vocab,
                                                     "experts": cfg.n_experts, "top_k": cfg.n_experts_used,
                                                     "expert_ff": cfg.expert_ff, "engram_rows": list(cfg.engram.rows),
                                                     "compress_ratios": list(cfg.compress_ratios),
                                                     "window": cfg.window, "hash_layers": cfg.n_hash_layers},
        "storage": {"experts": a.experts.upper(), "planned_tensor_bytes": plan},
        "data": {**code["stats"], "prose_docs_found": len(prose),
                 "held_out_packages_configured": list(data.HELD_OUT_PACKAGES), "held_out_file_rule":
                 "sha1('kind/relpath')[:8] mod 100 == 0", "train_tokens": int(len(stream)),
                 "train_bytes": train_bytes, "tokenizer_sample_mb": a.tokenizer_sample_mb},
        "training": {**dataclasses.asdict(tc), **{k: v for k, v in summary.items()
                                                  if k not in ("losses", "expert_counts")},
                     "final_train_ce_last20": float(np.mean(summary["losses"][-20:])),
                     "balance": f"aux-loss-free bias (gamma {tc.bias_gamma:g}) + V3 sequence-wise loss "
                                f"(alpha {tc.balance_alpha:g})",
                     "resumed_from_step": start_step, "plan_train_s": a.plan_train_s},
        "heldout": {"file": os.path.basename(heldout_path), "cpu_subset_max_bytes": a.cpu_subset_bytes,
                    "cpu_reproduce": f"python -m experiments.train.evaluate checkpoints/{first} "
                                     f"checkpoints/{os.path.basename(heldout_path)} --max-bytes {a.cpu_subset_bytes}"},
        "files": files,
    }
    manifest_path = os.path.join(a.out, f"{name}-manifest.json")

    def write_manifest(stage: str) -> None:
        manifest.update(stage=stage, elapsed_s=round(time.time() - t_start, 1))
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=1)

    write_manifest("exported")
    log({"event": "exported", "files": files, "elapsed_s": round(time.time() - t_start, 1)})

    def brief(res: dict, drop=("expert_counts",)) -> dict:
        return {k: {kk: vv for kk, vv in v.items() if kk not in drop} for k, v in res.items()}

    eval_compile.join()
    t_eval = time.time()
    cpu_docs = data.subset(docs, a.cpu_subset_bytes)
    results_subset = evaluate.forward_eval(runner, dec_p, dec_b, hasher, jtok, cpu_docs)
    manifest["heldout"]["gpu_eval_cpu_subset"] = brief(results_subset, ("expert_counts", "expert_skew_top10pct"))
    write_manifest("evaluated-subset")
    # the full set only if it fits what is left (estimated from the subset's time per byte)
    # Each document is cut into rows of T tokens, run `batch` rows per call; the subset fills about one call, so
    # its time per call (not per byte) scales to the whole set.
    sub_rows = sum(r["tokens"] for r in results_subset.values()) / runner.T + len(cpu_docs)
    t_call = (time.time() - t_eval) / max(1.0, np.ceil(sub_rows / runner.batch))
    full_rows = sum(len(d["text"]) for d in docs) / (train_bytes / max(1, len(stream))) / runner.T + len(docs)
    if time.time() + 1.5 * t_call * np.ceil(full_rows / runner.batch) < deadline - 15:
        results = evaluate.forward_eval(runner, dec_p, dec_b, hasher, jtok, docs)
        manifest["heldout"]["gpu_eval_full"] = brief(results)
    else:
        results = results_subset
        manifest["heldout"]["gpu_eval_full"] = "skipped: not enough time left in the budget"
    manifest["expert_skew_top10pct"] = {k: v["expert_skew_top10pct"] for k, v in results.items()}
    write_manifest("evaluated")
    log({"event": "evaluated", **brief(results), "elapsed_s": round(time.time() - t_start, 1)})
    if time.time() < deadline - 10:
        prompts = evaluate.function_prompts(docs, a.completions)
        outs = evaluate.forward_greedy(runner, dec_p, dec_b, hasher, [evaluate.doc_ids(jtok, p["prompt"])
                                                                      for p in prompts], a.new_tokens)
        manifest["completions"] = [{**p, "completion": jtok.decode(o)} for p, o in zip(prompts, outs, strict=True)]
        write_manifest("done")
        log({"event": "completions", "completions": manifest["completions"],
             "elapsed_s": round(time.time() - t_start, 1)})
    total = sum(os.path.getsize(os.path.join(a.out, p)) for p in os.listdir(a.out))
    log({"event": "done", "files": files, "out_bytes": total, "elapsed_s": round(time.time() - t_start, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
