"""The parameter pytree of a model, built from a validated GGUF directory by one table.

The table is the tensor schema itself (jds41.checkpoints.schema): GGUF name `blk.N.<short>.weight` (or `.bias`)
becomes `params["blocks"][N]["<short>"]`, a global `<short>.weight` becomes `params["<short>"]`. What a leaf is
follows the tensor's kind, never its name:
- matrices and expert stacks stay quantized as `QTensor` (raw GGUF rows, dequantized inside the graph);
- vectors and hyper-connection matrices become f32 arrays (they are small and read every step);
- tid2eid stays int32;
- Engram tables are not device leaves: rows are fetched by the host through a row source (layers/engram).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
from gguf import GGMLQuantizationType as T

from jds41.checkpoints.schema import Kind, model_tensors
from jds41.config import ModelConfig
from jds41.quant import QTensor

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^(.+)\.(weight|bias)$")


def param_path(name: str) -> tuple[int, str]:
    """GGUF tensor name -> (block index or -1, short name)."""
    m = _BLOCK.match(name)
    if m:
        return int(m.group(1)), m.group(2)
    m = _GLOBAL.match(name)
    return -1, m.group(1)


def _leaf(kind: Kind, qtype: T, shape: tuple[int, ...], model, name: str):
    if kind in (Kind.MATRIX, Kind.EXPERTS):
        return QTensor.from_raw(model.raw(name), qtype, shape)
    if kind is Kind.INDEX:
        return jnp.asarray(model.typed(name).reshape(shape))
    return jnp.asarray(model.typed(name).reshape(shape), dtype=jnp.float32)


def load_params(cfg: ModelConfig, model) -> dict:
    """Every non-Engram tensor of `model` (a jds41.checkpoints GGUFModel) as the parameter pytree."""
    params: dict = {"blocks": [dict() for _ in range(cfg.n_blocks)]}
    for name, spec in model_tensors(cfg).items():
        if spec.kind is Kind.ROWS:
            continue
        info = model.tensors[name]
        leaf = _leaf(spec.kind, info.ggml_type, spec.shape, model, name)
        layer, short = param_path(name)
        (params["blocks"][layer] if layer >= 0 else params)[short] = leaf
    return params
