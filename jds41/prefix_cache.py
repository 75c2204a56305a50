"""Prefix cache: snapshots of a session's whole decode state at prompt boundaries, so a request that shares a prefix
with an earlier one resumes from the longest cached prefix and reads only the rest.

A `Snapshot` holds, as numpy copies on the host:
- the decode state pytree (model.init_state's layout: window rings, compressor partial groups and rows, indexer
  keys, the position). Compressed rows and index keys are kept only up to the rows the prefix emitted (row b is
  written once, when its block completes, and rows past it are still the zeros of init_state), so a snapshot
  grows with the prefix, not with the context; `restore` pads them back with zeros;
- the token prefix itself (also the Engram n-gram history: the hasher reads the last n-1 ids of it) and the
  logits after its last token (an exact hit needs no forward pass);
- the expert working set: per layer, how many times the conversation's tokens selected each routed expert
  (from the routing trace the step returns when experts are placed by a profile), prefetched into the SSD slot
  cache when the snapshot is restored, so a resumed agent starts warm.

`PrefixCache` keys snapshots by a SHA-256 of the token ids, keeps them LRU under a byte budget in host memory and,
with a directory, also on disk (one file per snapshot, written atomically) so they survive a restart. A file is a
format header plus a SHA-256 over header and payload: a truncated or corrupted file is detected, warned about once,
deleted and never used. Files of another model or context size (a different fingerprint) are ignored.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jds41 import model as M

log = logging.getLogger("jds41.prefix_cache")

MAGIC = b"JDS41PFX"
VERSION = 1
SUFFIX = ".pfx"
_HEAD = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 32


def prefix_key(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()


@dataclasses.dataclass
class Snapshot:
    tokens: np.ndarray  # int32 [n]
    leaves: list[np.ndarray]  # the state pytree's leaves (trimmed), in jax.tree order
    logits: np.ndarray  # f32 [V] after the last token
    experts: np.ndarray | None  # int64 [n_layers, n_experts] selections so far; None without a tier profile

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def key(self) -> str:
        return prefix_key(self.tokens)

    @property
    def nbytes(self) -> int:
        arrays = [self.tokens, self.logits, *self.leaves] + ([self.experts] if self.experts is not None else [])
        return sum(a.nbytes for a in arrays)


# ---- state <-> snapshot ---------------------------------------------------------------------------------------

def _row_ratios(plan) -> list[dict[tuple[str, str], int]]:
    """Per layer, the leaves indexed by compressed row, and the tokens per row: {(part, leaf): ratio}."""
    out = []
    for lp in plan.layers:
        r = {}
        if lp.cmp is not None:
            r[("cmp", "rows")] = lp.cmp.ratio
        if lp.idx_cmp is not None:
            r[("idx", "rows")] = lp.idx_cmp.ratio
        elif lp.latent_index_keys:
            r[("idx", "keys")] = lp.ratio
        out.append(r)
    return out


def _map_rows(plan, layers: list, fn) -> list:
    """layers with fn(array, ratio) applied to every row-indexed leaf."""
    out = []
    for st, ratios in zip(layers, _row_ratios(plan)):
        st = {part: dict(v) if isinstance(v, dict) else v for part, v in st.items()}
        for (part, leaf), ratio in ratios.items():
            st[part][leaf] = fn(st[part][leaf], ratio)
        out.append(st)
    return out


def capture(plan, state: dict, tokens: Sequence[int], logits, experts: np.ndarray | None) -> Snapshot:
    """A host copy of `state` after `tokens` (copies: the next step donates the device buffers)."""
    n = len(tokens)
    layers = _map_rows(plan, state["layers"], lambda a, r: a[:-(-n // r)])
    leaves = [np.array(a) for a in jax.tree.leaves({"pos": state["pos"], "layers": layers})]
    return Snapshot(np.asarray(tokens, np.int32).copy(), leaves, np.array(logits, np.float32).reshape(-1),
                    None if experts is None else np.array(experts, np.int64))


def restore(plan, template: dict, snap: Snapshot) -> dict:
    """The device state of `snap`, shaped like `template` (a state of the same plan): trimmed rows padded back
    with zeros."""
    state = jax.tree.unflatten(jax.tree.structure(template), snap.leaves)
    full_rows = _map_rows(plan, template["layers"], lambda a, r: a.shape[0])

    def pad(a, want):
        return np.pad(a, ((0, want - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))

    layers = []
    for st, want, ratios in zip(state["layers"], full_rows, _row_ratios(plan)):
        st = {part: dict(v) if isinstance(v, dict) else v for part, v in st.items()}
        for part, leaf in ratios:
            st[part][leaf] = pad(st[part][leaf], want[part][leaf])
        layers.append(st)
    # committed, like Session's states (jit keys its cache on it): a restored session compiles nothing new
    return jax.device_put({"pos": state["pos"], "layers": layers}, jax.devices()[0])


def prefetch_working_set(tiers, experts: np.ndarray | None) -> int:
    """Start SSD reads of the snapshot's working set, most used first, as far as the slot cache holds them;
    HBM and host experts are resident already. Returns how many reads started."""
    if tiers is None or experts is None or tiers.stores.ssd is None:
        return 0
    layer, expert = np.nonzero(experts * (tiers.tier_LE[:experts.shape[0], :experts.shape[1]] == 2))
    order = np.argsort(-experts[layer, expert], kind="stable")
    keys = [(int(layer[i]), int(expert[i])) for i in order[:tiers.stores.ssd.cache.n_slots]]
    return len(tiers.stores.ssd.prefetch(keys))


def resume_session(session, tokens: Sequence[int], max_len: int | None = None) -> int:
    """Session.restore_prefix: on a fresh session, the longest cached prefix of `tokens` becomes its state, token
    history (the Engram n-gram history with it) and working set; returns the tokens restored."""
    cache = session.engine.prefix_cache
    if cache is None or session.tokens or session._looked_up:
        return 0
    session._looked_up = True
    snap = cache.longest(tokens, max_len)
    if snap is None:
        return 0
    session.state = restore(session.engine.plan, session.state, snap)
    session.tokens = snap.tokens.tolist()
    session.expert_counts = None if snap.experts is None else snap.experts.copy()
    session.cached_tokens, session._cached_logits = snap.n_tokens, snap.logits
    prefetch_working_set(session.engine.tiers, session.expert_counts)
    return snap.n_tokens


# ---- files ---------------------------------------------------------------------------------------------------

def _encode(snap: Snapshot, fingerprint: str) -> bytes:
    arrays = {"tokens": snap.tokens, "logits": snap.logits, **{f"leaf{i}": a for i, a in enumerate(snap.leaves)}}
    if snap.experts is not None:
        arrays["experts"] = snap.experts
    table, payload, at = [], [], 0
    for name, a in arrays.items():
        a = np.asarray(a, order="C")  # (np.ascontiguousarray would turn a 0-d leaf into shape (1,))
        table.append([name, a.dtype.str, list(a.shape), at, a.nbytes])
        payload.append(a.tobytes())
        at += a.nbytes
    header = json.dumps({"fingerprint": fingerprint, "key": snap.key, "n_tokens": snap.n_tokens,
                         "n_leaves": len(snap.leaves), "arrays": table, "payload_bytes": at}).encode()
    body = _HEAD.pack(MAGIC, VERSION, len(header)) + header + b"".join(payload)
    return body + hashlib.sha256(body).digest()


class SnapshotFileError(ValueError):
    pass


def _read_header(path: Path) -> tuple[dict, int]:
    """(header, header end offset); checks magic, version and the file size the header implies."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise SnapshotFileError("shorter than the format header")
        magic, version, n = _HEAD.unpack(head)
        if magic != MAGIC:
            raise SnapshotFileError(f"bad magic {magic!r}")
        if version != VERSION:
            raise SnapshotFileError(f"format version {version}, this build reads {VERSION}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        want = _HEAD.size + n + int(header["payload_bytes"]) + _DIGEST
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotFileError(f"unreadable header ({e})") from None
    if size != want:
        raise SnapshotFileError(f"{size} bytes, the header says {want} (truncated?)")
    return header, _HEAD.size + n


def _decode(path: Path) -> tuple[Snapshot, dict]:
    header, start = _read_header(path)
    data = path.read_bytes()
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise SnapshotFileError("checksum mismatch (corrupted)")
    arrays = {}
    for name, dtype, shape, at, _ in header["arrays"]:
        arrays[name] = np.frombuffer(data, np.dtype(dtype), int(np.prod(shape, dtype=np.int64)),
                                     start + at).reshape(shape).copy()
    snap = Snapshot(arrays["tokens"], [arrays[f"leaf{i}"] for i in range(header["n_leaves"])], arrays["logits"],
                    arrays.get("experts"))
    if snap.key != header["key"]:
        raise SnapshotFileError("its tokens do not hash to its key")
    return snap, header


# ---- the cache -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CacheStats:
    query_tokens: int = 0  # tokens of the prompts looked up
    hits: int = 0  # lookups that resumed from a snapshot
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens not recomputed thanks to a hit
    evictions: int = 0  # snapshots dropped from host memory for the byte budget
    stored: int = 0
    bad_files: int = 0  # corrupted / truncated snapshot files found (and deleted)


class PrefixCache:
    """LRU of snapshots under `budget_bytes` of host memory; `directory` also keeps them on disk (pruned LRU to
    the same budget) and indexes the files found there at start. `fingerprint` names the model and plan: a file
    with another fingerprint is ignored."""

    def __init__(self, budget_bytes: int, directory: str | os.PathLike | None = None, fingerprint: str = ""):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget, self.fingerprint = int(budget_bytes), fingerprint
        self.stats = CacheStats()
        self._mem: collections.OrderedDict[str, Snapshot] = collections.OrderedDict()
        self._disk: collections.OrderedDict[str, tuple[Path, int, int]] = collections.OrderedDict()  # n, bytes
        self._warned: set[str] = set()
        self._nbytes = 0
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._index()

    @property
    def nbytes(self) -> int:
        return self._nbytes  # kept as a counter: /metrics reads it from another thread

    def __len__(self) -> int:
        return len(set(self._mem) | set(self._disk))

    def _bad(self, path: Path, why: str) -> None:
        if str(path) not in self._warned:
            self._warned.add(str(path))
            self.stats.bad_files += 1
            log.warning("prefix cache: ignoring snapshot %s: %s; deleting it", path, why)
        path.unlink(missing_ok=True)

    def _index(self) -> None:
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                header, _ = _read_header(path)
            except (OSError, SnapshotFileError) as e:
                self._bad(path, str(e))
                continue
            if header.get("fingerprint") != self.fingerprint:
                continue  # another model's (or context size's) snapshot: not ours to use or delete
            self._disk[header["key"]] = (path, int(header["n_tokens"]), path.stat().st_size)

    # ---- store ------------------------------------------------------------------------------------------
    def put(self, snap: Snapshot) -> None:
        key = snap.key
        if key in self._mem:
            self._mem.move_to_end(key)
            return
        if snap.nbytes > self.budget:
            return  # would evict everything and still not fit
        self._hold(key, snap)
        self.stats.stored += 1
        if self.directory is not None and key not in self._disk:
            self._write(key, snap)

    def _write(self, key: str, snap: Snapshot) -> None:
        path = self.directory / f"{key}{SUFFIX}"
        tmp = path.with_suffix(".tmp")
        data = _encode(snap, self.fingerprint)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("prefix cache: cannot write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return
        self._disk[key] = (path, snap.n_tokens, len(data))
        while sum(b for _, _, b in self._disk.values()) > self.budget and len(self._disk) > 1:
            _, (old, _, _) = self._disk.popitem(last=False)
            old.unlink(missing_ok=True)

    # ---- lookup ------------------------------------------------------------------------------------------
    def lengths(self) -> list[int]:
        return sorted({s.n_tokens for s in self._mem.values()} | {n for _, n, _ in self._disk.values()},
                      reverse=True)

    def longest(self, tokens: Sequence[int], max_len: int | None = None) -> Snapshot | None:
        """The snapshot of the longest cached prefix of `tokens` (at most `max_len` tokens), or None; counted."""
        tokens = np.asarray(tokens, np.int32)
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        self.stats.query_tokens += len(tokens)
        for n in self.lengths():
            if n > limit or n == 0:
                continue
            snap = self._get(prefix_key(tokens[:n]))
            if snap is not None and np.array_equal(snap.tokens, tokens[:n]):  # a hash collision is a miss
                self.stats.hits += 1
                self.stats.hit_tokens += n
                return snap
        self.stats.misses += 1
        return None

    def _get(self, key: str) -> Snapshot | None:
        if key in self._mem:
            self._mem.move_to_end(key)
            if key in self._disk:
                self._disk.move_to_end(key)
            return self._mem[key]
        if key not in self._disk:
            return None
        path = self._disk.pop(key)[0]
        try:
            snap, header = _decode(path)
        except (OSError, SnapshotFileError, ValueError, KeyError) as e:
            self._bad(path, str(e))
            return None
        if header.get("fingerprint") != self.fingerprint:
            return None
        self._disk[key] = (path, snap.n_tokens, path.stat().st_size)
        if snap.nbytes <= self.budget:
            self._hold(key, snap)
        return snap

    def _hold(self, key: str, snap: Snapshot) -> None:
        """Keep `snap` in memory, evicting least recently used snapshots past the budget."""
        self._mem[key] = snap
        self._nbytes += snap.nbytes
        while self._nbytes > self.budget:
            _, old = self._mem.popitem(last=False)
            self._nbytes -= old.nbytes
            self.stats.evictions += 1


def fingerprint(engine) -> str:
    """Which model file, architecture and state layout a snapshot belongs to."""
    st = jax.eval_shape(lambda: M.init_state(engine.plan))
    shapes = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(st)]
    size = os.path.getsize(engine.path) if os.path.exists(engine.path) else -1
    text = json.dumps([os.path.basename(str(engine.path)), size, engine.cfg.arch, engine.plan.max_ctx, shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:32]
