"""Helpers for the GGUF reader tests: locate header fields, patch bytes, copy a model with edits or as shards.

Positions always come from parsing the file (`read_header` reports where each key/value entry and tensor-info
record starts); the field offsets inside a record follow the GGUF format, so no test hard-codes a byte offset.
`copy_model` rewrites a valid model through gguf-py's GGUFWriter with keys or tensors dropped, replaced or added,
optionally split into shards (for what byte patches cannot do: removing a tensor, adding one, changing a type's
size).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from jds41.checkpoints import Header, open_model, read_header

DROP = object()  # value for `keys` / `tensors` in copy_model: leave this one out


# ---- field positions ----------------------------------------------------------------------------------------
def key_field(header: Header, key: str, field: str) -> int:
    """Absolute offset of a field of one key/value entry: key_len, key, type, value (or, for arrays,
    item_type and length)."""
    e = header.keys[key]
    return {"key_len": e.offset, "key": e.offset + 8, "type": e.value_offset - 4, "value": e.value_offset,
            "item_type": e.value_offset, "length": e.value_offset + 4}[field]


def tensor_field(header: Header, name: str, field: str) -> int:
    """Absolute offset of a field of one tensor-info record: name_len, name, n_dims, ne0, type, offset."""
    t = next(t for t in header.tensors if t.name == name)
    name_end = t.info_offset + 8 + len(name.encode())
    dims_end = name_end + 4 + 8 * len(t.ne)
    return {"name_len": t.info_offset, "name": t.info_offset + 8, "n_dims": name_end, "ne0": name_end + 4,
            "type": dims_end, "offset": dims_end + 4}[field]


def data_start(header: Header, alignment: int) -> int:
    return -(-header.tensor_info_end // alignment) * alignment


def patch(data: bytes, pos: int, fmt: str, *values: Any) -> bytes:
    """`data` with struct-packed `values` written at `pos` (a struct format, little-endian unless it says)."""
    raw = struct.pack(fmt if fmt[0] in "<>!=@" else "<" + fmt, *values)
    return data[:pos] + raw + data[pos + len(raw):]


def write_bytes(path: Path, data: bytes) -> Path:
    """Write through a fresh inode: a model opened earlier from `path` keeps mapping the old bytes."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


# ---- rewriting ------------------------------------------------------------------------------------------------
class _Writer(gguf.GGUFWriter):
    """GGUFWriter that also puts `general.alignment` into shards 2..N.

    gguf-py writes the key only into shard 1 yet pads every shard's data to the custom alignment, so readers of
    shard 2 (gguf-py, llama.cpp, jds41) would assume the default 32 and read the wrong bytes.
    """

    def add_shard_kv_data(self) -> None:
        super().add_shard_kv_data()
        if self.data_alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
            for kv in self.kv_data[1:]:
                kv["general.alignment"] = gguf.GGUFValue(self.data_alignment, GGUFValueType.UINT32)


def copy_model(src: str | Path, dst: str | Path, *, keys: Mapping[str, Any] | None = None,
               tensors: Mapping[str, Any] | None = None, split_max_tensors: int = 0) -> list[str]:
    """Copy a valid model with edits; returns the written paths (one per shard).

    keys: name -> DROP | (value, GGUFValueType[, item type]); new names are appended.
    tensors: name -> DROP | (array, ggml type) where a quantized array is raw uint8 (..., row_bytes); new names
    are appended. Everything else is copied byte for byte, in file order.
    """
    keys, tensors = dict(keys or {}), dict(tensors or {})
    with open_model(src) as model:
        header_types = _key_types(model.path)
        meta = {k: (v, *header_types[k]) for k, v in model.metadata.items() if not k.startswith("split.")}
        for k, v in keys.items():
            if v is DROP:
                meta.pop(k, None)
            else:
                meta[k] = v
        # An empty arch makes GGUFWriter skip its own general.architecture key: the file's (or the edit's) is
        # written in its place, with its type.
        w = _Writer(str(dst), "", split_max_tensors=split_max_tensors)
        if "general.alignment" in meta:
            a = meta["general.alignment"][0]
            if isinstance(a, int) and a > 0 and a & (a - 1) == 0:
                w.data_alignment = a  # pad the data to what the (possibly retyped) key says
        for k, (value, vtype, *item) in meta.items():
            w.add_key_value(k, value, vtype, sub_type=item[0] if item else None)
        for name, info in model.tensors.items():
            new = tensors.pop(name, None)
            if new is DROP:
                continue
            if new is None:
                new = (model.raw(name).reshape(*info.shape[:-1], info.row_bytes), info.ggml_type)
            _add_tensor(w, name, *new)
        for name, new in tensors.items():
            _add_tensor(w, name, *new)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return [str(p) for p in w.format_shard_names(Path(dst))]


def _add_tensor(w: gguf.GGUFWriter, name: str, array: np.ndarray, ggml_type: GGMLQuantizationType) -> None:
    array = np.ascontiguousarray(array)
    if array.dtype != np.uint8:  # typed values: hand gguf-py their bytes, it derives the shape from the type
        array = array.view(np.uint8).reshape(*array.shape[:-1], -1)
    w.add_tensor(name, array, raw_dtype=ggml_type)


def _key_types(path: str) -> dict[str, tuple]:
    return {k: (e.value_type,) if e.item_type is None else (e.value_type, e.item_type)
            for k, e in read_header(path).keys.items()}
