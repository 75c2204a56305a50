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

import jax
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


def _leaf(kind: Kind, qtype: T, shape: tuple[int, ...], model, name: str, act_round: str | None = None,
          raw: dict | None = None):
    if kind in (Kind.MATRIX, Kind.EXPERTS):
        data = raw[name] if raw is not None and name in raw else model.raw(name)
        return QTensor.from_raw(data, qtype, shape, act_round)
    if kind is Kind.INDEX:
        return jnp.asarray(model.typed(name).reshape(shape))
    return jnp.asarray(model.typed(name).reshape(shape), dtype=jnp.float32)


def _tree(cfg: ModelConfig, leaf, skip=lambda name: False) -> dict:
    """The pytree of every non-Engram tensor of the schema (but those `skip` names), each made by `leaf(name, spec)`."""
    params: dict = {"blocks": [{} for _ in range(cfg.n_blocks)]}
    for name, spec in model_tensors(cfg).items():
        if spec.kind is Kind.ROWS or skip(name):
            continue
        layer, short = param_path(name)
        (params["blocks"][layer] if layer >= 0 else params)[short] = leaf(name, spec)
    return params


def matrix_names(cfg: ModelConfig, with_routed_experts: bool = True) -> list[str]:
    """The bulk tensors (matrices and expert stacks) that a loader reads; vectors are small and come via mmap."""
    return [n for n, s in model_tensors(cfg).items() if not _draft_tensor(n)
            and (s.kind is Kind.MATRIX or (s.kind is Kind.EXPERTS and with_routed_experts))]


def _draft_tensor(name: str) -> bool:
    """DSpark stages (`mtp.*`): the target step never reads them; the drafter loads its own (speculative.py)."""
    return name.startswith("mtp.")


def load_params(cfg: ModelConfig, model, act_round: str | None = None, raw: dict | None = None,
                with_routed_experts: bool = True) -> dict:
    """Every non-Engram tensor of `model` (a jds41.checkpoints GGUFModel) as the parameter pytree.

    `act_round` goes to every QTensor: None (default), "ggml-cpu" to round activations before quantized products
    as llama.cpp's CPU backend does, or "int8" (the two-bit formats read int8 activations; jds41.quant.qtensor
    docstring). `raw` maps tensor names to bytes already read (the O_DIRECT loader's buffers); others come from the
    file's memory map. Without `with_routed_experts` the routed stacks are left out (the tier stores own them)."""
    return _tree(cfg, lambda name, spec: _leaf(spec.kind, model.tensors[name].ggml_type, spec.shape, model, name,
                                               act_round, raw),
                 skip=lambda name: _draft_tensor(name) or (not with_routed_experts and name.endswith("_exps.weight")))


def abstract_params(cfg: ModelConfig, types: dict[str, T]) -> dict:
    """The parameter pytree as shapes only (`jax.ShapeDtypeStruct` leaves): `jax.eval_shape` of full-size models
    without allocating a byte. `types` gives each tensor's storage type by GGUF name."""
    def leaf(name, spec):
        if spec.kind in (Kind.MATRIX, Kind.EXPERTS):
            return QTensor.abstract(types[name], spec.shape)
        return jax.ShapeDtypeStruct(spec.shape, jnp.int32 if spec.kind is Kind.INDEX else jnp.float32)

    return _tree(cfg, leaf)
