"""Opening a GGUF model: one file or a `NAME-0000i-of-0000N.gguf` shard set, validated, memory-mapped.

`open_model(path)` parses every shard's header with the bounded parser (`header.py`), validates layout, shard set
and model (`validate.py`), and only then memory-maps the files. The result, `GGUFModel`, holds:
- `metadata`: shard 1's key/values as plain Python values; `config`: the validated `ModelConfig`;
- `tensors`: the merged directory, name -> `TensorInfo` (ggml type, numpy shape, bytes, shard path and the
  absolute byte offset of the data in that shard: the SSD tier O_DIRECT-reads experts at these offsets);
- zero-copy views backed by the memory maps: `raw(name)` as uint8 rows, `typed(name)` for unquantized types;
- `shards` (path, size, alignment, data start) and `alignment`, the alignment every tensor offset honours.

Any exception while opening, expected or not, leaves as a ModelFileError naming the file: a model file never
crashes the caller with an arbitrary exception type.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Self

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jds41.checkpoints import validate
from jds41.checkpoints.header import Header, known_ggml_type, read_header, tensor_nbytes
from jds41.config import ModelConfig
from jds41.errors import Jds41Error, ModelFileError

# gguf-py's GGUFWriter and llama.cpp's gguf-split both name shard i (1-based) of n like this.
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_TYPED_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16), GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("i1"), GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"), GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: shard path and absolute offset; shape in numpy order."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy (row-major) order, the reverse of ggml's ne
    n_bytes: int
    shard: str
    offset: int  # absolute byte offset of the data in `shard`

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last numpy axis): whole quant blocks."""
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return (self.shape[-1] if self.shape else 1) // block * type_size

    @property
    def n_rows(self) -> int:
        return self.n_bytes // self.row_bytes if self.row_bytes else 0


@dataclasses.dataclass(frozen=True)
class Shard:
    """One file of the model."""

    path: str
    size: int
    alignment: int  # its own general.alignment or 32: every file of a set describes itself
    data_start: int  # absolute offset of its data section
    n_tensors: int


class GGUFModel:
    """An open, validated GGUF model. Use as a context manager or call `close()`."""

    def __init__(self, shards: tuple[Shard, ...], metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 config: ModelConfig, maps: dict[str, np.memmap]):
        self.shards = shards
        self.metadata = metadata
        self.tensors = tensors
        self.config = config
        self._maps: dict[str, np.memmap] | None = maps

    @property
    def path(self) -> str:
        """The first shard (the file holding the metadata)."""
        return self.shards[0].path

    @property
    def alignment(self) -> int:
        """Every tensor's absolute offset is a multiple of this (the smallest shard alignment)."""
        return min(s.alignment for s in self.shards)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(s.size for s in self.shards)

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy, read-only uint8 view of a tensor's bytes, shaped (rows, row_bytes)."""
        info = self._info(name)
        return self._bytes(info).reshape(info.n_rows, info.row_bytes)

    def typed(self, name: str) -> np.ndarray:
        """Zero-copy, read-only view in the tensor's own dtype and numpy shape (F32/F16/BF16/F64/I8/I16/I32/I64)."""
        info = self._info(name)
        dtype = _TYPED_DTYPES.get(info.ggml_type)
        if dtype is None:
            raise TypeError(f"tensor {name!r} is {info.ggml_type.name}: quantized, use raw() and jds41.quant")
        return self._bytes(info).view(dtype).reshape(info.shape)

    def close(self) -> None:
        """Drop the memory maps. Views handed out earlier keep their map alive until they are freed (numpy
        holds a reference), so closing never invalidates memory someone still reads."""
        self._maps = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._maps is None else f"{len(self.tensors)} tensors"
        return f"GGUFModel({self.path!r}, {self.config.arch}, {len(self.shards)} shard(s), {state})"

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        if self._maps is None:
            raise ValueError(f"{self.path}: model is closed")
        return self._maps[info.shard][info.offset:info.offset + info.n_bytes].view(np.ndarray)


def open_model(path: str | os.PathLike) -> GGUFModel:
    """Open and validate a GGUF model (any shard's path opens the whole set), or a directory written by
    `python -m jds41.checkpoints.convert` (an OrbaxModel, same interface). Raises ModelFileError only."""
    path = str(path)
    if os.path.isdir(path):
        from jds41.checkpoints.orbax_model import open_checkpoint  # Orbax and its deps load only for checkpoints

        return open_checkpoint(path)
    try:
        return _open(path)
    except Jds41Error:
        raise
    except Exception as e:  # the contract: a bad file never surfaces as another exception type
        raise ModelFileError(path, f"unexpected {type(e).__name__} while opening: {e}") from e


def shard_paths(path: str) -> list[str]:
    """All files of the model that `path` belongs to, in shard order; checks that each exists."""
    m = SHARD_NAME.match(os.path.basename(path))
    if m is None:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count:
        raise ModelFileError(path, f"shard number {no} out of range 1..{count} in the file name")
    folder = os.path.dirname(path)
    paths = [os.path.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, p in enumerate(paths, 1):
        if not os.path.isfile(p):
            raise ModelFileError(p, f"missing shard {i} of {count} (opening {os.path.basename(path)})")
    return paths


def _open(path: str) -> GGUFModel:
    headers: list[Header] = []
    shards: list[Shard] = []
    for p in shard_paths(path):
        h = read_header(p)
        alignment = validate.check_alignment(h)
        data_start = validate.check_tensor_layout(h, alignment)
        headers.append(h)
        shards.append(Shard(p, h.file_size, alignment, data_start, len(h.tensors)))
    validate.check_shard_set(headers)

    tensors: dict[str, TensorInfo] = {}
    for h, shard in zip(headers, shards):
        for t in h.tensors:
            ggml_type = known_ggml_type(t.type_id)  # known: check_tensor_layout refused the others
            tensors[t.name] = TensorInfo(t.name, ggml_type, tuple(reversed(t.ne)), tensor_nbytes(ggml_type, t.ne),
                                         shard.path, shard.data_start + t.offset)
    metadata = headers[0].metadata
    config = validate.check_model(shards[0].path, metadata, tensors)

    maps: dict[str, np.memmap] = {}
    for shard in shards:
        mm = np.memmap(shard.path, mode="r")
        if mm.size != shard.size:  # replaced or truncated since its header was checked
            raise ModelFileError(shard.path, f"file changed while opening ({shard.size} -> {mm.size} bytes)")
        maps[shard.path] = mm
    return GGUFModel(tuple(shards), metadata, tensors, config, maps)
