"""GGUF -> Orbax checkpoint round trips (jds41.checkpoints.convert): the converted directory must give the GGUF's
bytes, logits and greedy tokens exactly, through the engine with and without a tier profile and through the
generate CLI; damaged bytes must be refused by name.

The reference is always the GGUF path itself (Engine.open on the source file), never recorded numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jds41.checkpoints import open_model
from jds41.checkpoints import orbax_layout as F
from jds41.checkpoints.convert import ConvertError, convert
from jds41.checkpoints.orbax_model import OrbaxModel
from jds41.checkpoints.orbax_stacks import read_layer_stacks
from jds41.engine import Engine
from jds41.errors import ModelFileError
from jds41.tiers.ssd import ExpertReadError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"deepseek41": ROOT / "checkpoints" / "tiny-deepseek41-q8.gguf",
           "deepseek4": ROOT / "checkpoints" / "tiny-deepseek4-mxfp4.gguf"}
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(34)]  # past one prefill chunk (32): scan and single steps both run


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """arch -> (gguf path, checkpoint dir), each converted once per module."""
    root = tmp_path_factory.mktemp("orbax")
    out = {}
    for arch, src in SHIPPED.items():
        dst = root / arch
        convert(str(src), str(dst), progress=False)
        out[arch] = (src, dst)
    return out


def _logits_and_tokens(path, profile=None, prompt=PROMPT):
    engine = Engine.open(str(path), profile=profile)
    try:
        logits = engine.session().feed(prompt, all_logits=True)
        tokens = list(engine.session().generate(prompt[:5], 4))
        return logits, tokens, engine
    finally:
        if engine.tiers is not None:
            engine.tiers.close()


@pytest.mark.parametrize("arch", sorted(SHIPPED))
def test_every_tensor_byte_and_key_survives(converted, arch):
    src, dst = converted[arch]
    with open_model(src) as gguf, open_model(dst) as ckpt:
        assert isinstance(ckpt, OrbaxModel)
        assert ckpt.metadata == gguf.metadata and ckpt.config == gguf.config
        assert sorted(ckpt.tensors) == sorted(gguf.tensors)
        for name, t in gguf.tensors.items():
            c = ckpt.tensors[name]
            assert (c.ggml_type, c.shape, c.n_bytes) == (t.ggml_type, t.shape, t.n_bytes), name
            assert np.array_equal(ckpt.raw(name), gguf.raw(name)), name
        for el in ckpt.expert_layers.values():  # every chunk starts on a 4 KiB boundary: O_DIRECT reads it
            assert el.stride % 4096 == 0 and all(el.chunk_offset(e) % 4096 == 0 for e in range(el.n_experts))


@pytest.mark.parametrize("experts_per_batch", [1, 3])
def test_batched_stack_reads_match_the_gguf(converted, experts_per_batch):
    """The loader's bulk read in several batches (bounce buffers reused, a short last batch) gives the GGUF's
    stacks byte for byte."""
    src, dst = converted["deepseek41"]
    with open_model(src) as gguf, open_model(dst) as ckpt:
        for layer, el in ckpt.expert_layers.items():
            assert experts_per_batch == 1 or el.n_experts % experts_per_batch  # 3: a short last batch
            stacks = read_layer_stacks(ckpt.experts_path, el, ckpt.check_expert,
                                       batch_bytes=el.stride * experts_per_batch + 1)
            for kind, stack in stacks.items():
                want = gguf.raw(f"blk.{layer}.ffn_{kind}_exps.weight")
                assert np.array_equal(stack.reshape(want.shape), want), (layer, kind)


@pytest.mark.slow
@pytest.mark.parametrize("arch, profile", [("deepseek41", None), ("deepseek4", None), ("deepseek41", "ssd-heavy")])
def test_engine_logits_and_greedy_tokens_identical(converted, arch, profile):
    src, dst = converted[arch]
    want_logits, want_tokens, _ = _logits_and_tokens(src, profile)
    got_logits, got_tokens, engine = _logits_and_tokens(dst, profile)
    assert np.array_equal(got_logits, want_logits)  # bitwise
    assert got_tokens == want_tokens
    if profile is not None:  # the SSD tier really read from the chunk file, O_DIRECT, and served selections
        assert all(s.path == os.path.join(str(dst), F.EXPERTS_FILE) for st in engine.tiers.layout.stacks.values()
                   for s in st)
        assert engine.tiers.lookups[2] > 0 and engine.tiers.reader.stats.bytes_read > 0


@pytest.mark.slow
def test_synthetic_model_round_trip(synthetic_model, tmp_path):
    """A synthetic file of another quant mix (F32 everywhere) than the shipped ones; decode steps only."""
    src = synthetic_model("deepseek41", "tiny", "f32")
    convert(str(src), str(tmp_path / "ck"), progress=False)
    want_logits, want_tokens, _ = _logits_and_tokens(src, prompt=PROMPT[:6])
    got_logits, got_tokens, _ = _logits_and_tokens(tmp_path / "ck", prompt=PROMPT[:6])
    assert np.array_equal(got_logits, want_logits) and got_tokens == want_tokens


@pytest.mark.slow
def test_generate_cli_output_identical(converted):
    """`python -m jds41.generate DIR` prints what the engine gives for the GGUF, text included."""
    src, dst = converted["deepseek41"]
    out = subprocess.run([sys.executable, "-m", "jds41.generate", str(dst), "--tokens", "5,9,13,2", "-n", "5",
                          "--json", "--ignore-eos"], check=True, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    engine = Engine.open(str(src))
    want = list(engine.session().generate([5, 9, 13, 2], 5))
    assert got["tokens"] == want
    assert got["text"] == engine.tokenizer.decode(want)


@pytest.mark.parametrize("memory_kind", ["device", "pinned_host"])
def test_restore_into_memory_kinds(converted, memory_kind):
    src, dst = converted["deepseek41"]
    with open_model(src) as gguf, open_model(dst) as ckpt:
        names = [n for n, e in ckpt.manifest["tensors"].items() if e["store"] == "orbax"]
        got = ckpt.restore(names, memory_kind=memory_kind)
        for name in names:
            assert got[name].sharding.memory_kind == memory_kind, name
            assert np.array_equal(np.asarray(got[name]).reshape(-1).view(np.uint8),
                                  gguf.raw(name).reshape(-1)), name
        with pytest.raises(ValueError, match="no memory kind"):
            ckpt.restore(names[:1], memory_kind="no-such-kind")


def _copy(converted, tmp_path, arch="deepseek41") -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(converted[arch][1], dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_corrupted_expert_chunk_is_named(converted, tmp_path):
    dst = _copy(converted, tmp_path)
    with open_model(dst) as ckpt:
        layer = min(ckpt.expert_layers)
        el = ckpt.expert_layers[layer]
        expert = el.n_experts - 1
        _flip(dst / F.EXPERTS_FILE, el.chunk_offset(expert) + el.piece_bytes[0] + 3)  # inside its "up" piece
        with ckpt.expert_reader() as reader:
            reader.read([(layer, 0)])  # a good neighbour still reads
            with pytest.raises(ExpertReadError, match="checksum mismatch") as err:
                reader.read([(layer, expert)])
        assert (err.value.layer, err.value.expert) == (layer, expert)
        assert f"blk.{layer}.ffn_" in str(err.value)
    with pytest.raises(ModelFileError, match=f"expert {expert} of blk.{layer}"):  # the loader path (no profile)
        Engine.open(str(dst))
    with pytest.raises(ModelFileError, match=f"expert {expert} of blk.{layer}"):
        open_model(dst).verify_all()


def test_corrupted_dense_tensor_is_named(converted, tmp_path):
    dst = _copy(converted, tmp_path)
    with open_model(dst) as ckpt:
        name = "blk.1.attn_q_a.weight"
        entry = ckpt.manifest["tensors"][name]
    chunk = next((dst / F.DENSE_DIR / entry["item"] / entry["key"]).glob("0*"))  # zarr2: one raw chunk file
    _flip(chunk, chunk.stat().st_size // 2)
    with pytest.raises(ModelFileError, match="checksum mismatch") as err:
        Engine.open(str(dst))
    assert err.value.tensor == name


def test_unfinished_or_foreign_directories_are_refused(converted, tmp_path):
    dst = _copy(converted, tmp_path)
    (dst / F.JOURNAL).write_text("")
    with pytest.raises(ModelFileError, match="unfinished conversion"):
        open_model(dst)
    (dst / F.JOURNAL).unlink()
    (dst / F.MANIFEST).unlink()
    with pytest.raises(ModelFileError, match="no manifest.json"):
        open_model(dst)
    with pytest.raises(ModelFileError, match="not a jds41 Orbax checkpoint"):
        open_model(tmp_path)
    with pytest.raises(ConvertError, match="already exists"):
        convert(str(SHIPPED["deepseek41"]), str(converted["deepseek41"][1]), progress=False)


def test_serve_loader_opens_a_checkpoint(converted):
    """The server's loader (validate, read every file for progress, build the engine) takes the directory."""
    from jds41.serve import ServeOptions
    from jds41.serve.loader import ModelLoader

    _, dst = converted["deepseek4"]
    loader = ModelLoader(str(dst), ServeOptions(warmup=False, slots=1))
    loader._load()
    try:
        assert loader.ready and loader.engine.cfg.arch == "deepseek4"
        files = [p for p in dst.rglob("*") if p.is_file()]
        assert loader.bytes_done == loader.bytes_total == sum(p.stat().st_size for p in files)
    finally:
        loader.stop()
