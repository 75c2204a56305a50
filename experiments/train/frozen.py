"""The drafter's frozen target: a trained `deepseek41` GGUF decoded into the training forward's float trees, its
tokenizer and Engram hasher, and the config of the draft stages that go with it.

Why decode the file rather than load a float master copy: the drafter reads the target's features and is
verified against the target's logits, and the engine computes both from the file's quantized weights. Decoding
every tensor the way the engine reads it (gguf-py's dequantizers, the engine's Engram row decoder) makes the
training forward (forward.py) compute the engine's features and logits, up to float summation order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType as T

from experiments.train.export import decode
from experiments.train.params import BUFFER_NAMES
from jds41.checkpoints.schema import Kind, model_tensors
from jds41.config import ModelConfig
from jds41.weights import param_path

_TYPED = (T.F32, T.F16, T.BF16, T.I32)


def decoded_trees(model) -> tuple[dict, dict]:
    """(params, buffers) numpy trees of a GGUFModel, laid out as params.init_params lays out trainable models:
    float32 values of every main-model tensor (Engram tables as float [rows, head_dim]), tid2eid int32."""
    cfg = model.config
    params: dict = {"blocks": [{} for _ in range(cfg.n_layers)]}
    buffers: dict = {"blocks": [{} for _ in range(cfg.n_layers)]}
    head_dim = cfg.engram.head_dim if cfg.engram else 0
    for name, spec in model_tensors(cfg).items():
        if spec.layer >= cfg.n_layers:  # draft stages of a file that carries its own: not the target's
            continue
        info = model.tensors[name]
        stored = model.typed(name) if info.ggml_type in _TYPED else model.raw(name)
        value = decode(stored, info.ggml_type, spec.shape, head_dim)
        if spec.kind is not Kind.INDEX:
            value = np.asarray(value, np.float32)
        layer, short = param_path(name)
        tree = buffers if short in BUFFER_NAMES else params
        (tree["blocks"][layer] if layer >= 0 else tree)[short] = value
    return params, buffers


def token_map(model) -> np.ndarray:
    """The Engram token map the file carries (uint32 [vocab])."""
    return np.asarray(model.metadata[f"{model.config.arch}.engram.token_map"], np.uint32)


def draft_config(cfg: ModelConfig, n_stages: int, n_experts: int, top_k: int) -> ModelConfig:
    """The target's config plus `n_stages` DSpark draft stages (trailing ratio-0 blocks, the `mtp.{s}.*` tensors)
    with their own pool of `n_experts` top-`top_k` experts. Everything that check_compatible compares (the
    main-model part) is the target's; the stages' swiglu clamps repeat the last main layer's."""
    if cfg.dspark is None:
        raise ValueError("the target config has no DSpark keys (target layers, noise id, block size, rank)")
    base = dataclasses.replace(cfg, n_nextn=0, compress_ratios=cfg.compress_ratios[:cfg.n_layers],
                               swiglu_limit=cfg.swiglu_limit[:cfg.n_layers],
                               swiglu_limit_shexp=cfg.swiglu_limit_shexp[:cfg.n_layers])
    out = dataclasses.replace(
        base, n_nextn=n_stages, compress_ratios=base.compress_ratios + (0,) * n_stages,
        swiglu_limit=base.swiglu_limit + (base.swiglu_limit[-1],) * n_stages,
        swiglu_limit_shexp=base.swiglu_limit_shexp + (base.swiglu_limit_shexp[-1],) * n_stages,
        dspark=dataclasses.replace(cfg.dspark, n_experts=n_experts, n_experts_used=top_k))
    # round trip through the GGUF keys: the draft file must parse to exactly this config
    back = ModelConfig.from_metadata({k: v for k, v, _ in out.to_metadata()}, path="<draft config>")
    if back != out:
        raise ValueError("the draft config does not survive its GGUF keys")
    return out
