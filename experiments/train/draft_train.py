"""Training the DSpark drafter of a frozen target: float parameters, the distillation loss, the jitted step and a
wall-clock-budgeted loop.

Parameters: {"stages": [{short name: float32 array}]}, the short names of `schema.draft_tensors` (`mtp.{s}.attn_q_a`
-> stages[s]["attn_q_a"], as dspark.load_draft_params names them); the router's selection bias `exp_probs_b` lives in
`buffers` (moved by DeepSeek-V3's aux-loss-free rule, train.bias_update, never by the optimizer). The embedding and
output head are the target's (`shared`, decoded from its file): frozen, never trained, so the draft file does not
carry them and the engine's shared tensors are exactly what training saw.

Loss per anchor p and block row i (predicting position p+i+1; only rows with p+i <= T-1 count), with the position
decay w_i = exp(-i/5) of MODEL.md §4 (k = i+1: exp(-(k-1)/5)), normalised by the summed weights:
  (1 - hard_weight) * KL(target(p+i) || draft(p, i))   distillation toward the target's next-token distribution
                                                         at p+i given the true tokens (greedy acceptance compares
                                                         the draft's argmax with the target's, not with the data)
+ hard_weight * CE(x_{p+i+1})                            a small hard-label term (MODEL.md's port recipe uses CE)
+ conf_weight * BCE(conf(p, i), argmax draft == argmax target)   the confidence head (inputs detached).
The target's logits and features come from one frozen forward per batch, outside the gradient (`target_fn`).
Precision: bf16 matmul inputs, f32 accumulation and master weights; AdamW, clipping and the warmup + cosine
schedule are train.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.train.draft_forward import draft_forward
from experiments.train.forward import engram_ids_batch, forward
from experiments.train.params import _init
from experiments.train.train import TrainConfig, batch_for_step, bias_update, lr_at, make_optimizer
from jds41.checkpoints.schema import Kind, draft_stages, draft_tensors
from jds41.config import ModelConfig

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    train: TrainConfig = TrainConfig(batch=16, seq_len=1024, peak_lr=1e-3, warmup=50, remat=False)
    hard_weight: float = 0.1
    conf_weight: float = 0.1
    decay: float = 5.0  # position decay exp(-i / decay)
    target_dtype: str = "float32"  # the frozen target's features and logits: the engine computes them in f32


# ---- parameters --------------------------------------------------------------------------------------------------


def short_name(dcfg: ModelConfig, name: str) -> tuple[int, str]:
    """(stage, short name) of an `mtp.{s}.*` tensor name, as dspark.load_draft_params keys it."""
    stage = int(name.split(".")[1])
    return stage, name[len(f"mtp.{stage}."):].rsplit(".", 1)[0]


def init_draft_params(dcfg: ModelConfig, seed: int = 0) -> tuple[dict, dict]:
    """(params, buffers) numpy trees of the draft stages, initialised as params.py initialises a model of
    n_stages layers (residual writers scaled by 1/sqrt(2 * stages)); the Markov head and the confidence head start
    at zero, so the drafter starts as the plain block head and the Markov term grows from data."""
    n = draft_stages(dcfg)
    as_model = dataclasses.replace(dcfg, n_layers=n)  # _init's residual scaling counts the blocks a row passes
    params: dict = {"stages": [{} for _ in range(n)]}
    buffers: dict = {"stages": [{} for _ in range(n)]}
    for i, (name, spec) in enumerate(draft_tensors(dcfg).items()):
        s, short = short_name(dcfg, name)
        rng = np.random.default_rng([seed, 7919, i])
        if short in ("markov_head", "conf_proj", "hc_head_base"):  # hc_head: pre 0.5 on every copy, like V4's
            value = np.zeros(spec.shape, np.float32)
        elif spec.kind is Kind.SMALL_MATRIX:  # markov_embd: unit rows, like an embedding table
            value = (rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])).astype(np.float32)
        else:
            value = _init(short, spec.shape, spec.kind, as_model, rng)
        (buffers if short == "exp_probs_b" else params)["stages"][s][short] = value
    return params, buffers


def shared_of(target_params: dict) -> dict:
    """The frozen tensors the drafter shares with its target."""
    return {"token_embd": target_params["token_embd"], "output": target_params["output"]}


# ---- the frozen target ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def target_fn(cfg: ModelConfig, feature_layers: tuple[int, ...], dtype: str, params, buffers, tokens_BT, ids):
    """(features [B, T, n_targets, D], logits [B, T, V]) of the frozen target, teacher-forced."""
    dt = jnp.bfloat16 if dtype == "bfloat16" else F32
    logits, aux = forward(cfg, params, buffers, tokens_BT, ids, dtype=dt, block=256, feature_layers=feature_layers,
                          sinkhorn_loop=True)
    return aux["features"], logits


# ---- loss and step -------------------------------------------------------------------------------------------------


def markov_tokens(tokens_BT1: jax.Array, K: int) -> jax.Array:
    """tok_i of anchor p = x_{p+i} (true tokens), 0 past the window (those rows carry no loss)."""
    B, T1 = tokens_BT1.shape
    T = T1 - 1
    padded = jnp.pad(tokens_BT1, ((0, 0), (0, K)))
    return jnp.stack([padded[:, i:i + T] for i in range(K)], axis=-1).astype(jnp.int32)


def _shift(a_BT, i: int):
    """a[:, p + i] for every anchor p (zeros past the end): [B, T, ...]."""
    return jnp.pad(a_BT[:, i:], ((0, 0), (0, i)) + ((0, 0),) * (a_BT.ndim - 2))


def loss_fn(dcfg: ModelConfig, tc: DraftTrainConfig, params, buffers, shared, tokens, feats, t_logits):
    """(total, metrics) for tokens [B, T+1], target features [B, T, n, D] and logits [B, T, V]."""
    t = tc.train
    dtype = jnp.bfloat16 if t.dtype == "bfloat16" else F32
    B, T1 = tokens.shape
    T, K = T1 - 1, dcfg.dspark.block_size
    logits, conf, counts = draft_forward(dcfg, params, buffers, shared, tokens[:, :-1], feats,
                                         markov_tokens(tokens, K), dtype, t.moe_block)
    t_logp = jax.nn.log_softmax(t_logits.astype(F32), axis=-1)
    t_arg = jnp.argmax(t_logits, axis=-1)
    rows = {"kl": [], "ce": [], "bce": [], "agree": [], "valid": []}
    for i in range(K):
        logq = jax.nn.log_softmax(logits[:, :, i], axis=-1)  # [B, T, V]
        lp = _shift(t_logp, i)
        valid = (jnp.arange(T) + i <= T - 1).astype(F32)[None, :]
        kl = jnp.sum(jnp.exp(lp) * (lp - logq), axis=-1)
        ce = -jnp.take_along_axis(logq, _shift(tokens[:, 1:], i)[..., None], axis=-1)[..., 0]
        hit = (jnp.argmax(logits[:, :, i], axis=-1) == _shift(t_arg, i)).astype(F32)
        c = conf[:, :, i]
        bce = jnp.maximum(c, 0) - c * hit + jnp.log1p(jnp.exp(-jnp.abs(c)))
        for k, v in (("kl", kl), ("ce", ce), ("bce", bce), ("agree", hit)):
            rows[k].append(jnp.sum(v * valid))
        rows["valid"].append(jnp.sum(jnp.broadcast_to(valid, kl.shape)))
    n = jnp.stack(rows["valid"])
    per = {k: jnp.stack(rows[k]) / n for k in ("kl", "ce", "bce", "agree")}  # per block row
    wts = jnp.exp(-jnp.arange(K, dtype=F32) / tc.decay)
    wts = wts / jnp.sum(wts)
    total = jnp.sum(wts * ((1 - tc.hard_weight) * per["kl"] + tc.hard_weight * per["ce"] + tc.conf_weight * per["bce"]))
    return total, {**per, "counts": counts}


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def train_step(dcfg: ModelConfig, tc: DraftTrainConfig, state: dict, shared, tokens, feats, t_logits, lr):
    """One optimizer step of the drafter; returns (state, metrics)."""
    opt = make_optimizer(tc.train)
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, dcfg, tc), has_aux=True)
    (loss, m), grads = grad_fn(state["params"], state["buffers"], shared, tokens, feats, t_logits)
    opt_state = state["opt"]
    opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, F32)
    updates, opt_state = opt.update(grads, opt_state, state["params"])
    params = optax.apply_updates(state["params"], updates)
    buffers = {"stages": bias_update(dcfg, {"blocks": state["buffers"]["stages"]}, m["counts"],
                                     tc.train.bias_gamma)["blocks"]}
    metrics = {**m, "loss": loss, "grad_norm": jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))}
    return {"params": params, "buffers": buffers, "opt": opt_state}, metrics


def init_state(tc: DraftTrainConfig, params, buffers) -> dict:
    params = jax.tree.map(lambda x: jnp.asarray(x, F32), params)
    opt = make_optimizer(tc.train).init(params)
    return {"params": params, "buffers": jax.tree.map(jnp.asarray, buffers), "opt": opt}


# ---- the loop ------------------------------------------------------------------------------------------------------


def batch_inputs(stream: np.ndarray, step: int, tc: DraftTrainConfig, hasher):
    """Tokens [B, T+1] of train.py's deterministic batches and the Engram ids of their inputs."""
    tokens = batch_for_step(stream, step, tc.train)
    return tokens, engram_ids_batch(hasher, tokens[:, :-1])


def train_draft(dcfg: ModelConfig, tc: DraftTrainConfig, state: dict, shared, stream: np.ndarray, hasher,
                *, step_fn, target_call, deadline: float | None = None, max_steps: int | None = None,
                plan_after: int = 5, log=print) -> tuple[dict, dict]:
    """Steps until `max_steps` or the wall-clock `deadline`; the schedule length is planned after `plan_after`
    timed steps from the time left (as train.train). `target_call(tokens_in, ids)` -> (features, logits) runs the
    frozen target; `step_fn(state, shared, tokens, feats, t_logits, lr)` the (compiled) draft step."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    nxt = pool.submit(batch_inputs, stream, 0, tc, hasher)
    step, total, t_steps, history = 0, max_steps, [], []
    t_first = None
    while True:
        if total is not None and step >= total:
            break
        if deadline is not None and t_steps and time.time() + np.median(t_steps[-20:]) > deadline:
            break
        tokens, ids = nxt.result()
        nxt = pool.submit(batch_inputs, stream, step + 1, tc, hasher)
        t0 = time.time()
        tok = jnp.asarray(tokens)
        feats, t_logits = target_call(tok[:, :-1], jnp.asarray(ids))
        lr = lr_at(tc.train, step, total or 10 ** 6)
        state, m = step_fn(state, shared, tok, feats, t_logits, np.float32(lr))
        loss = float(m["loss"])  # blocks: the step time includes the device work
        dt = time.time() - t0
        if t_first is None:
            t_first = dt
        else:
            t_steps.append(dt)
        step += 1
        row = {"loss": loss,
               **{k: np.asarray(m[k], np.float64).round(4).tolist() for k in ("kl", "ce", "agree", "bce")}}
        history.append(row)
        if total is None and deadline is not None and len(t_steps) == plan_after:
            per = float(np.median(t_steps))
            total = step + int((deadline - time.time()) / per * 0.97)
            if max_steps is not None:
                total = min(total, max_steps)
            log({"event": "plan", "step": step, "step_s": round(per, 4), "total_steps": total,
                 "anchors_per_s": round(tc.train.batch * tc.train.seq_len / per)})
        if step % 10 == 0 or step == 1:
            log({"event": "step", "step": step, **{k: (round(v, 4) if isinstance(v, float) else v)
                                                   for k, v in row.items()},
                 "grad_norm": round(float(m["grad_norm"]), 3), "lr": lr, "step_s": round(dt, 4)})
    pool.shutdown(wait=False)
    summary = {"steps": step, "total_steps": total, "compile_and_first_step_s": t_first,
               "median_step_s": float(np.median(t_steps)) if t_steps else None,
               "anchors_seen": step * tc.train.batch * tc.train.seq_len, "history": history}
    return state, summary
