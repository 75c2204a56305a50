"""Load a GGUF file's tensors as the numpy reference's weights dict: gguf-py's reader and dequantizer, numpy shapes.

    load_weights(path) -> {name: array}: float tensors dequantized to float64 in numpy (row-major) shape, integer
    tensors (tid2eid) as int64, Engram tables (I8 rows) as their raw uint8 bytes.
    load_token_map(path) -> int64 [V] Engram token map (`{arch}.engram.token_map`), or None when absent.

Uses gguf.GGUFReader + gguf.quants.dequantize only, never jds41's reader, so the reference path stays independent
of the engine's loader (the types gguf-py cannot dequantize, Q2_K / Q4_K / IQ2_XXS among them, raise there).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

_INTEGER = {T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}


def load_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    out = {}
    for t in gguf.GGUFReader(os.fspath(path)).tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # t.shape is ggml's ne order
        if t.tensor_type == T.I8 and t.name.endswith("engram_embd.weight"):
            out[t.name] = np.asarray(t.data).view(np.uint8).reshape(shape)
        elif t.tensor_type in _INTEGER:
            out[t.name] = np.asarray(t.data).view(_INTEGER[t.tensor_type]).reshape(shape).astype(np.int64)
        else:
            out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
    return out


def load_token_map(path: str | os.PathLike) -> np.ndarray | None:
    reader = gguf.GGUFReader(os.fspath(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields.get(f"{arch}.engram.token_map")
    if field is None:
        return None
    return np.array([int(field.parts[i][0]) for i in field.data], dtype=np.int64)
