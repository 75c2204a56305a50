"""GGUF model files: the tensor schema, bounded header parsing, validation and the memory-mapped reader.

Public API:
- `open_model(path) -> GGUFModel`: open a file or shard set, validated against the schema; raises ModelFileError.
- `GGUFModel` (`metadata`, `config`, `tensors`, `shards`, `alignment`, `shard_sizes`, `raw`, `typed`, `close`),
  `TensorInfo`, `Shard`.
- `read_header(path) -> Header`: the bounded parse of one file's header, with section offsets (tools, tests).
- `model_tensors(cfg)`, `TensorSpec`, `Kind`: the tensor table a config implies.
"""

from jds41.checkpoints.header import Header, read_header
from jds41.checkpoints.reader import GGUFModel, Shard, TensorInfo, open_model
from jds41.checkpoints.schema import Kind, TensorSpec, model_tensors

__all__ = ["GGUFModel", "Header", "Kind", "Shard", "TensorInfo", "TensorSpec", "model_tensors", "open_model",
           "read_header"]
