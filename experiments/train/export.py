"""Export trained float parameters to a `deepseek41` GGUF (one file or a llama.cpp-style split set).

Storage types (MODEL.md §5 "Quant types", ds4's layout with MXFP4 experts as ggml-org's MXFP4_MOE releases):
routed experts MXFP4 (or Q8_0); attention, shared expert, embedding, output and Engram W_kv Q8_0; router,
hyper-connection matrices, compressor and indexer F16; norms, hc base/scale and other vectors F32; tid2eid I32;
Engram tables as the engine reads them, "e4m3_e8m0_32" rows (head_dim E4M3 codes, then one E8M0 scale per 32).

`quantized_tensors` encodes every tensor once and also returns the values the file will hold, decoded by gguf-py
(and the host Engram decoder), so the held-out evaluation on the GPU runs the shipped weights, not the float
master copy. `plan_bytes(cfg)` gives the file size from the config alone (run.py refuses a config that would not
fit the return limits before training starts).
"""

from __future__ import annotations

import os

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from jds41.checkpoints import synth_tokenizer
from jds41.checkpoints.schema import Kind, model_tensors
from jds41.checkpoints.synth import tensor_nbytes, tensor_type
from jds41.config import ModelConfig
from jds41.layers.engram_rows import dequant_rows_np
from jds41.weights import param_path

E4M3_MAX = 448.0
_VTYPES = {"str": V.STRING, "u32": V.UINT32, "i32": V.INT32, "u64": V.UINT64, "i64": V.INT64, "f32": V.FLOAT32,
           "bool": V.BOOL}


def storage_types(cfg: ModelConfig, experts: str = "mxfp4") -> dict[str, T]:
    """GGUF type of every tensor of the schema."""
    return tensor_storage_types(model_tensors(cfg), experts)


def tensor_storage_types(tensors: dict, experts: str = "mxfp4") -> dict[str, T]:
    """GGUF type of each named tensor spec: ds4's types, routed experts MXFP4 or Q8_0."""
    out = {}
    for name, spec in tensors.items():
        t = tensor_type(spec, "ds4-q2")
        if spec.kind is Kind.EXPERTS:
            t = T.MXFP4 if experts == "mxfp4" else T.Q8_0
        out[name] = t
    return out


def plan_bytes(cfg: ModelConfig, experts: str = "mxfp4") -> dict[str, int]:
    """Bytes of tensor data by group (experts, embeddings, engram tables, rest) and in total."""
    types = storage_types(cfg, experts)
    groups = {"experts": 0, "embed_output": 0, "engram_tables": 0, "rest": 0}
    for name, spec in model_tensors(cfg).items():
        n = tensor_nbytes(spec.shape, types[name])
        key = ("experts" if spec.kind is Kind.EXPERTS else "engram_tables" if spec.kind is Kind.ROWS
               else "embed_output" if name in ("token_embd.weight", "output.weight") else "rest")
        groups[key] += n
    groups["total"] = sum(groups.values())
    return groups


def encode_engram_rows(table: np.ndarray) -> np.ndarray:
    """float [rows, head_dim] -> uint8 [rows, head_dim + head_dim/32]: per 32 values the smallest power-of-two
    scale that brings the block's max |value| within E4M3's 448, then E4M3 codes (round to nearest even)."""
    x = np.asarray(table, np.float32)
    rows, hd = x.shape
    blocks = x.reshape(rows, hd // 32, 32)
    amax = np.max(np.abs(blocks), axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / E4M3_MAX)), -127).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    codes = np.clip(blocks / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    out = np.empty((rows, hd + hd // 32), np.uint8)
    out[:, :hd] = codes.reshape(rows, hd).view(np.uint8)
    out[:, hd:] = (exp + 127).astype(np.uint8)
    return out


def encode(value: np.ndarray, qtype: T) -> np.ndarray:
    """The tensor's stored form: a typed array for F32/F16/I32, uint8 rows for block types and Engram rows."""
    if qtype == T.F32:
        return np.ascontiguousarray(value, np.float32)
    if qtype == T.F16:
        return np.ascontiguousarray(value, np.float16)
    if qtype == T.I32:
        return np.ascontiguousarray(value, np.int32)
    if qtype == T.I8:
        return encode_engram_rows(value).view(np.int8)
    flat = np.ascontiguousarray(value, np.float32).reshape(-1, value.shape[-1])
    return gguf.quants.quantize(flat, qtype).reshape(*value.shape[:-1], -1)


def decode(stored: np.ndarray, qtype: T, shape: tuple[int, ...], head_dim: int = 0) -> np.ndarray:
    """What the engine reads back from `encode`'s bytes, as float32 (int32 for I32)."""
    if qtype in (T.F32, T.F16):
        return np.asarray(stored, np.float32).reshape(shape)
    if qtype == T.I32:
        return np.asarray(stored, np.int32).reshape(shape)
    if qtype == T.I8:
        return dequant_rows_np(stored.view(np.uint8), head_dim)
    flat = stored.reshape(-1, stored.shape[-1])
    return gguf.quants.dequantize(flat, qtype).reshape(shape).astype(np.float32)


def _leaf(params: dict, buffers: dict, name: str) -> np.ndarray:
    layer, short = param_path(name)
    for tree in (params, buffers):
        node = tree["blocks"][layer] if layer >= 0 else tree
        if short in node:
            return np.asarray(node[short])
    raise KeyError(name)


def quantized_tensors(cfg: ModelConfig, params: dict, buffers: dict, experts: str = "mxfp4"
                      ) -> tuple[dict[str, np.ndarray], dict[str, T], dict, dict]:
    """(stored arrays by GGUF name, types, decoded params tree, decoded buffers tree)."""
    types = storage_types(cfg, experts)
    stored: dict[str, np.ndarray] = {}
    dec_p: dict = {"blocks": [{} for _ in range(cfg.n_layers)]}
    dec_b: dict = {"blocks": [{} for _ in range(cfg.n_layers)]}
    for name, spec in model_tensors(cfg).items():
        value = _leaf(params, buffers, name)
        want = (spec.shape[0], cfg.engram.head_dim) if spec.kind is Kind.ROWS else spec.shape
        if value.shape != want:
            raise ValueError(f"{name}: parameter shape {value.shape}, schema says {want}")
        stored[name] = encode(value, types[name])
        back = decode(stored[name], types[name], want, cfg.engram.head_dim if cfg.engram else 0)
        layer, short = param_path(name)
        tree = dec_b if short in ("exp_probs_b", "ffn_gate_tid2eid") else dec_p
        (tree["blocks"][layer] if layer >= 0 else tree)[short] = back
    return stored, types, dec_p, dec_b


def split_limit(cfg: ModelConfig, types: dict[str, T], cap_bytes: int) -> int:
    """The per-shard tensor-byte limit that gives gguf-py's greedy splitter (a new shard when the next tensor would
    pass the limit) the fewest shards with none over `cap_bytes`; tensors are packed in schema order."""
    sizes = [tensor_nbytes(spec.shape, types[name]) for name, spec in model_tensors(cfg).items()]

    def n_shards(limit: int) -> int:
        count, used = 1, 0
        for x in sizes:
            if used and used + x > limit:
                count, used = count + 1, 0
            used += x
        return count

    best = n_shards(cap_bytes)
    limit = max(max(sizes), -(-sum(sizes) // best))
    while n_shards(limit) > best:  # the smallest limit that still reaches the fewest shards: even shards
        limit += 1 << 16
    return min(limit, cap_bytes)


def _add(w: gguf.GGUFWriter, key: str, value, typ: str) -> None:
    if typ.endswith("[]"):
        if len(value):
            w.add_key_value(key, list(value), V.ARRAY, sub_type=_VTYPES[typ[:-2]])
    else:
        w.add_key_value(key, value, _VTYPES[typ])


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, stored: dict[str, np.ndarray], types: dict[str, T],
               tokenizer, token_map: np.ndarray, extra: dict[str, tuple] | None = None,
               split_max_bytes: int = 0) -> list[str]:
    """Write the model; with `split_max_bytes` > 0 a `NAME-0000i-of-0000N.gguf` set whose shards hold at most that
    many tensor bytes each (headers and padding come on top). Returns the written paths."""
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, cfg.arch, split_max_size=split_max_bytes)
    w.data_alignment = cfg.alignment
    for key, value, typ in cfg.to_metadata():
        if key != "general.architecture":
            _add(w, key, value, typ)
    for key, value, typ in synth_tokenizer.gguf_fields(tokenizer):
        _add(w, key, value, typ)
    if cfg.engram is not None:
        w.add_key_value(f"{cfg.arch}.engram.token_map", [int(x) for x in token_map], V.ARRAY, sub_type=V.UINT32)
        _add(w, f"{cfg.arch}.engram.compressed_vocab_size", int(np.max(token_map)) + 1, "u32")
    for key, (value, typ) in (extra or {}).items():
        _add(w, key, value, typ)
    for name in model_tensors(cfg):
        w.add_tensor(name, stored[name], raw_dtype=types[name] if stored[name].dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    stem = path[:-5] if path.endswith(".gguf") else path
    n = len(w.tensors)
    if n <= 1:
        return [path]
    return [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
