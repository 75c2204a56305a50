"""Training: the jitted step (AdamW, bf16 compute over f32 master weights), DeepSeek's aux-loss-free router bias
update, deterministic batches, a wall-clock-budgeted loop and checkpoint/resume to a local directory.

Loss = next-token cross-entropy
     + `balance_alpha` * sum over scored layers of DeepSeek-V3's sequence-wise balance loss (alpha 1e-4, as V3)
     + `indexer_weight` * the indexer's KL distillation loss (forward.py; it only reaches indexer parameters).
Bias update (DeepSeek-V3 §2.1.2, "auxiliary-loss-free load balancing"): after each step, for every scored (not
hash) layer, b_e += gamma * sign(mean_load - load_e) from that step's routing counts; outside the gradient.

Batches: step s reads B windows of T+1 tokens at offsets drawn from `default_rng([seed, s])` over the token
stream, so a resumed run sees exactly the batches the uninterrupted run would have. The learning rate is
warmup + cosine to 10% over `total_steps`; with a time budget the total is fixed once, after the first timed steps
(`plan_steps`), and stored in the checkpoint so a resume keeps the same schedule.

Checkpoints are one .npz (every leaf of params, buffers and optimizer state, plus step / total_steps), written
atomically; they only live as long as the machine does (the GPU box is wiped between leases).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.train.forward import engram_ids_batch, forward


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch: int = 64
    seq_len: int = 1024
    peak_lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_gamma: float = 1e-3
    balance_alpha: float = 1e-4
    indexer_weight: float = 1.0
    dtype: str = "bfloat16"
    moe_block: int = 256
    remat: bool = True
    seed: int = 0
    sinkhorn_loop: bool = True  # mHC's Sinkhorn iterations as a loop: a smaller graph to compile, same arithmetic


def flops_per_token(cfg, seq_len: int) -> float:
    """Forward FLOPs per token (2 per multiply-add): every matrix a token passes through (K routed experts, the
    shared one, Engram W_kv, head) plus attention over its window and the compressed rows it reads."""
    D, H, HD = cfg.dim, cfg.n_heads, cfg.head_dim
    attn = D * cfg.q_lora_rank + cfg.q_lora_rank * H * HD + D * HD + H * HD * cfg.o_lora_rank + \
        cfg.o_groups * cfg.o_lora_rank * D
    macs = cfg.vocab_size * D
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        macs += attn + 2 * cfg.hc_mix * cfg.hc_mult * D + cfg.n_experts * D
        macs += (cfg.n_experts_used + cfg.n_shared_experts) * 3 * D * cfg.expert_ff
        keys = cfg.window
        if r:
            macs += 2 * D * HD * (2 if cfg.compressor_overlap(layer) else 1)
            keys += min(seq_len // r, cfg.index_topk) if cfg.has_indexer(layer) else seq_len // r // 2
        if cfg.has_indexer(layer):
            macs += cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + 4 * D * cfg.index_head_dim + \
                seq_len // 8 * cfg.index_n_heads * cfg.index_head_dim
        macs += 2 * H * HD * keys
        if cfg.is_engram_layer(layer):
            macs += (cfg.hc_mult + 1) * D * cfg.engram.embed_dim
    return 2.0 * macs


def lr_at(tc: TrainConfig, step: int, total: int) -> float:
    if step < tc.warmup:
        return tc.peak_lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, total - tc.warmup))
    return tc.peak_lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _decay_mask(params):
    def mask(path, x):
        name = str(path[-1].key) if hasattr(path[-1], "key") else ""
        return x.ndim >= 2 and name not in ("token_embd", "engram_embd")

    return jax.tree_util.tree_map_with_path(mask, params)


def make_optimizer(tc: TrainConfig):
    return optax.inject_hyperparams(
        lambda learning_rate: optax.chain(
            optax.clip_by_global_norm(tc.clip),
            optax.adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=tc.weight_decay, mask=_decay_mask)))(
        learning_rate=tc.peak_lr)


def loss_fn(cfg, tc: TrainConfig, params, buffers, tokens_in, targets, mask, ids):
    dtype = jnp.bfloat16 if tc.dtype == "bfloat16" else jnp.float32
    logits, aux = forward(cfg, params, buffers, tokens_in, ids, dtype=dtype, block=tc.moe_block, remat=tc.remat,
                          sinkhorn_loop=tc.sinkhorn_loop)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    ce = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    total = ce + tc.balance_alpha * jnp.sum(aux["balance"]) + tc.indexer_weight * aux["indexer"]
    return total, {"ce": ce, "indexer": aux["indexer"], "balance": jnp.sum(aux["balance"]), "counts": aux["counts"]}


def bias_update(cfg, buffers, counts, gamma):
    """b_e += gamma * sign(mean load - load_e) on every scored layer (hash layers have no bias)."""
    new = {"blocks": []}
    for layer, buf in enumerate(buffers["blocks"]):
        buf = dict(buf)
        if "exp_probs_b" in buf:
            load = counts[layer]
            buf["exp_probs_b"] = buf["exp_probs_b"] + gamma * jnp.sign(jnp.mean(load) - load)
        new["blocks"].append(buf)
    return new


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def train_step(cfg, tc: TrainConfig, state: dict, tokens, ids, lr):
    """One optimizer step on tokens [B, T+1]; returns (state, metrics)."""
    opt = make_optimizer(tc)
    tokens_in, targets = tokens[:, :-1], tokens[:, 1:]
    mask = jnp.ones(targets.shape, jnp.float32)
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, cfg, tc), has_aux=True)
    (_, m), grads = grad_fn(state["params"], state["buffers"], tokens_in, targets, mask, ids)
    opt_state = state["opt"]
    opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    updates, opt_state = opt.update(grads, opt_state, state["params"])
    params = optax.apply_updates(state["params"], updates)
    buffers = bias_update(cfg, state["buffers"], m["counts"], tc.bias_gamma)
    metrics = {"ce": m["ce"], "indexer": m["indexer"], "balance": m["balance"], "counts": m["counts"],
               "grad_norm": jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))}
    return {"params": params, "buffers": buffers, "opt": opt_state}, metrics


def init_state(tc: TrainConfig, params, buffers) -> dict:
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    buffers = jax.tree.map(jnp.asarray, buffers)
    return {"params": params, "buffers": buffers, "opt": make_optimizer(tc).init(params)}


# ---- data ------------------------------------------------------------------------------------------------------


def batch_for_step(stream: np.ndarray, step: int, tc: TrainConfig) -> np.ndarray:
    """[B, T+1] int32 windows of the token stream, a pure function of (seed, step)."""
    rng = np.random.default_rng([tc.seed, step])
    starts = rng.integers(0, len(stream) - tc.seq_len - 1, tc.batch)
    return np.stack([stream[s:s + tc.seq_len + 1] for s in starts]).astype(np.int32)


def batch_inputs(stream, step, tc, hasher):
    tokens = batch_for_step(stream, step, tc)
    return tokens, engram_ids_batch(hasher, tokens[:, :-1])


# ---- checkpoints -----------------------------------------------------------------------------------------------


def save_checkpoint(path: str, state: dict, step: int, total_steps: int) -> None:
    leaves = jax.tree.leaves(state)
    tmp = path + ".tmp.npz"
    np.savez(tmp, *[np.asarray(x) for x in leaves], step=step, total_steps=total_steps)
    os.replace(tmp, path)


def load_checkpoint(path: str, template: dict) -> tuple[dict, int, int]:
    """(state, step, total_steps) from `save_checkpoint`'s file; `template` gives the tree structure."""
    with np.load(path) as z:
        leaves, treedef = jax.tree.flatten(template)
        loaded = [jnp.asarray(z[f"arr_{i}"], dtype=np.asarray(leaf).dtype) for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(treedef, loaded), int(z["step"]), int(z["total_steps"])


# ---- the loop --------------------------------------------------------------------------------------------------


def train(cfg, tc: TrainConfig, state: dict, stream: np.ndarray, hasher, *, max_steps: int | None = None,
          deadline: float | None = None, ckpt_dir: str | None = None, ckpt_every: int = 200, log=print,
          start_step: int = 0, total_steps: int | None = None, plan_after: int = 5,
          step_fn=None, on_plan=None, plan_s: float | None = None, batch_fn=None) -> tuple[dict, dict]:
    """Run steps until `max_steps` or the wall-clock `deadline` (time.time()); returns (state, summary).

    Without `total_steps` the schedule length is planned after `plan_after` timed steps from the time left, or,
    with `plan_s`, from that many seconds of training in all (a run spread over several calls: this one stops at
    its deadline with the schedule unfinished, and a resumed call continues it).
    `step_fn(state, tokens, ids, lr)`: an ahead-of-time compiled `train_step` (default: the jitted one).
    `batch_fn(stream, step, tc, hasher)` makes a step's (tokens, engram ids) (default batch_inputs).
    `on_plan()` is called once the step count is planned (run.py starts CPU-heavy side work only then, so the
    timed steps are not slowed by it and the schedule does not end early).
    """
    if step_fn is None:
        step_fn = functools.partial(train_step, cfg, tc)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    step = start_step
    batch_fn = batch_fn or batch_inputs
    nxt = pool.submit(batch_fn, stream, step, tc, hasher)
    losses, t_steps = [], []
    counts_sum = None
    t_first = None
    while True:
        if max_steps is not None and step >= max_steps:
            break
        if total_steps is not None and step >= total_steps:
            break
        if deadline is not None and t_steps and time.time() + np.median(t_steps[-20:]) > deadline:
            break
        tokens, ids = nxt.result()
        nxt = pool.submit(batch_fn, stream, step + 1, tc, hasher)
        planned = total_steps if total_steps is not None else (max_steps or 10 ** 6)
        t0 = time.time()
        state, m = step_fn(state, jnp.asarray(tokens), jnp.asarray(ids), np.float32(lr_at(tc, step, planned)))
        ce = float(m["ce"])  # blocks: step time includes the device work
        dt = time.time() - t0
        if t_first is None:
            t_first = dt  # compile + first step
        else:
            t_steps.append(dt)
        step += 1
        losses.append(ce)
        c = np.asarray(m["counts"])
        counts_sum = c if counts_sum is None else counts_sum + c
        if total_steps is None and deadline is not None and len(t_steps) == plan_after:
            per = float(np.median(t_steps))
            if plan_s is not None:  # seconds of training in all, steps of earlier calls included
                total_steps = max(step + 1, int(plan_s / per * 0.97))
            else:
                total_steps = step + int((deadline - time.time()) / per * 0.97)
            log({"event": "plan", "step": step, "step_s": round(per, 4), "total_steps": total_steps,
                 "tokens_per_s": round(tc.batch * tc.seq_len / per)})
            if on_plan is not None:
                on_plan()
        if step % 10 == 0 or step == 1:
            log({"event": "step", "step": step, "ce": round(ce, 4), "indexer": round(float(m["indexer"]), 4),
                 "grad_norm": round(float(m["grad_norm"]), 3), "lr": lr_at(tc, step - 1, planned),
                 "step_s": round(dt, 4)})
        if ckpt_dir and step % ckpt_every == 0:
            save_checkpoint(os.path.join(ckpt_dir, "ckpt.npz"), state, step, total_steps or 0)
    pool.shutdown(wait=False)
    summary = {"steps": step, "total_steps": total_steps, "compile_and_first_step_s": t_first,
               "median_step_s": float(np.median(t_steps)) if t_steps else None, "losses": losses,
               "tokens_seen": step * tc.batch * tc.seq_len,
               "expert_counts": None if counts_sum is None else counts_sum.tolist()}
    return state, summary


def json_log(path: str | None):
    """A logger that prints one JSON line per event and appends it to `path`."""
    def log(event: dict) -> None:
        event = {"t": round(time.time(), 3), **event}
        line = json.dumps(event)
        print(line, flush=True)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return log
