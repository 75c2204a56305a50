"""Float parameters of a trainable `deepseek41` model, laid out by the GGUF schema, and their initialisation.

`init_params(cfg, seed)` returns (params, buffers): `params` holds every trained tensor as a float32 array under
its schema short name (`params["blocks"][i]["attn_q_a"]`, `params["token_embd"]`, ...), Engram tables as float
[rows, head_dim]; `buffers` holds what the optimizer never touches: the router selection bias `exp_probs_b`
(moved by the aux-loss-free rule, train_step.py) and the frozen hash-layer table `ffn_gate_tid2eid`.

Initialisation (why): matrices N(0, 1/fan_in) so every projection keeps unit-RMS inputs at unit scale; the
projections that write into the residual stream (W_ob, expert and shared W_down, the Engram value rows) are
scaled by 1/sqrt(2 * n_layers) as in GPT-2-style residual scaling; hc mixing matrices small (the mix starts
from its bias: pre 0.5, post 1, comb near the identity), norms 1, sinks / ape / bias 0, Engram tables N(0, 1)
(their scale is absorbed by the RMS-normalised gate and W_kv).
"""

from __future__ import annotations

import numpy as np

from jds41.checkpoints.schema import Kind, model_tensors
from jds41.config import ModelConfig
from jds41.weights import param_path

BUFFER_NAMES = ("exp_probs_b", "ffn_gate_tid2eid")
_RESIDUAL_WRITERS = ("attn_output_b", "ffn_down_exps", "ffn_down_shexp")


def _init(short: str, shape: tuple[int, ...], kind: Kind, cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    if kind is Kind.ROWS:
        return rng.standard_normal((shape[0], cfg.engram.head_dim), dtype=np.float32)
    if short.endswith("norm") or short in ("engram_q", "engram_k"):
        return np.ones(shape, np.float32)
    if kind is Kind.HC:
        return (rng.standard_normal(shape, dtype=np.float32) * (0.1 / np.sqrt(shape[-1]))).astype(np.float32)
    if short.endswith("_base"):
        base = np.zeros(shape, np.float32)
        H = cfg.hc_mult
        base[2 * H:] = (4.0 * np.eye(H, dtype=np.float32)).reshape(-1)  # comb starts close to the identity
        return base
    if short.endswith("_scale"):
        return np.ones(shape, np.float32)
    if kind is Kind.VECTOR:  # sinks, ape, router bias
        return np.zeros(shape, np.float32)
    std = 1.0 if short == "token_embd" else 1.0 / np.sqrt(shape[-1])
    if short in _RESIDUAL_WRITERS:
        std /= np.sqrt(2 * cfg.n_layers)
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if short == "engram_wkv":  # value rows (the last D) write into the stream: residual scaling
        w[cfg.hc_mult * cfg.dim:] /= np.sqrt(2 * cfg.n_layers)
    return w


def balanced_tid2eid(token_counts: np.ndarray, n_experts: int, k: int, seed: int) -> np.ndarray:
    """Hash-layer table [vocab, k] int32: tokens in descending frequency each take the k least-loaded experts
    (ties broken by a seeded random order), so the frozen routing spreads the training tokens evenly."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(token_counts, np.float64) + 1.0
    load = np.zeros(n_experts)
    out = np.zeros((len(counts), k), np.int32)
    for t in np.argsort(-counts, kind="stable"):
        jitter = rng.random(n_experts) * 1e-6
        pick = np.argsort(load + jitter)[:k]
        out[t] = pick
        load[pick] += counts[t]
    return out


def init_params(cfg: ModelConfig, seed: int = 0, token_counts: np.ndarray | None = None) -> tuple[dict, dict]:
    """(params, buffers) as numpy float32 / int32 trees; `token_counts` [vocab] balances the hash layers."""
    params: dict = {"blocks": [{} for _ in range(cfg.n_layers)]}
    buffers: dict = {"blocks": [{} for _ in range(cfg.n_layers)]}
    counts = np.ones(cfg.vocab_size) if token_counts is None else token_counts
    for i, (name, spec) in enumerate(model_tensors(cfg).items()):
        layer, short = param_path(name)
        rng = np.random.default_rng([seed, i])
        if short == "ffn_gate_tid2eid":
            value = balanced_tid2eid(counts, cfg.n_experts, cfg.n_experts_used, seed * 1000 + layer)
        else:
            value = _init(short, spec.shape, spec.kind, cfg, rng)
        tree = buffers if short in BUFFER_NAMES else params
        (tree["blocks"][layer] if layer >= 0 else tree)[short] = value
    return params, buffers


def count_params(params: dict) -> int:
    import jax

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
