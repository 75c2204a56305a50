"""The GGUF files shipped in checkpoints/: each matches its manifest checksum, validates, generates, and is exactly
what its recorded command writes today (so the writer and the shipped files cannot drift apart silently)."""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jds41.checkpoints import open_model

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"


def _sha_table(manifest: Path) -> dict[str, str]:
    return {name: f["sha256"] for name, f in json.loads(manifest.read_text())["files"].items()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_INDEX = json.loads((CKPT / "MANIFEST.json").read_text())
MANIFEST = _INDEX["files"]  # synthetic files: each rebuilt bit for bit by its recorded command
# trained models: training is not bit-reproducible, so each model's own manifest holds the checksums of its files
TRAINED_SETS = {entry: _sha_table(CKPT / spec["manifest"]) for entry, spec in _INDEX.get("trained", {}).items()}
TRAINED = {name: sha for files in TRAINED_SETS.values() for name, sha in files.items()}
DRAFTS = {entry: spec["draft_for"] for entry, spec in _INDEX.get("trained", {}).items() if "draft_for" in spec}


def test_manifest_lists_every_shipped_file():
    assert sorted(p.name for p in CKPT.glob("*.gguf")) == sorted([*MANIFEST, *(n for n in TRAINED
                                                                              if n.endswith(".gguf"))])


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_trained_files_match_their_manifest(name):
    assert _sha256(CKPT / name) == TRAINED[name]


def _first_gguf(entry: str) -> Path:
    return CKPT / sorted(n for n in TRAINED_SETS[entry] if n.endswith(".gguf"))[0]


@pytest.mark.parametrize("entry", sorted(set(TRAINED_SETS) - set(DRAFTS)))
def test_trained_model_opens_from_its_first_shard(entry):
    with open_model(_first_gguf(entry)) as m:
        assert m.config.arch == "deepseek41" and m.config.n_layers == 8 and len(m.shards) == 4


@pytest.mark.parametrize("entry", sorted(DRAFTS))
def test_trained_drafter_belongs_to_its_model(entry):
    from jds41.speculative import check_compatible

    with open_model(_first_gguf(DRAFTS[entry])) as target, open_model(_first_gguf(entry)) as draft:
        check_compatible(target.config, draft.config, str(_first_gguf(entry)))  # raises when made for another
        d, t = draft.config.dspark, target.config.dspark
        assert (d.target_layer_ids, d.block_size, d.markov_rank) == (t.target_layer_ids, t.block_size, t.markov_rank)
        assert draft.config.n_nextn == 2 and (d.n_experts, d.n_experts_used) == (16, 2)  # MODEL.md §6 small


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_shipped_file_checksum_and_validation(name):
    path = CKPT / name
    assert _sha256(path) == MANIFEST[name]["sha256"]
    with open_model(path) as m:
        assert m.config.n_layers > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_recorded_command_reproduces_the_file(name, tmp_path):
    args = shlex.split(MANIFEST[name]["command"])
    args[args.index("--out") + 1] = str(tmp_path / name)
    subprocess.run([sys.executable, *args[1:], "--quiet"], check=True, cwd=ROOT, capture_output=True)
    assert _sha256(tmp_path / name) == MANIFEST[name]["sha256"]


def test_generate_cli_prints_text_from_the_shipped_model():
    out = subprocess.run([sys.executable, "-m", "jds41.generate", str(ROOT / "checkpoints" / "tiny-deepseek41-q8.gguf"),
                          "-p", "def fibonacci(n):", "-n", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["tokens"]) == 8 and isinstance(result["text"], str) and result["text"]


def _readme_run_command() -> list[str]:
    """The `python -m jds41.generate ...` part of the README's install-and-run line."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if "python -m jds41.generate" in ln)
    return shlex.split(line[line.index("python -m jds41.generate"):])


@pytest.mark.slow
def test_readme_run_command_generates_and_drafting_changes_nothing():
    """The README's main job on the trained model: drafting with the shipped drafter gives plain decode's tokens."""
    args = _readme_run_command()
    args[args.index("-n") + 1] = "12"
    assert "--draft" in args
    plain = args[:args.index("--draft")] + args[args.index("--draft") + 2:]
    outs = []
    for cmd in (args, plain):
        r = subprocess.run([sys.executable, *cmd[1:], "--json"], capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout))
    assert len(outs[0]["tokens"]) == 12 and outs[0]["tokens"] == outs[1]["tokens"] and outs[0]["text"]
