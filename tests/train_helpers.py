"""Shared pieces of the training tests: a tiny config, engine parameters from float weights, engine logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from experiments.train.export import encode_engram_rows
from experiments.train.model_config import build_config
from experiments.train.params import init_params
from jds41 import model as M
from jds41.checkpoints.schema import Kind, model_tensors
from jds41.layers.engram_rows import EngramHasher, MmapRowSource, dequant_rows_np, read_step_rows
from jds41.quant import QTensor
from jds41.weights import param_path

TINY_VOCAB, TINY_CLASSES = 512, 400


def tiny_setup(seed: int = 0, bucket_start: int = 64):
    """(cfg, params, buffers, hasher, token_map): tiny deepseek41 with random float weights; Engram tables already
    on the e4m3/e8m0 grid, so the engine's quantized rows hold exactly the training forward's values."""
    cfg = build_config("tiny", TINY_VOCAB, TINY_CLASSES, bucket_start)
    params, buffers = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    for layer in range(cfg.n_layers):  # make the untrained-zero vectors non-trivial so the test sees them
        blk, buf = params["blocks"][layer], buffers["blocks"][layer]
        blk["attn_sinks"] = rng.standard_normal(blk["attn_sinks"].shape).astype(np.float32)
        for k in [k for k in blk if k.endswith("_ape")]:
            blk[k] = rng.standard_normal(blk[k].shape).astype(np.float32)
        if "exp_probs_b" in buf:
            buf["exp_probs_b"] = (0.1 * rng.standard_normal(buf["exp_probs_b"].shape)).astype(np.float32)
        if "engram_embd" in blk:
            blk["engram_embd"] = dequant_rows_np(encode_engram_rows(blk["engram_embd"]), cfg.engram.head_dim)
    token_map = (np.arange(cfg.vocab_size) % TINY_CLASSES).astype(np.uint32)
    return cfg, params, buffers, EngramHasher(cfg.engram, token_map), token_map


def engine_params(cfg, params, buffers) -> tuple[dict, MmapRowSource]:
    """The engine's parameter pytree (F32 QTensors) and an Engram row source, from the same float weights."""
    out: dict = {"blocks": [{} for _ in range(cfg.n_blocks)]}
    tables = []
    for name, spec in model_tensors(cfg).items():
        layer, short = param_path(name)
        src = buffers if short in ("exp_probs_b", "ffn_gate_tid2eid") else params
        value = np.asarray((src["blocks"][layer] if layer >= 0 else src)[short])
        if spec.kind is Kind.ROWS:
            tables.append(encode_engram_rows(value))
            continue
        if spec.kind in (Kind.MATRIX, Kind.EXPERTS):
            from gguf import GGMLQuantizationType as T

            leaf = QTensor.from_raw(value.astype(np.float32), T.F32, spec.shape)
        elif spec.kind is Kind.INDEX:
            leaf = jnp.asarray(value, jnp.int32)
        else:
            leaf = jnp.asarray(value, jnp.float32)
        (out["blocks"][layer] if layer >= 0 else out)[short] = leaf
    return out, MmapRowSource(tables)


def engine_logits(cfg, eparams, source, hasher, tokens) -> np.ndarray:
    """[T, V] logits of `jds41.model.prefill` (the token-by-token engine) from a fresh state."""
    plan = M.make_plan(cfg, max_ctx=len(tokens))
    rows = jnp.asarray(read_step_rows(source, hasher.row_ids_seq(tokens)))
    logits, _ = M.prefill(plan, eparams, M.init_state(plan), jnp.asarray(tokens, jnp.int32), rows)
    return np.asarray(logits)
