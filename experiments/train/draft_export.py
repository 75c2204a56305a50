"""Export trained drafter weights to a separate DSpark draft GGUF, the file `DSparkDrafter.open(engine, path)` loads.

The file holds exactly `schema.draft_tensors(dcfg)` (the `mtp.{s}.*` tensors; the embedding and output head stay the
target's) and the keys of the draft config (the target's keys, `nextn_predict_layers` = stages, the DSpark keys with
the draft's expert pool, `{arch}.dspark.standalone` = true), so `check_compatible` finds the target's main-model
config in it. The target's tokenizer and Engram token map are copied verbatim (with their GGUF value types) from the
target file: the validator requires the token map whenever the config has Engram layers, and a draft file that
names its tokenizer can be checked against a target by eye.

Storage as export.py stores the same kinds of tensors (ds4's layout): routed experts MXFP4 (or Q8_0), attention,
shared expert and `main_proj` Q8_0, router and hc matrices F16, norms / vectors / hc base and scale F32; the
Markov and confidence heads are small matrices (rows of `markov_rank`), which the schema keeps float: F32.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from experiments.train.draft_train import short_name
from experiments.train.export import _add, decode, encode, tensor_storage_types
from jds41.checkpoints.reader import shard_paths
from jds41.checkpoints.schema import STANDALONE_DRAFT_KEY, draft_tensors
from jds41.checkpoints.synth import tensor_nbytes
from jds41.config import ModelConfig


def storage_types(dcfg: ModelConfig, experts: str = "mxfp4") -> dict[str, T]:
    """GGUF type of every draft tensor."""
    return tensor_storage_types(draft_tensors(dcfg), experts)


def plan_bytes(dcfg: ModelConfig, experts: str = "mxfp4") -> int:
    types = storage_types(dcfg, experts)
    return sum(tensor_nbytes(spec.shape, types[name]) for name, spec in draft_tensors(dcfg).items())


def quantized_draft(dcfg: ModelConfig, params: dict, buffers: dict, experts: str = "mxfp4"
                    ) -> tuple[dict[str, np.ndarray], dict[str, T], dict, dict]:
    """(stored arrays by GGUF name, types, decoded params tree, decoded buffers tree): the decoded trees hold the
    values the engine will read from the file, in draft_train.py's layout."""
    types = storage_types(dcfg, experts)
    stored: dict[str, np.ndarray] = {}
    dec_p: dict = {"stages": [{} for _ in params["stages"]]}
    dec_b: dict = {"stages": [{} for _ in params["stages"]]}
    for name, spec in draft_tensors(dcfg).items():
        s, short = short_name(dcfg, name)
        tree = buffers if short == "exp_probs_b" else params
        value = np.asarray(tree["stages"][s][short], np.float32)
        if value.shape != spec.shape:
            raise ValueError(f"{name}: parameter shape {value.shape}, schema says {spec.shape}")
        stored[name] = encode(value, types[name])
        (dec_b if short == "exp_probs_b" else dec_p)["stages"][s][short] = decode(stored[name], types[name],
                                                                                 spec.shape)
    return stored, types, dec_p, dec_b


def _copied_fields(target_path: str, arch: str) -> list[tuple[str, object, gguf.GGUFValueType, object]]:
    """(key, value, type, array item type) of the target's tokenizer and Engram token-map keys."""
    reader = gguf.GGUFReader(shard_paths(os.fspath(target_path))[0])
    want = (f"{arch}.engram.token_map", f"{arch}.engram.compressed_vocab_size")
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key in want:
            typ = field.types[0]
            sub = field.types[-1] if typ == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), typ, sub))
    return out


def write_draft_gguf(path: str | os.PathLike, dcfg: ModelConfig, stored: dict[str, np.ndarray], types: dict[str, T],
                     target_path: str, extra: dict[str, tuple] | None = None) -> str:
    """Write the draft file (one file; a few MiB for the small model); returns its path."""
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, dcfg.arch)
    w.data_alignment = dcfg.alignment
    for key, value, typ in dcfg.to_metadata():
        if key != "general.architecture":
            _add(w, key, value, typ)
    for key, value, typ, sub in _copied_fields(target_path, dcfg.arch):
        if typ == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, list(value), typ, sub_type=sub)
        else:
            w.add_key_value(key, value, typ)
    _add(w, f"{dcfg.arch}.{STANDALONE_DRAFT_KEY}", True, "bool")
    for key, (value, typ) in (extra or {}).items():
        _add(w, key, value, typ)
    for name in draft_tensors(dcfg):
        w.add_tensor(name, stored[name], raw_dtype=types[name] if stored[name].dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path
