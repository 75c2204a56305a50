"""Checks that turn parsed GGUF headers into a model jds41 can trust, failing early and by name.

Three stages, each run before anything depends on it:
1. layout of one file (`check_alignment`, `check_tensor_layout`): alignment key, known tensor types, whole
   quant blocks per row, every tensor's data aligned, inside the file (this is what catches truncation) and
   not overlapping another, no duplicate names. Runs before the file is memory-mapped.
2. a shard set (`check_shard_set`): `split.no` / `split.count` / `split.tensors.count` agree with the files
   found, and no tensor appears in two shards.
3. the model (`check_model`): the architecture and `ModelConfig` (its ConfigError names the key), the extra
   keys jds41 reads outside the config (Engram token map, tokenizer arrays), then the tensor directory against
   `schema.model_tensors(cfg)`: every tensor present with exactly its shape and an allowed type, nothing else.

Every failure is a ModelFileError naming the file (the shard holding the tensor) and the tensor, or a
ConfigError naming the key.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gguf import GGML_QUANT_SIZES, GGUFValueType

from jds41.checkpoints.header import DEFAULT_ALIGNMENT, Header, known_ggml_type, tensor_nbytes
from jds41.checkpoints.schema import STANDALONE_DRAFT_KEY, draft_tensors, model_tensors
from jds41.config import ModelConfig
from jds41.errors import ConfigError, ModelFileError

if TYPE_CHECKING:
    from jds41.checkpoints.reader import TensorInfo

MAX_ALIGNMENT = 1 << 30
MAX_DIM = (1 << 63) - 1  # ggml stores ne as int64
TOKEN_MAP_LIMIT = 1 << 31  # Engram compressed ids are read into int32 on the device


# ---- 1. one file ------------------------------------------------------------------------------------------
def check_alignment(header: Header) -> int:
    """The file's data alignment: `general.alignment` (a uint32 power of two, as llama.cpp requires) or 32."""
    entry = header.keys.get("general.alignment")
    if entry is None:
        return DEFAULT_ALIGNMENT
    if entry.value_type != GGUFValueType.UINT32:
        raise ConfigError(header.path, "general.alignment", f"must be a UINT32, got {entry.value_type.name}")
    a = header.metadata["general.alignment"]
    if a <= 0 or a & (a - 1) or a > MAX_ALIGNMENT:
        raise ConfigError(header.path, "general.alignment", f"must be a power of two <= {MAX_ALIGNMENT}, got {a}")
    return a


def check_tensor_layout(header: Header, alignment: int) -> int:
    """Check every tensor record of one file; returns the absolute offset of its data section."""
    path = header.path
    data_start = -(-header.tensor_info_end // alignment) * alignment
    if data_start > header.file_size:
        raise ModelFileError(path, f"truncated: the data section would start at byte {data_start} (header end "
                             f"{header.tensor_info_end} padded to {alignment}), but the file has "
                             f"{header.file_size} bytes")
    first_seen: dict[str, int] = {}
    spans: list[tuple[int, int, str]] = []
    for t in header.tensors:
        if t.name in first_seen:
            raise ModelFileError(path, f"duplicate tensor name (records at offsets {first_seen[t.name]} and "
                                 f"{t.info_offset})", tensor=t.name)
        first_seen[t.name] = t.info_offset
        ggml_type = known_ggml_type(t.type_id)
        if ggml_type is None:
            raise ModelFileError(path, f"unknown ggml type id {t.type_id}", tensor=t.name)
        if any(d > MAX_DIM for d in t.ne):
            raise ModelFileError(path, f"dimension out of range in ne={list(t.ne)}", tensor=t.name)
        block = GGML_QUANT_SIZES[ggml_type][0]
        row = t.ne[0] if t.ne else 1
        if row % block:
            raise ModelFileError(path, f"row length {row} is not a multiple of {ggml_type.name}'s block size "
                                 f"{block}", tensor=t.name)
        if t.offset % alignment:
            raise ModelFileError(path, f"data offset {t.offset} is not a multiple of the alignment {alignment}",
                                 tensor=t.name)
        start = data_start + t.offset
        end = start + tensor_nbytes(ggml_type, t.ne)
        if end > header.file_size:
            raise ModelFileError(path, f"data [{start}, {end}) extends past the end of the file "
                                 f"({header.file_size} bytes): truncated or a bad offset", tensor=t.name)
        if end > start:
            spans.append((start, end, t.name))
    spans.sort()
    for (_, prev_end, prev), (start, _, name) in itertools.pairwise(spans):
        if start < prev_end:
            raise ModelFileError(path, f"data overlaps tensor {prev!r}", tensor=name)
    return data_start


# ---- 2. a shard set -------------------------------------------------------------------------------------
def check_shard_set(headers: Sequence[Header]) -> None:
    """The shards found by name (NAME-0000i-of-0000N.gguf) must be exactly the set their split keys describe."""
    n = len(headers)
    for i, h in enumerate(headers):
        count = _split_key(h, "split.count", 1)
        if count != n:
            found = f"{n} shard files" if n > 1 else "a file name without the -0000i-of-0000N.gguf shard suffix"
            raise ConfigError(h.path, "split.count", f"says {count} shards, but the model was opened as {found}")
        if _split_key(h, "split.no", 0) != i:
            raise ConfigError(h.path, "split.no", f"is {_split_key(h, 'split.no', 0)}, expected {i} "
                              f"(this file is shard {i + 1} of {n} by its name)")
    total = sum(len(h.tensors) for h in headers)
    owner: dict[str, str] = {}
    for h in headers:
        if "split.tensors.count" in h.metadata and _split_key(h, "split.tensors.count", 0) != total:
            raise ConfigError(h.path, "split.tensors.count", f"says {h.metadata['split.tensors.count']} tensors, "
                              f"the shards hold {total}")
        for t in h.tensors:
            if t.name in owner:
                raise ModelFileError(h.path, f"duplicate tensor: also in shard {owner[t.name]}", tensor=t.name)
            owner[t.name] = h.path


def _split_key(h: Header, key: str, default: int) -> int:
    v = h.metadata.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(h.path, key, f"expected an integer, got {type(v).__name__}")
    return v


# ---- 3. the model -----------------------------------------------------------------------------------------
def check_model(path: str, metadata: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> ModelConfig:
    """Build the ModelConfig and check the extra keys and the whole tensor directory against the schema."""
    cfg = ModelConfig.from_metadata(metadata, path)
    _check_extra_keys(path, cfg, metadata)
    specs = model_tensors(cfg)
    key = f"{cfg.arch}.{STANDALONE_DRAFT_KEY}"
    if metadata.get(key, False):  # a separate DSpark draft file: only the draft stages' tensors
        specs = draft_tensors(cfg)
        if not specs:
            raise ConfigError(path, key, "a draft file needs DSpark keys and nextn_predict_layers > 0 draft stages")
    missing = [name for name in specs if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more, e.g. {missing[1:4]})" if len(missing) > 1 else ""
        raise ModelFileError(path, f"required tensor missing{more}", tensor=missing[0])
    for name, spec in specs.items():
        info = tensors[name]
        if info.shape != spec.shape:
            raise ModelFileError(info.shard, f"shape {info.shape}, expected {spec.shape} (numpy order) for this "
                                 f"config", tensor=name)
        if info.ggml_type not in spec.allowed_types:
            allowed = ", ".join(sorted(t.name for t in spec.allowed_types))
            raise ModelFileError(info.shard, f"type {info.ggml_type.name} not allowed for a {spec.kind.value} "
                                 f"tensor (allowed: {allowed})", tensor=name)
        # Quantized rows are whole blocks: check_tensor_layout checked ne[0] = shape[-1] for every tensor.
    extra = [name for name in tensors if name not in specs]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelFileError(tensors[extra[0]].shard, f"unknown tensor: not in the {cfg.arch} schema for this "
                             f"config{more}", tensor=extra[0])
    return cfg


def _check_extra_keys(path: str, cfg: ModelConfig, metadata: Mapping[str, Any]) -> None:
    """Keys jds41 uses that ModelConfig does not hold: the Engram token map (required with Engram layers) and
    the tokenizer arrays. Other unknown keys are accepted: real files carry general.*, quantize.* and more."""
    key = f"{cfg.arch}.engram.token_map"
    if key in metadata:
        _check_int_array(path, key, metadata[key], cfg.vocab_size, TOKEN_MAP_LIMIT)
    elif cfg.engram is not None:  # the Engram hash starts from it (MODEL.md §3): fail now, not at the first token
        raise ConfigError(path, key, "required key not found (the Engram layers need the token map)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not isinstance(tokens, list) or any(not isinstance(t, str) for t in tokens):
            raise ConfigError(path, "tokenizer.ggml.tokens", "expected an array of strings")
        if len(tokens) != cfg.vocab_size:
            # llama.cpp takes n_vocab from this array, so token_embd/output would not match.
            raise ConfigError(path, "tokenizer.ggml.tokens", f"has {len(tokens)} tokens, vocab_size is "
                              f"{cfg.vocab_size}")
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            v = metadata.get(key)
            if v is not None and (not isinstance(v, list) or len(v) != len(tokens)):
                raise ConfigError(path, key, f"expected an array of {len(tokens)} entries (one per token)")
    model = metadata.get("tokenizer.ggml.model")
    if model is not None and not isinstance(model, str):
        raise ConfigError(path, "tokenizer.ggml.model", "expected a string")


def _check_int_array(path: str, key: str, v: Any, length: int, limit: int) -> None:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ConfigError(path, key, "expected an array of integers")
    if len(v) != length:
        raise ConfigError(path, key, f"has {len(v)} entries, expected {length} (one per vocab entry)")
    if v and (min(v) < 0 or max(v) >= limit):
        raise ConfigError(path, key, f"values must lie in [0, {limit}), got [{min(v)}, {max(v)}]")
