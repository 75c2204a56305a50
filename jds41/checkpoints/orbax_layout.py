"""The on-disk format of a jds41 Orbax checkpoint (what `convert` writes and `orbax_model` opens).

A checkpoint directory holds:
- `manifest.json`: format name and version, the hash used, the source GGUF's identity (name, size, mtime, hash of
  its header), and per tensor: GGUF type, numpy shape, bytes, where it is stored and its checksum(s);
- `metadata.json`: the GGUF key/values verbatim (config, tokenizer, chat template), so `ModelConfig.from_metadata`
  and the tokenizer read them unchanged; `config.json`: the resolved ModelConfig, for people;
- `dense/<item>/`: Orbax PyTree checkpoints (zarr2, no OCDBT, no compression: each array is one plain chunk
  file, so a flipped byte is a checksum mismatch naming the tensor, not an opaque decompression error). One item
  per layer (split when it passes the piece bound), quantized tensors as raw uint8 rows `[n_rows, row_bytes]`
  (nothing is re-quantized), unquantized ones in their own dtype and shape;
- `experts.bin`: every routed expert of every layer as one chunk gate|up|down, each chunk starting on a 4 KiB
  boundary and padded to a multiple of 4 KiB (stride), layers one after another: expert e of layer l sits at
  `base[l] + e * stride[l]`, so one O_DIRECT read fetches it (DESIGN.md §6; Orbax's own defaults, OCDBT + zstd
  with one chunk per array, would make one expert cost the whole stack, §7);
- `engram.bin`: the Engram tables as raw rows, each table 4 KiB-aligned (read by row offset like the GGUF);
- while converting only: `journal.jsonl` (pieces done, with their checksums) and `plan.json`. A directory that
  still holds a journal is an unfinished conversion and never opens.

Checksums are SHA-256 (hashlib; with the CPU's SHA extensions it runs at 1.2 GB/s per core on the CI box
against 0.4-0.5 GB/s for BLAKE2b, and hashing bounds the restore): one per dense tensor, one per expert chunk (its
unpadded bytes), one per Engram part of `ROWS_PART_BYTES`, one for metadata.json. They hash the GGUF bytes as read
from the source, so a verified checkpoint holds exactly the source's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any

import numpy as np

from jds41.checkpoints.schema import Kind, model_tensors
from jds41.errors import ModelFileError

FORMAT = "jds41-orbax"
VERSION = 2  # 2: SHA-256 checksums (1 had BLAKE2b-128)
HASH = "sha256"
ALIGN = 4096
MANIFEST, METADATA, CONFIG = "manifest.json", "metadata.json", "config.json"
JOURNAL, PLAN = "journal.jsonl", "plan.json"
DENSE_DIR, EXPERTS_FILE, ROWS_FILE = "dense", "experts.bin", "engram.bin"
PARTIAL_SUFFIX = ".partial"
ROWS_PART_BYTES = 64 << 20
DEFAULT_PIECE_BYTES = 256 << 20  # bounds the bytes one piece holds in memory (dense item, expert batch)
EXPERT_KINDS = ("gate", "up", "down")
_STACK = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def digest(data) -> str:
    """SHA-256 hex of a buffer (numpy array, bytes, memoryview); hashlib releases the GIL on large buffers."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return hashlib.sha256(memoryview(data)).hexdigest()


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def stack_of(name: str) -> tuple[int, str] | None:
    """`blk.L.ffn_{gate,up,down}_exps.weight` -> (L, kind), else None."""
    m = _STACK.match(name)
    return (int(m[1]), m[2]) if m else None


def orbax_key(name: str) -> str:
    """The pytree key of a tensor inside its item: Orbax joins nested keys with '.', so dots are replaced."""
    return name.replace(".", "__")


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """Where layer `layer`'s expert chunks sit in experts.bin."""

    layer: int
    base: int
    stride: int
    n_experts: int
    piece_bytes: tuple[int, int, int]  # gate, up, down bytes of one expert

    @property
    def expert_bytes(self) -> int:
        return sum(self.piece_bytes)

    def chunk_offset(self, expert: int) -> int:
        return self.base + expert * self.stride

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ExpertLayer:
        return cls(int(d["layer"]), int(d["base"]), int(d["stride"]), int(d["n_experts"]),
                   tuple(int(x) for x in d["piece_bytes"]))


def tensor_entry(info) -> dict:
    return {"type": info.ggml_type.name, "shape": list(info.shape), "n_bytes": int(info.n_bytes)}


def plan_layout(model, piece_bytes: int = DEFAULT_PIECE_BYTES) -> dict:
    """The whole layout of a checkpoint for an open GGUFModel, before any byte is written: tensor table (without
    checksums), dense items, expert layers and Engram tables. Deterministic, so a resumed conversion recomputes
    the same plan and a mismatch means the source or the settings changed."""
    specs = model_tensors(model.config)
    tensors: dict[str, dict] = {}
    items: dict[str, list[str]] = {}
    item_bytes: dict[str, int] = {}
    stacks: dict[int, dict[str, Any]] = {}
    rows_at = 0
    for name, info in model.tensors.items():
        entry = tensor_entry(info)
        stack = stack_of(name)
        if stack is not None:
            stacks.setdefault(stack[0], {})[stack[1]] = info
            entry.update(store="experts", layer=stack[0], kind=stack[1])
        elif name in specs and specs[name].kind is Kind.ROWS:
            entry.update(store="rows", offset=rows_at, part_bytes=ROWS_PART_BYTES)
            rows_at = round_up(rows_at + info.n_bytes)
        else:
            group = f"blk.{name.split('.')[1]}" if name.startswith("blk.") else "globals"
            # Split a group when it would pass the bound; a tensor larger than the bound is an item by itself.
            part = 0
            while item_bytes.get(f"{group}.{part}", 0) and item_bytes[f"{group}.{part}"] + info.n_bytes > piece_bytes:
                part += 1
            item = f"{group}.{part}"
            items.setdefault(item, []).append(name)
            item_bytes[item] = item_bytes.get(item, 0) + info.n_bytes
            entry.update(store="orbax", item=item, key=orbax_key(name))
        tensors[name] = entry
    layers, at = [], 0
    for layer in sorted(stacks):
        by_kind = stacks[layer]
        if set(by_kind) != set(EXPERT_KINDS):
            raise ValueError(f"layer {layer}: expert stacks {sorted(by_kind)} are incomplete")
        n_exp = {by_kind[k].shape[0] for k in EXPERT_KINDS}
        if len(n_exp) != 1 or any(by_kind[k].n_bytes % by_kind[k].shape[0] for k in EXPERT_KINDS):
            raise ValueError(f"layer {layer}: expert stacks disagree on the expert count or do not split evenly")
        E = n_exp.pop()
        pieces = tuple(by_kind[k].n_bytes // E for k in EXPERT_KINDS)
        stride = round_up(sum(pieces))
        layers.append(ExpertLayer(layer, at, stride, E, pieces))
        at += E * stride
    return {"tensors": tensors, "items": items, "expert_layers": [x.to_json() for x in layers],
            "experts_bytes": at, "rows_bytes": rows_at, "piece_bytes": int(piece_bytes)}


def source_identity(model) -> dict:
    """What identifies the GGUF a checkpoint came from without reading its data: name, sizes, mtimes and a hash
    of each shard's header (metadata and tensor directory: everything before the data section)."""
    shards = []
    for s in model.shards:
        with open(s.path, "rb") as f:
            head = f.read(s.data_start)
        st = os.stat(s.path)
        shards.append({"file": os.path.basename(s.path), "size": s.size, "mtime_ns": st.st_mtime_ns,
                       "header_digest": digest(head)})
    return {"file": os.path.basename(model.path), "size": sum(s.size for s in model.shards), "shards": shards}


def read_range(path: str, offset: int, n: int) -> np.ndarray:
    """n bytes at offset, plain pread into a fresh buffer (no memory map: mapped pages would count as our memory)."""
    buf = np.empty(n, np.uint8)
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < n:
            k = os.preadv(f.fileno(), [memoryview(buf)[got:]], offset + got)
            if k <= 0:
                raise ModelFileError(path, f"short read: {got} of {n} bytes at offset {offset}")
            got += k
    return buf


def write_json(path: str, obj: Any) -> None:
    """Write and fsync (the conversion's durability rests on every file it records being on disk)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a rename or a new entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)
