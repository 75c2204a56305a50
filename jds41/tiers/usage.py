"""Usage profiles: how often each routed expert and each Engram row is used over a calibration corpus. No jax.

Owns the data and its JSON form; the model run that fills it is `jds41.tiers.profile`, its consumer the planner
(`jds41.tiers.placement`). A usage file holds:
- `model`: the identity of the file it was measured on (`ModelIdentity`); a placement for another model is refused;
- `tokens`, `prompts`, `corpus`: how much text was read;
- `layers`: per main layer its kind (`hash`: experts fixed by tid2eid[token]; `scored`: chosen by the router) and
  the selection count of every expert (each token adds K selections per layer);
- `engram`: per Engram layer the lookups, distinct rows, the `top` most used rows with counts, and a histogram of
  the rest in power-of-two count bins `[lo, hi, rows, lookups]` (rows with lo <= count < hi).

The schema is versioned (`SCHEMA`, `VERSION`); a reader refuses other versions rather than guessing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jds41.errors import Jds41Error

SCHEMA = "jds41.usage"
VERSION = 1
ENGRAM_TOP_N = 4096  # hot rows kept exactly per Engram layer; enough to size a host-memory row cache


class UsageError(Jds41Error, ValueError):
    """A usage or placement file that is malformed, of another schema version, or for another model."""


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """Which model a usage profile or placement belongs to. `sha256` covers the metadata (split.* keys aside, so
    re-sharding keeps it) and the tensor directory (names, types, shapes, bytes), not the tensor data: two files
    differing only in weight bytes would collide, but any converter or synthetic writer records what it wrote."""

    arch: str
    n_layers: int
    n_experts: int
    n_experts_used: int
    file: str  # base name, informative only: renaming a file keeps its profiles valid
    sha256: str

    @classmethod
    def of(cls, model) -> ModelIdentity:
        """From an open `GGUFModel`."""
        cfg = model.config
        meta = {k: v for k, v in model.metadata.items() if not k.startswith("split.")}
        directory = [[t.name, t.ggml_type.name, list(t.shape), t.n_bytes]
                     for t in sorted(model.tensors.values(), key=lambda t: t.name)]
        blob = json.dumps({"metadata": meta, "tensors": directory}, sort_keys=True, ensure_ascii=True)
        return cls(cfg.arch, cfg.n_layers, cfg.n_experts, cfg.n_experts_used, os.path.basename(model.path),
                   hashlib.sha256(blob.encode()).hexdigest())

    def check_matches(self, other: ModelIdentity, what: str) -> None:
        """Raise UsageError unless `other` (the model at hand) is the model `what` was made for."""
        for field in ("arch", "n_layers", "n_experts", "n_experts_used", "sha256"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                raise UsageError(f"{what} was made for another model: {field} {mine!r} ({self.file}) != {theirs!r} "
                                 f"({other.file}); profile this model first (python -m jds41.tiers.profile)")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any, what: str) -> ModelIdentity:
        return cls(**_fields(d, {"arch": str, "n_layers": int, "n_experts": int, "n_experts_used": int, "file": str,
                                 "sha256": str}, f"{what}: model"))


@dataclasses.dataclass(frozen=True)
class EngramUsage:
    layer: int
    table_rows: int
    lookups: int
    distinct: int
    top: tuple[tuple[int, int], ...]  # (row, count), most used first, ties by lower row
    rest: tuple[tuple[int, int, int, int], ...]  # (lo, hi, rows, lookups) for the rows outside `top`

    def to_json(self) -> dict:
        return {"layer": self.layer, "table_rows": self.table_rows, "lookups": self.lookups,
                "distinct": self.distinct, "top": [list(t) for t in self.top], "rest": [list(r) for r in self.rest]}

    @classmethod
    def from_json(cls, d: Any, what: str) -> EngramUsage:
        f = _fields(d, {"layer": int, "table_rows": int, "lookups": int, "distinct": int, "top": list, "rest": list},
                    what)
        return cls(f["layer"], f["table_rows"], f["lookups"], f["distinct"],
                   tuple(tuple(_ints(t, 2, what)) for t in f["top"]),
                   tuple(tuple(_ints(r, 4, what)) for r in f["rest"]))


@dataclasses.dataclass(frozen=True)
class Usage:
    model: ModelIdentity
    tokens: int
    counts: tuple[tuple[int, ...], ...]  # [n_layers][n_experts] selections
    hash_layers: tuple[int, ...]
    engram: tuple[EngramUsage, ...] = ()
    prompts: int = 0
    corpus: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        m = self.model
        if len(self.counts) != m.n_layers or any(len(c) != m.n_experts for c in self.counts):
            raise UsageError(f"usage counts must be {m.n_layers} layers x {m.n_experts} experts")
        if any(x < 0 for c in self.counts for x in c) or self.tokens < 0:
            raise UsageError("usage counts and tokens must be non-negative")
        if any(not 0 <= h < m.n_layers for h in self.hash_layers):
            raise UsageError(f"hash layer ids must lie in [0, {m.n_layers})")

    @classmethod
    def from_counts(cls, counts: Sequence[Sequence[int]] | np.ndarray, model: ModelIdentity,
                    hash_layers: Sequence[int] = (), tokens: int | None = None, **kw) -> Usage:
        """From a [layers, experts] table; `tokens` defaults to the selections of one layer / K."""
        table = tuple(tuple(int(x) for x in row) for row in np.asarray(counts, np.int64))
        if tokens is None:
            tokens = sum(table[0]) // model.n_experts_used if table else 0
        return cls(model, tokens, table, tuple(sorted(int(h) for h in hash_layers)), **kw)

    @classmethod
    def uniform(cls, model: ModelIdentity, hash_layers: Sequence[int] = ()) -> Usage:
        """No measurements: every expert equally likely (the `uniform` placement source)."""
        return cls.from_counts(np.ones((model.n_layers, model.n_experts), np.int64), model, hash_layers, tokens=0,
                               corpus={"source": "uniform"})

    def array(self) -> np.ndarray:
        """Counts as int64 [n_layers, n_experts]."""
        return np.asarray(self.counts, np.int64).reshape(self.model.n_layers, self.model.n_experts)

    # ---- JSON ----------------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA, "version": VERSION, "model": self.model.to_json(), "tokens": self.tokens,
            "prompts": self.prompts, "corpus": dict(self.corpus),
            "layers": [{"layer": i, "kind": "hash" if i in self.hash_layers else "scored", "counts": list(c)}
                       for i, c in enumerate(self.counts)],
            "engram": [e.to_json() for e in self.engram],
        }

    @classmethod
    def from_json(cls, d: Any, what: str = "usage") -> Usage:
        check_schema(d, SCHEMA, VERSION, what, "usage")
        f = _fields({k: v for k, v in d.items() if k not in ("schema", "version")},
                    {"model": dict, "tokens": int, "prompts": int, "corpus": dict, "layers": list, "engram": list},
                    what)
        model = ModelIdentity.from_json(f["model"], what)
        counts, hashes = [], []
        for i, layer in enumerate(f["layers"]):
            lf = _fields(layer, {"layer": int, "kind": str, "counts": list}, f"{what}: layers[{i}]")
            if lf["layer"] != i or lf["kind"] not in ("hash", "scored"):
                raise UsageError(f"{what}: layers[{i}] must be layer {i} of kind 'hash' or 'scored'")
            counts.append(_ints(lf["counts"], model.n_experts, f"{what}: layers[{i}].counts"))
            if lf["kind"] == "hash":
                hashes.append(i)
        engram = tuple(EngramUsage.from_json(e, f"{what}: engram[{i}]") for i, e in enumerate(f["engram"]))
        try:
            return cls(model, f["tokens"], tuple(tuple(c) for c in counts), tuple(hashes), engram, f["prompts"],
                       f["corpus"])
        except UsageError as e:
            raise UsageError(f"{what}: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Usage:
        return cls.from_json(read_json(path, "usage file"), what=str(path))


# ---- counting -----------------------------------------------------------------------------------------------


class UsageCounter:
    """Accumulates routing decisions and Engram row ids chunk by chunk, then freezes them into a `Usage`."""

    def __init__(self, model: ModelIdentity, hash_layers: Sequence[int], engram_layers: Sequence[int] = (),
                 engram_table_rows: Sequence[int] = (), top_n: int = ENGRAM_TOP_N):
        self.model = model
        self.hash_layers = tuple(hash_layers)
        self.counts = np.zeros((model.n_layers, model.n_experts), np.int64)
        self.tokens = 0
        self.engram_layers = tuple(engram_layers)
        self.engram_table_rows = tuple(engram_table_rows)
        # Engram tables have hundreds of millions of rows: keep sparse (ids, counts) per layer, not a dense table.
        self._rows: list[dict[str, np.ndarray]] = [
            {"ids": np.zeros(0, np.int64), "counts": np.zeros(0, np.int64)} for _ in self.engram_layers]
        self.top_n = top_n

    def add_routing(self, idx_TLK: np.ndarray) -> None:
        """Expert ids of T tokens: int [T, n_layers, K]. Counts tokens too."""
        idx = np.asarray(idx_TLK, np.int64)
        if idx.ndim != 3 or idx.shape[1] != self.model.n_layers:
            raise ValueError(f"routing ids must be [T, {self.model.n_layers}, K], got {idx.shape}")
        layer = np.broadcast_to(np.arange(self.model.n_layers)[None, :, None], idx.shape)
        np.add.at(self.counts, (layer.reshape(-1), idx.reshape(-1)), 1)
        self.tokens += idx.shape[0]

    def add_engram(self, rows_TLB: np.ndarray) -> None:
        """Row ids of T tokens: int [T, n_engram_layers, n_buckets] (EngramHasher.row_ids_seq)."""
        rows = np.asarray(rows_TLB, np.int64)
        for slot, acc in enumerate(self._rows):
            ids = np.concatenate([acc["ids"], rows[:, slot, :].reshape(-1)])
            cnt = np.concatenate([acc["counts"], np.ones(rows[:, slot, :].size, np.int64)])
            uniq, inv = np.unique(ids, return_inverse=True)
            acc["ids"], acc["counts"] = uniq, np.bincount(inv, weights=cnt, minlength=uniq.size).astype(np.int64)

    def finish(self, prompts: int = 0, corpus: Mapping[str, Any] | None = None) -> Usage:
        engram = tuple(_engram_usage(layer, table_rows, acc["ids"], acc["counts"], self.top_n)
                       for layer, table_rows, acc in zip(self.engram_layers, self.engram_table_rows, self._rows,
                                                         strict=True))
        return Usage(self.model, self.tokens, tuple(tuple(int(x) for x in row) for row in self.counts),
                     self.hash_layers, engram, prompts, dict(corpus or {}))


def _engram_usage(layer: int, table_rows: int, ids: np.ndarray, counts: np.ndarray, top_n: int) -> EngramUsage:
    order = np.lexsort((ids, -counts))  # most used first, lower row id first on ties: deterministic
    top = tuple((int(ids[i]), int(counts[i])) for i in order[:top_n])
    rest = counts[order[top_n:]]
    hist = []
    if rest.size:
        bins = np.floor(np.log2(rest)).astype(np.int64)
        for b in np.unique(bins):
            sel = rest[bins == b]
            hist.append((1 << int(b), 1 << (int(b) + 1), int(sel.size), int(sel.sum())))
    return EngramUsage(layer, table_rows, int(counts.sum()), int(ids.size), top, tuple(hist))


# ---- JSON helpers (shared with the placement file) --------------------------------------------------------


def write_json(path: str | os.PathLike, doc: Any) -> None:
    """Indented JSON with every list of numbers on one line: a 384-expert layer is one line, not 384."""
    with open(path, "w") as fh:
        fh.write(_format(doc, 0) + "\n")


def _format(v: Any, depth: int) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(v, dict) and v:
        items = [f"{inner}{json.dumps(str(k))}: {_format(x, depth + 1)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
        return "[\n" + ",\n".join(inner + _format(x, depth + 1) for x in v) + "\n" + pad + "]"
    return json.dumps(v)


def check_schema(d: Any, schema: str, version: int, what: str, kind: str) -> None:
    """A jds41 JSON file of `kind` names its schema and version; anything else is refused before it is read."""
    if not isinstance(d, dict) or d.get("schema") != schema:
        raise UsageError(f"{what}: not a jds41 {kind} file (schema {schema!r} expected)")
    if d.get("version") != version:
        raise UsageError(f"{what}: {kind} schema version {d.get('version')!r}, this jds41 reads {version}")


def read_json(path: str | os.PathLike, what: str) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {path} is not valid JSON: {e}") from None


def _fields(d: Any, types: Mapping[str, type], what: str) -> dict:
    """Exactly the keys of `types`, each of its type (bool is not an int here)."""
    if not isinstance(d, dict):
        raise UsageError(f"{what}: expected a JSON object")
    missing, unknown = sorted(set(types) - set(d)), sorted(set(d) - set(types))
    if missing or unknown:
        parts = ([f"missing fields {missing}"] if missing else []) + ([f"unknown fields {unknown}"] if unknown else [])
        raise UsageError(f"{what}: {'; '.join(parts)}")
    for k, t in types.items():
        if not isinstance(d[k], t) or (t is int and isinstance(d[k], bool)):
            raise UsageError(f"{what}: field {k!r} must be {t.__name__}, got {type(d[k]).__name__}")
    return dict(d)


def _ints(v: Any, n: int, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) != n or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise UsageError(f"{what}: expected a list of {n} integers")
    return v
