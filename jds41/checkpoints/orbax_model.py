"""Opening a jds41 Orbax checkpoint (orbax_layout.py) as an object with the GGUFModel interface.

`open_checkpoint(dir)` gives an `OrbaxModel` with what the engine, the weights table, the tiers and the server use
from a GGUFModel: `path`, `metadata` (the GGUF key/values, verbatim), `config`, `tensors` (TensorInfo per tensor),
`shards`, `alignment`, `raw(name)`, `typed(name)`, plus:
- `restore(names, memory_kind=None)`: dense tensors straight from Orbax, as numpy (host) or as jax arrays in a
  `SingleDeviceSharding` of memory kind `device` or `pinned_host` (a backend without `pinned_host` gets device
  memory and a warning: the bytes are the same, only where they sit moves);
- `load_tensors(names, ...)`: what `jds41.tiers.loader.load_tensors` returns for a GGUF (it dispatches here):
  dense tensors restored from Orbax, routed stacks assembled from their chunks with O_DIRECT reads;
- `check_expert(key, pieces)`: the chunk checksum, which `ExpertLayout.from_model` hands to the SSD reader.

Verification, and why it is split so: opening checks the format, the metadata's checksum, every file's size and
the tensor directory against the schema (cheap, always). Dense tensors are hashed when restored to the host (the
engine's path; a device restore with `verify=True` hashes a host copy). Expert chunks are hashed by default the
first time each is read (`verify="first"`): the SSD tier re-reads a chunk after every eviction, and hashing every
read would cost as much CPU as the read itself; "always" and "off" exist. Engram tables, read row by row, are
checked by `verify_all()` (`python -m jds41.checkpoints.convert --verify DIR`). A mismatch raises ModelFileError
naming the tensor (and, for a chunk, the layer and expert); the SSD reader reports it as an ExpertReadError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
from gguf import GGMLQuantizationType

from jds41.checkpoints import orbax_layout as F
from jds41.checkpoints import validate
from jds41.checkpoints.reader import _TYPED_DTYPES, Shard, TensorInfo
from jds41.errors import Jds41Error, ModelFileError

SMALL_TENSOR_BYTES = 1 << 20  # typed()/raw() of a tensor this small restores every small tensor of its item at once
VERIFY_MODES = ("first", "always", "off")


@dataclasses.dataclass(frozen=True)
class ExpertStackInfo(TensorInfo):
    """A routed stack in experts.bin: expert e's piece of it is at `offset + e * expert_stride` (the chunk stride),
    not contiguous with expert e+1 as in a GGUF."""

    expert_stride: int = 0


def item_handler():
    """The Orbax checkpointer of dense items: zarr2 without OCDBT or compression (one plain chunk file per array)."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False, use_compression=False))


class OrbaxModel:
    """An open, validated Orbax checkpoint. Use as a context manager or call `close()`."""

    def __init__(self, path: str, manifest: dict, metadata: dict, verify: str = "first"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.path, self.manifest, self.metadata, self.verify = path, manifest, metadata, verify
        self.experts_path = os.path.join(path, F.EXPERTS_FILE)
        self.rows_path = os.path.join(path, F.ROWS_FILE)
        self.expert_layers = {int(d["layer"]): F.ExpertLayer.from_json(d) for d in manifest["expert_layers"]}
        self.tensors = {name: self._info(name, e) for name, e in manifest["tensors"].items()}
        self.config = validate.check_model(path, metadata, self.tensors)
        self.shards = tuple(Shard(p, os.path.getsize(p), F.ALIGN, 0, 0) for p in _files(path))
        self._small: dict[str, np.ndarray] = {}
        self._verified: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._rows_map: np.memmap | None = None
        self._ckptr = None
        self._closed = False

    # ---- the GGUFModel interface -----------------------------------------------------------------------------
    @property
    def alignment(self) -> int:
        return F.ALIGN

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(s.size for s in self.shards)

    def raw(self, name: str) -> np.ndarray:
        """uint8 rows `[n_rows, row_bytes]` exactly as GGUFModel.raw gives them (Engram tables zero-copy)."""
        info = self._get(name)
        entry = self.manifest["tensors"][name]
        if entry["store"] == "rows":
            return self._rows()[info.offset:info.offset + info.n_bytes].view(np.ndarray).reshape(info.n_rows,
                                                                                                  info.row_bytes)
        if entry["store"] == "experts":
            return self._stack(name).reshape(info.n_rows, info.row_bytes)
        return _as_rows(self._dense(name), info)

    def typed(self, name: str) -> np.ndarray:
        info = self._get(name)
        dtype = _TYPED_DTYPES.get(info.ggml_type)
        if dtype is None:
            raise TypeError(f"tensor {name!r} is {info.ggml_type.name}: quantized, use raw() and jds41.quant")
        return self.raw(name).reshape(-1).view(dtype).reshape(info.shape)

    def close(self) -> None:
        self._closed, self._rows_map, self._small = True, None, {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OrbaxModel({self.path!r}, {self.config.arch}, {len(self.tensors)} tensors)"

    # ---- dense tensors from Orbax ----------------------------------------------------------------------------
    def restore(self, names: Sequence[str], memory_kind: str | None = None, verify: bool = True,
                device=None) -> dict[str, Any]:
        """Dense tensors by name, one partial Orbax restore per item: numpy arrays (memory_kind None) or jax
        arrays placed in `memory_kind` ("device" or "pinned_host") of `device`. Quantized tensors come as their
        raw uint8 rows, the others in their own dtype and shape."""
        import jax
        import orbax.checkpoint as ocp

        sharding = None
        if memory_kind is not None:
            device = device or jax.devices()[0]
            kinds = {m.kind for m in device.addressable_memories()}
            if memory_kind not in kinds:
                if memory_kind != "pinned_host":
                    raise ValueError(f"{device.platform} has no memory kind {memory_kind!r} (has {sorted(kinds)})")
                warnings.warn(f"{device.platform} has no pinned_host memory: restoring into device memory",
                              stacklevel=2)
                memory_kind = "device"
            sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
        by_item: dict[str, list[str]] = {}
        for name in dict.fromkeys(names):
            entry = self.manifest["tensors"].get(name)
            if entry is None or entry["store"] != "orbax":
                raise ModelFileError(self.path, "not a dense (Orbax) tensor of this checkpoint", tensor=name)
            by_item.setdefault(entry["item"], []).append(name)
        out = {}
        for item, item_names in by_item.items():
            template, args = {}, {}
            for name in item_names:
                key, (shape, dtype) = self.manifest["tensors"][name]["key"], _stored_shape(self.tensors[name])
                if sharding is None:
                    template[key], args[key] = np.empty(0, dtype), ocp.RestoreArgs(restore_type=np.ndarray)
                else:
                    template[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                    args[key] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
            where = os.path.join(self.path, F.DENSE_DIR, item)
            try:
                got = self._checkpointer().restore(where, args=ocp.args.PyTreeRestore(
                    item=template, restore_args=args, partial_restore=True))
            except Exception as e:  # noqa: BLE001 - a damaged item must name itself, whatever Orbax raised
                raise ModelFileError(where, f"Orbax restore failed: {type(e).__name__}: {e}",
                                     tensor=item_names[0]) from e
            for name in item_names:
                arr = got[self.manifest["tensors"][name]["key"]]
                if verify:
                    self._check_dense(name, np.asarray(arr))
                out[name] = arr
        return out

    def _check_dense(self, name: str, arr: np.ndarray) -> None:
        info, entry = self.tensors[name], self.manifest["tensors"][name]
        if arr.nbytes != info.n_bytes or F.digest(arr) != entry["digest"]:
            where = os.path.join(self.path, F.DENSE_DIR, entry["item"], entry["key"])
            raise ModelFileError(where, f"checksum mismatch: the stored bytes are not the converted ones "
                                        f"({arr.nbytes} bytes)", tensor=name)

    def _dense(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.n_bytes > SMALL_TENSOR_BYTES:
            return self.restore([name])[name]
        with self._lock:
            if name not in self._small:
                item = self.manifest["tensors"][name]["item"]
                small = [n for n, e in self.manifest["tensors"].items()
                         if e["store"] == "orbax" and e["item"] == item and e["n_bytes"] <= SMALL_TENSOR_BYTES]
                self._small.update(self.restore(small))
            return self._small[name]

    def _checkpointer(self):
        if self._ckptr is None:
            self._ckptr = item_handler()
        return self._ckptr

    # ---- routed experts and Engram rows from the raw files ---------------------------------------------------
    def check_expert(self, key: tuple[int, int], pieces: Sequence[np.ndarray], force: bool = False) -> str | None:
        """None when expert `key`'s gate|up|down bytes hash to its chunk checksum (or need no check under the
        verify mode, unless `force`), else the reason, naming the tensors. Thread-safe (the SSD reader calls it
        from its pool)."""
        layer, expert = key
        if not force:
            if self.verify == "off":
                return None
            with self._lock:
                if self.verify == "first" and key in self._verified:
                    return None
        h = hashlib.sha256()
        for p in pieces:
            h.update(memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8)))
        if h.hexdigest() != self.manifest["expert_chunks"][str(layer)][expert]:
            return (f"checksum mismatch in the chunk of expert {expert} of blk.{layer}.ffn_{{gate,up,down}}_exps"
                    f".weight (at offset {self.expert_layers[layer].chunk_offset(expert)})")
        with self._lock:
            self._verified.add(key)
        return None

    def expert_reader(self, **kw):
        from jds41.tiers.ssd import ExpertReader
        from jds41.tiers.stores import ExpertLayout

        return ExpertReader(ExpertLayout.from_model(self), **kw)

    def _stack(self, name: str) -> np.ndarray:
        """One routed stack `[E, piece]` assembled from the chunks (each checked like any read)."""
        info, entry = self.tensors[name], self.manifest["tensors"][name]
        return self._read_stacks(entry["layer"])[entry["kind"]].reshape(info.n_rows, info.row_bytes)

    def _read_stacks(self, layer: int) -> dict[str, np.ndarray]:
        from jds41.checkpoints.orbax_stacks import read_layer_stacks

        return read_layer_stacks(self.experts_path, self.expert_layers[layer], self.check_expert)

    def _rows(self) -> np.memmap:
        if self._closed:
            raise ValueError(f"{self.path}: checkpoint is closed")
        if self._rows_map is None:
            self._rows_map = np.memmap(self.rows_path, mode="r")
        return self._rows_map

    def load_tensors(self, names: Sequence[str], *, progress: bool = True, sharding=None, **_ignored):
        """The loader's result (jds41.tiers.loader.LoadResult) for `names`: dense ones restored from Orbax and
        verified, routed stacks read from their chunks with O_DIRECT and verified; uint8 rows like `raw`."""
        import jax
        from tqdm import tqdm

        from jds41.tiers.loader import LoadResult

        t0 = time.perf_counter()
        names = list(dict.fromkeys(names))
        dense = [n for n in names if self.manifest["tensors"][n]["store"] == "orbax"]
        layers = sorted({self.manifest["tensors"][n]["layer"] for n in names
                         if self.manifest["tensors"][n]["store"] == "experts"})
        arrays: dict[str, Any] = {}
        items = list(dict.fromkeys(self.manifest["tensors"][n]["item"] for n in dense))
        bar = tqdm(total=len(items) + len(layers), desc="restoring", unit="piece", disable=not progress)
        direct = True
        for item in items:
            item_names = [n for n in dense if self.manifest["tensors"][n]["item"] == item]
            for n, a in self.restore(item_names).items():
                arrays[n] = _as_rows(a, self.tensors[n])
            bar.update()
        for layer in layers:
            stacks = self._read_stacks(layer)
            for kind, buf in stacks.items():
                name = f"blk.{layer}.ffn_{kind}_exps.weight"
                if name in names:
                    arrays[name] = buf.reshape(self.tensors[name].n_rows, self.tensors[name].row_bytes)
            bar.update()
        bar.close()
        if sharding is not None:
            arrays = {n: jax.device_put(a, sharding) for n, a in arrays.items()}
        total = sum(self.tensors[n].n_bytes for n in arrays)
        return LoadResult(arrays, total, time.perf_counter() - t0, direct)

    # ---- full verification -----------------------------------------------------------------------------------
    def verify_all(self) -> dict:
        """Hash every stored byte against the manifest; raises ModelFileError naming the first bad tensor."""
        counts = {"dense": 0, "expert_chunks": 0, "row_parts": 0}
        items: dict[str, list[str]] = {}
        for name, e in self.manifest["tensors"].items():
            if e["store"] == "orbax":
                items.setdefault(e["item"], []).append(name)
            elif e["store"] == "rows":
                for i, want in enumerate(e["digest"]):
                    lo = i * e["part_bytes"]
                    n = min(e["part_bytes"], e["n_bytes"] - lo)
                    if F.digest(F.read_range(self.rows_path, e["offset"] + lo, n)) != want:
                        raise ModelFileError(self.rows_path, f"checksum mismatch in part {i} (bytes {lo}..{lo + n})",
                                             tensor=name)
                    counts["row_parts"] += 1
        for item_names in items.values():
            counts["dense"] += len(self.restore(item_names))
        for layer, el in self.expert_layers.items():
            for expert in range(el.n_experts):
                data = F.read_range(self.experts_path, el.chunk_offset(expert), el.expert_bytes)
                reason = self.check_expert((layer, expert), [data], force=True)
                if reason:
                    raise ModelFileError(self.experts_path, reason, tensor=f"blk.{layer}.ffn_gate_exps.weight")
                counts["expert_chunks"] += 1
        return counts

    # ---- directory -------------------------------------------------------------------------------------------
    def _info(self, name: str, e: dict) -> TensorInfo:
        qtype = GGMLQuantizationType[e["type"]]
        shape, n_bytes = tuple(int(s) for s in e["shape"]), int(e["n_bytes"])
        if e["store"] == "experts":
            el = self.expert_layers[int(e["layer"])]
            k = F.EXPERT_KINDS.index(e["kind"])
            return ExpertStackInfo(name, qtype, shape, n_bytes, self.experts_path,
                                   el.base + sum(el.piece_bytes[:k]), el.stride)
        if e["store"] == "rows":
            return TensorInfo(name, qtype, shape, n_bytes, self.rows_path, int(e["offset"]))
        return TensorInfo(name, qtype, shape, n_bytes, os.path.join(self.path, F.DENSE_DIR, e["item"]), 0)

    def _get(self, name: str) -> TensorInfo:
        if self._closed:
            raise ValueError(f"{self.path}: checkpoint is closed")
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None


def _stored_shape(info: TensorInfo) -> tuple[tuple[int, ...], np.dtype]:
    """How a dense tensor is stored in Orbax: its own dtype and shape, or raw uint8 rows when quantized."""
    dtype = _TYPED_DTYPES.get(info.ggml_type)
    return (info.shape, dtype) if dtype is not None else ((info.n_rows, info.row_bytes), np.dtype(np.uint8))


def _as_rows(arr, info: TensorInfo) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(arr)).reshape(-1).view(np.uint8).reshape(info.n_rows, info.row_bytes)


def _files(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def open_checkpoint(path: str | os.PathLike, verify: str = "first") -> OrbaxModel:
    """Open and validate a checkpoint directory written by `python -m jds41.checkpoints.convert`. Raises
    ModelFileError only; an unfinished conversion (a journal present, no manifest) is refused."""
    path = str(path)
    try:
        return _open(path, verify)
    except Jds41Error:
        raise
    except Exception as e:  # the reader's contract: a bad checkpoint never surfaces as another exception type
        raise ModelFileError(path, f"unexpected {type(e).__name__} while opening: {e}") from e


def _open(path: str, verify: str) -> OrbaxModel:
    if os.path.exists(os.path.join(path, F.JOURNAL)):
        raise ModelFileError(path, "an unfinished conversion (journal.jsonl present): rerun "
                                   "`python -m jds41.checkpoints.convert` to resume it")
    manifest_path = os.path.join(path, F.MANIFEST)
    if not os.path.isfile(manifest_path):
        raise ModelFileError(path, f"not a jds41 Orbax checkpoint: no {F.MANIFEST}")
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("format") != F.FORMAT or manifest.get("version") != F.VERSION:
        raise ModelFileError(manifest_path, f"format {manifest.get('format')!r} version {manifest.get('version')!r}"
                                            f", expected {F.FORMAT!r} version {F.VERSION}")
    with open(os.path.join(path, F.METADATA), "rb") as f:
        blob = f.read()
    if F.digest(blob) != manifest["metadata_digest"]:
        raise ModelFileError(os.path.join(path, F.METADATA), "checksum mismatch", tensor=F.METADATA)
    for name, size in ((F.EXPERTS_FILE, manifest["experts_bytes"]), (F.ROWS_FILE, manifest["rows_bytes"])):
        p = os.path.join(path, name)
        if not os.path.isfile(p) or os.path.getsize(p) != size:
            got = os.path.getsize(p) if os.path.isfile(p) else "missing"
            raise ModelFileError(p, f"size {got}, the manifest says {size} bytes")
    for item in manifest["items"]:
        if not os.path.isdir(os.path.join(path, F.DENSE_DIR, item)):
            raise ModelFileError(os.path.join(path, F.DENSE_DIR, item), "Orbax item missing",
                                 tensor=manifest["items"][item][0])
    return OrbaxModel(path, manifest, json.loads(blob), verify)
