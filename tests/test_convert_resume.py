"""The converter's durability and memory: a conversion SIGKILLed at random points leaves nothing that opens, and a
rerun finishes it to the same bytes as an uninterrupted one; peak memory stays bounded by the piece size, not the
model size.

Kills come from the converter's own hook (JDS41_CONVERT_KILL_AFTER=N: SIGKILL at its N-th durability event,
mid-piece or between pieces), in a subprocess, so the kill is a real one with nothing flushed or cleaned up.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jds41.checkpoints import open_model
from jds41.checkpoints import orbax_layout as F
from jds41.checkpoints.convert import KILL_ENV, convert
from jds41.errors import ModelFileError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "checkpoints" / "tiny-deepseek41-q8.gguf"  # has every store: dense items, expert chunks, Engram rows
# Orbax writes its save time (_CHECKPOINT_METADATA) and the path it saved to (commit_success.txt) per item: the
# only files allowed to differ between two conversions of one file.
ORBAX_STAMPED = {"_CHECKPOINT_METADATA", "commit_success.txt"}
SEED = 20261130


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jds41.checkpoints.convert", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ORBAX_STAMPED}


def _refused_or_absent(path: Path) -> None:
    if path.exists():
        with pytest.raises(ModelFileError):
            open_model(path)


@pytest.mark.slow
def test_killed_conversion_is_refused_then_resumes_to_identical_bytes(tmp_path):
    ref = tmp_path / "ref"
    summary = convert(str(SRC), str(ref), piece_bytes=1 << 20, progress=False)
    want = _contents(ref)
    assert summary["events"] > 10
    rng = random.Random(SEED)
    points = sorted(rng.sample(range(1, summary["events"] + 1), 3))
    for k in points:
        out = tmp_path / f"killed-{k}"
        proc = _run([str(SRC), str(out), "--piece-mib", "1", "--quiet"], {KILL_ENV: str(k)})
        assert proc.returncode == -9, (k, proc.returncode, proc.stderr[-2000:])
        _refused_or_absent(out)  # the directory a kill may leave under the final name (before the journal goes)
        _refused_or_absent(Path(str(out) + F.PARTIAL_SUFFIX))
        assert not (out.exists() and not (out / F.JOURNAL).exists()), f"kill at {k} left an openable directory"
        convert(str(SRC), str(out), piece_bytes=1 << 20, progress=False)
        assert not Path(str(out) + F.PARTIAL_SUFFIX).exists()
        got = _contents(out)
        assert sorted(got) == sorted(want), k
        assert [n for n in want if got[n] != want[n]] == [], f"kill at event {k} of {summary['events']}"
        with open_model(out) as ckpt:
            ckpt.verify_all()


@pytest.mark.slow
def test_chained_kills_and_a_corrupted_journaled_piece_are_repaired(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    summary = convert(str(SRC), str(ref), piece_bytes=1 << 20, progress=False)
    rng = random.Random(SEED + 1)
    second, first = rng.randrange(4, summary["events"] - 5), rng.randint(1, 4)
    assert _run([str(SRC), str(out), "--piece-mib", "1", "--quiet"], {KILL_ENV: str(second)}).returncode == -9
    partial = Path(str(out) + F.PARTIAL_SUFFIX)
    journal = [json.loads(line) for line in (partial / F.JOURNAL).read_text().splitlines() if line.strip()]
    done = [e["piece"] for e in journal if e["piece"].startswith("experts:")]
    if done:  # damage a piece the journal calls finished: the rerun must re-verify it and write it again
        layer, e0 = (int(x) for x in done[0].split(":")[1:])
        plan = json.loads((partial / F.PLAN).read_text())
        el = next(F.ExpertLayer.from_json(d) for d in plan["expert_layers"] if d["layer"] == layer)
        with open(partial / F.EXPERTS_FILE, "r+b") as f:
            f.seek(el.chunk_offset(e0) + 5)
            f.write(b"\x00\xff")
    # The resume itself is killed (its count restarts; journaled pieces are no events, and at least 5 remain),
    # then finished.
    assert _run([str(SRC), str(out), "--piece-mib", "1", "--quiet"], {KILL_ENV: str(first)}).returncode == -9
    _refused_or_absent(partial)
    proc = _run([str(SRC), str(out), "--piece-mib", "1", "--quiet", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["resumed"]
    assert _contents(out) == _contents(ref)


def test_partial_of_another_source_is_refused(tmp_path):
    out = tmp_path / "out"
    proc = _run([str(SRC), str(out), "--quiet"], {KILL_ENV: "3"})
    assert proc.returncode == -9
    other = ROOT / "checkpoints" / "tiny-deepseek4-mxfp4.gguf"
    proc = _run([str(other), str(out), "--quiet"])
    assert proc.returncode == 1 and "partial conversion of another source" in proc.stderr


PEAK_SCRIPT = """
import json, resource, sys
from jds41.checkpoints.convert import convert
convert(sys.argv[1], sys.argv[3] + "/warm", piece_bytes=1 << 20, progress=False)  # imports, Orbax and thread pools
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert(sys.argv[2], sys.argv[3] + "/big", piece_bytes=int(sys.argv[4]), progress=False)
print(json.dumps({"base_kib": base, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


@pytest.mark.slow
def test_peak_memory_is_bounded_by_the_piece_not_the_model(synthetic_model, tmp_path):
    big = synthetic_model("deepseek4", "small", "q8")  # ~100 MB, largest tensor ~4.5 MB
    size = os.path.getsize(big)
    piece = 4 << 20
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(SRC), str(big), str(tmp_path), str(piece)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = (r["peak_kib"] - r["base_kib"]) * 1024
    # A converter holding the model would grow by >= its size; pieces of 4 MiB (plus their copies in Orbax and the
    # aligned read buffers) stay within a few pieces (measured: 12 MiB; 25 MiB with 128 MiB pieces, where one
    # layer's experts, ~10 MiB, are the largest piece).
    assert size > 20 * piece
    assert grown < 6 * piece, f"peak RSS grew {grown / 2**20:.1f} MiB converting a {size / 2**20:.0f} MiB model"
    with open_model(tmp_path / "big") as ckpt:
        assert ckpt.verify_all()["expert_chunks"] > 0
