"""`python -m jds41.checkpoints.convert MODEL.gguf OUT_DIR`: a GGUF model as a jds41 Orbax checkpoint.

The format is orbax_layout.py's. The conversion:
- streams: one piece at a time (a dense Orbax item, a batch of expert chunks, a part of an Engram table), each at
  most `--piece-mib` (a single tensor larger than that is one piece), read from the GGUF with O_DIRECT (the
  loader's and the SSD tier's readers), so memory stays bounded by the piece, not the model;
- is resumable: it writes into `OUT_DIR.partial/`, and after each piece is durable (fsync) it appends the piece
  and its checksums to `journal.jsonl`; a rerun checks the plan is the same (same source header, same settings),
  re-verifies every journaled piece against its checksums and redoes only what is missing or bad;
- is atomic: the manifest is written last, the directory renamed to OUT_DIR, and only then is the journal
  removed. An opener refuses any directory with a journal or without a manifest, so a conversion killed at any
  point leaves nothing that opens as a checkpoint; a rerun finishes it.
`--verify OUT_DIR` hashes every stored byte against the manifest. `--profile NAME` opens the result with that tier
profile after converting (placement and SSD reads from the chunk file), to prove it serves.

For tests, JDS41_CONVERT_KILL_AFTER=N makes the process SIGKILL itself at its N-th durability event (after a
piece's bytes are written but before they are synced or journaled, after a journal entry, around the final
rename), so kills land mid-piece and between pieces alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time

import numpy as np

from jds41.checkpoints import orbax_layout as F
from jds41.checkpoints.orbax_model import item_handler, open_checkpoint
from jds41.errors import Jds41Error

KILL_ENV = "JDS41_CONVERT_KILL_AFTER"


class ConvertError(Jds41Error):
    """The conversion cannot proceed (output exists, a partial conversion of another source, ...)."""


class _KillSwitch:
    """The test hook of the module docstring."""

    def __init__(self):
        v = os.environ.get(KILL_ENV, "").strip()
        self.after, self.events = (int(v) if v else None), 0

    def event(self) -> None:
        self.events += 1
        if self.after is not None and self.events >= self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class Conversion:
    """One GGUF -> checkpoint conversion; `run()` does or resumes it and returns a summary."""

    def __init__(self, src: str, out: str, piece_bytes: int = F.DEFAULT_PIECE_BYTES, progress: bool = True):
        self.src, self.out = str(src), os.path.abspath(str(out)).rstrip(os.sep)
        self.piece_bytes, self.progress = int(piece_bytes), progress
        self.kill = _KillSwitch()
        self._reader = None  # one O_DIRECT expert reader over the GGUF for every expert piece

    # ---- driver ----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from jds41.checkpoints.reader import open_model

        if os.path.isdir(self.src):
            raise ConvertError(f"{self.src}: already a checkpoint directory, not a GGUF file")
        t0 = time.perf_counter()
        with open_model(self.src) as model:
            work = self._workdir()
            plan = {"format": F.FORMAT, "version": F.VERSION, "hash": F.HASH, "source": F.source_identity(model),
                    **F.plan_layout(model, self.piece_bytes)}
            resumed = self._start(work, plan)
            done = self._journal(work)
            pieces = self._pieces(model, plan)
            from tqdm import tqdm

            bar = tqdm(total=sum(p[1] for p in pieces), unit="B", unit_scale=True, desc="converting",
                       disable=not self.progress)
            skipped = written = 0
            try:
                for piece_id, nbytes, write, verify in pieces:
                    if piece_id in done and self._still_good(work, verify, done[piece_id], piece_id):
                        skipped += nbytes
                    else:
                        record = write(work)
                        self._append(work, {"piece": piece_id, "record": record})
                        done[piece_id] = record
                        written += nbytes
                    bar.update(nbytes)
            finally:
                bar.close()
                if self._reader is not None:
                    self._reader.close()
            self._finish(work, plan, done)
        seconds = time.perf_counter() - t0
        return {"out": self.out, "bytes_written": written, "bytes_skipped": skipped, "resumed": resumed,
                "seconds": round(seconds, 3), "gb_per_s": round(written / max(seconds, 1e-9) / 1e9, 3),
                "pieces": len(pieces), "events": self.kill.events}

    def _workdir(self) -> str:
        if os.path.exists(self.out):
            if os.path.exists(os.path.join(self.out, F.JOURNAL)):
                return self.out  # killed between the final rename and dropping the journal: finish it there
            raise ConvertError(f"{self.out} already exists (delete it to convert again)")
        return self.out + F.PARTIAL_SUFFIX

    def _start(self, work: str, plan: dict) -> bool:
        """Create the work directory, or check that an existing one is this conversion's. True if resuming."""
        plan_path = os.path.join(work, F.PLAN)
        if os.path.isdir(work):
            try:
                with open(plan_path) as f:
                    same = json.load(f) == json.loads(json.dumps(plan))
            except (OSError, ValueError):
                same = None  # killed before the plan was durable: nothing in it can be trusted, start over
            if same is False:
                raise ConvertError(f"{work} holds a partial conversion of another source or with other settings "
                                   f"(delete it, or rerun with the same file and --piece-mib)")
            if same:
                return True
            shutil.rmtree(work)
        os.makedirs(os.path.join(work, F.DENSE_DIR))
        # The journal exists before anything else: from here on the directory can never open as a checkpoint.
        open(os.path.join(work, F.JOURNAL), "w").close()
        for name, size in ((F.EXPERTS_FILE, plan["experts_bytes"]), (F.ROWS_FILE, plan["rows_bytes"])):
            with open(os.path.join(work, name), "wb") as f:
                f.truncate(size)  # sparse: pieces land at their planned offsets in any order
        F.fsync_tree(work)
        F.write_json(plan_path, plan)
        F.fsync_path(os.path.dirname(work))
        return False

    def _journal(self, work: str) -> dict:
        done = {}
        with open(os.path.join(work, F.JOURNAL)) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    done[entry["piece"]] = entry["record"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a kill: that piece is redone
        return done

    def _append(self, work: str, entry: dict) -> None:
        with open(os.path.join(work, F.JOURNAL), "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.kill.event()

    def _still_good(self, work: str, verify, record, piece_id: str) -> bool:
        try:
            return verify(work) == record
        except Exception:  # noqa: BLE001 - anything unreadable in a journaled piece means: write it again
            logging.getLogger(__name__).info("piece %s failed re-verification: rewriting it", piece_id)
            return False

    def _finish(self, work: str, plan: dict, done: dict) -> None:
        manifest = {k: v for k, v in plan.items()}
        manifest["tensors"] = {n: dict(e) for n, e in plan["tensors"].items()}
        manifest["expert_chunks"] = {str(d["layer"]): [None] * d["n_experts"] for d in plan["expert_layers"]}
        for piece_id, record in done.items():
            kind, _, rest = piece_id.partition(":")
            if kind == "metadata":
                manifest["metadata_digest"] = record
            elif kind == "dense":
                for name, h in record.items():
                    manifest["tensors"][name]["digest"] = h
            elif kind == "experts":
                layer, e0 = (int(x) for x in rest.split(":"))
                manifest["expert_chunks"][str(layer)][e0:e0 + len(record)] = record
            elif kind == "rows":
                name, part = rest.rsplit(":", 1)
                parts = manifest["tensors"][name].setdefault("digest", [])
                parts.extend([None] * (int(part) + 1 - len(parts)))
                parts[int(part)] = record
        F.write_json(os.path.join(work, F.MANIFEST), manifest)
        F.fsync_path(work)
        self.kill.event()
        if work != self.out:
            os.rename(work, self.out)
            F.fsync_path(os.path.dirname(self.out))
            self.kill.event()
        os.remove(os.path.join(self.out, F.PLAN))
        os.remove(os.path.join(self.out, F.JOURNAL))  # the last step: now the directory opens
        F.fsync_path(self.out)

    # ---- pieces: (id, bytes, write(work) -> record, verify(work) -> record) ----------------------------------
    def _pieces(self, model, plan: dict) -> list:
        pieces = [("metadata", 0, lambda w: self._write_metadata(w, model), self._verify_metadata)]
        for item, names in plan["items"].items():
            pieces.append((f"dense:{item}", sum(model.tensors[n].n_bytes for n in names),
                           lambda w, item=item, names=names: self._write_dense(w, model, item, names),
                           lambda w, item=item, names=names: self._verify_dense(w, item, names, model)))
        for d in plan["expert_layers"]:
            el = F.ExpertLayer.from_json(d)
            per = max(1, self.piece_bytes // el.stride)
            for e0 in range(0, el.n_experts, per):
                n = min(per, el.n_experts - e0)
                pieces.append((f"experts:{el.layer}:{e0}", n * el.expert_bytes,
                               lambda w, el=el, e0=e0, n=n: self._write_experts(w, model, el, e0, n),
                               lambda w, el=el, e0=e0, n=n: self._verify_experts(w, el, e0, n)))
        for name, e in plan["tensors"].items():
            if e["store"] != "rows":
                continue
            for part, lo in enumerate(range(0, e["n_bytes"], e["part_bytes"])):
                n = min(e["part_bytes"], e["n_bytes"] - lo)
                pieces.append((f"rows:{name}:{part}", n,
                               lambda w, name=name, e=e, lo=lo, n=n: self._write_rows(w, model, name, e, lo, n),
                               lambda w, e=e, lo=lo, n=n: F.digest(F.read_range(os.path.join(w, F.ROWS_FILE),
                                                                              e["offset"] + lo, n))))
        return pieces

    def _write_metadata(self, work: str, model) -> str:
        import dataclasses

        blob = json.dumps(model.metadata, sort_keys=True).encode()
        if json.loads(blob) != model.metadata:  # JSON must give back exactly the GGUF's values
            raise ConvertError(f"{self.src}: metadata does not survive JSON unchanged")
        for name, data in ((F.METADATA, blob),
                           (F.CONFIG, json.dumps(dataclasses.asdict(model.config), indent=1, default=str).encode())):
            with open(os.path.join(work, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        return F.digest(blob)

    def _verify_metadata(self, work: str) -> str:
        with open(os.path.join(work, F.METADATA), "rb") as f:
            return F.digest(f.read())

    def _write_dense(self, work: str, model, item: str, names: list[str]) -> dict:
        import orbax.checkpoint as ocp

        from jds41.checkpoints.orbax_model import _stored_shape
        from jds41.tiers.loader import load_tensors

        loaded = load_tensors(model, names, progress=False)  # O_DIRECT, around the page cache
        tree, record = {}, {}
        for name in names:
            rows = loaded.arrays[name]
            record[name] = F.digest(rows)
            shape, dtype = _stored_shape(model.tensors[name])
            tree[F.orbax_key(name)] = rows.reshape(-1).view(dtype).reshape(shape)
        target = os.path.join(work, F.DENSE_DIR, item)
        _remove_item(target)
        item_handler().save(target, args=ocp.args.PyTreeSave(tree))
        self.kill.event()
        F.fsync_tree(target)
        F.fsync_path(os.path.dirname(target))
        return record

    def _verify_dense(self, work: str, item: str, names: list[str], model) -> dict:
        import orbax.checkpoint as ocp

        tree = {F.orbax_key(n): np.empty(0) for n in names}
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in tree}
        got = item_handler().restore(os.path.join(work, F.DENSE_DIR, item),
                                     args=ocp.args.PyTreeRestore(item=tree, restore_args=args, partial_restore=True))
        return {n: F.digest(got[F.orbax_key(n)]) for n in names}

    def _write_experts(self, work: str, model, el: F.ExpertLayer, e0: int, n: int) -> list[str]:
        from jds41.tiers.ssd import ExpertReader, aligned_empty
        from jds41.tiers.stores import ExpertLayout

        buf = aligned_empty(n * el.stride)
        buf[:] = 0  # the padding after each chunk is written as zeros, so resumed files are byte-identical
        keys = [(el.layer, e0 + i) for i in range(n)]
        if self._reader is None:
            self._reader = ExpertReader(ExpertLayout.from_model(model))  # O_DIRECT from the GGUF stacks
        self._reader.read(keys, out={k: buf[i * el.stride:i * el.stride + el.expert_bytes] for i, k in enumerate(keys)},
                          timeout=max(self._reader.timeout_s, len(buf) / 20e6))
        record = [F.digest(buf[i * el.stride:i * el.stride + el.expert_bytes]) for i in range(n)]
        fd = os.open(os.path.join(work, F.EXPERTS_FILE), os.O_WRONLY)
        try:
            _pwrite(fd, buf, el.chunk_offset(e0))
            self.kill.event()
            os.fsync(fd)
        finally:
            os.close(fd)
        return record

    def _verify_experts(self, work: str, el: F.ExpertLayer, e0: int, n: int) -> list[str]:
        data = F.read_range(os.path.join(work, F.EXPERTS_FILE), el.chunk_offset(e0), n * el.stride)
        return [F.digest(data[i * el.stride:i * el.stride + el.expert_bytes]) for i in range(n)]

    def _write_rows(self, work: str, model, name: str, e: dict, lo: int, n: int) -> str:
        info = model.tensors[name]
        data = F.read_range(info.shard, info.offset + lo, n)
        fd = os.open(os.path.join(work, F.ROWS_FILE), os.O_WRONLY)
        try:
            _pwrite(fd, data, e["offset"] + lo)
            self.kill.event()
            os.fsync(fd)
        finally:
            os.close(fd)
        return F.digest(data)


def _remove_item(target: str) -> None:
    """A half-written Orbax item (and Orbax's own temporary directories for it) from a killed run."""
    folder, base = os.path.dirname(target), os.path.basename(target)
    for name in os.listdir(folder):
        if name == base or name.startswith(base + ".orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(folder, name))


def convert(src: str, out: str, *, piece_bytes: int = F.DEFAULT_PIECE_BYTES, progress: bool = True) -> dict:
    """Convert (or finish converting) `src` into the checkpoint directory `out`; returns a summary."""
    return Conversion(src, out, piece_bytes, progress).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jds41.checkpoints.convert", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="the GGUF file (any shard of a set); with --verify, the checkpoint directory")
    ap.add_argument("out", nargs="?", help="the checkpoint directory to write")
    ap.add_argument("--profile", help="after converting, open the checkpoint with this tier profile")
    ap.add_argument("--piece-mib", type=int, default=F.DEFAULT_PIECE_BYTES >> 20,
                    help="bytes held in memory per piece (dense item, expert batch, Engram part)")
    ap.add_argument("--verify", action="store_true", help="hash every stored byte of MODEL (a checkpoint)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = ap.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every save at WARNING
    try:
        if args.verify:
            with open_checkpoint(args.model) as ckpt:
                summary = {"verified": args.model, **ckpt.verify_all()}
        else:
            if args.out is None:
                ap.error("OUT_DIR is required")
            summary = convert(args.model, args.out, piece_bytes=args.piece_mib << 20, progress=not args.quiet)
            if args.profile:
                from jds41.engine import Engine

                t0 = time.perf_counter()
                engine = Engine.open(args.out, profile=args.profile, progress=not args.quiet)
                summary["profile"] = {"name": args.profile, "open_seconds": round(time.perf_counter() - t0, 3),
                                      "placement": engine.tiers.stats()["placement_experts"]}
                engine.tiers.close()
    except Jds41Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
