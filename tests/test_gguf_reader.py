"""Opening valid GGUF models: metadata, tensor directory, zero-copy views, absolute offsets, shard sets.

gguf-py's GGUFReader is the oracle for a single file (same metadata values, offsets, sizes and bytes); plain
`os.pread` is the oracle for absolute offsets (what the SSD tier's O_DIRECT reads will use); the single file is
the oracle for the merged directory of a shard set written by gguf-py's split writer.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_surgery import copy_model, patch, tensor_field, write_bytes

from jds41.checkpoints import open_model, read_header
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.errors import ConfigError, ModelFileError

pytestmark = pytest.mark.timeout(120)

# (arch, size, quant layout, tokenizer): together they cover F32, F16, Q8_0, MXFP4, I32 and I8 tensors, both
# KV layouts and headers with and without the tokenizer's large string arrays.
CASES = {"deepseek4-f32": ("deepseek4", "tiny", "f32", "synthetic"),
         "deepseek41-q8": ("deepseek41", "tiny", "q8", "synthetic"),
         "deepseek4-ds4-q2": ("deepseek4", "tiny", "ds4-q2", "none"),
         "deepseek41-shared-mxfp4": ("deepseek41", "tiny-shared", "mxfp4", "none")}


def _cfg(case: str):
    arch, size, _, _ = CASES[case]
    return preset(arch, size, layers=2 if size == "tiny" else None)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = {}
    folder = tmp_path_factory.mktemp("models")
    for case, (_, _, quant, tok) in CASES.items():
        path = folder / f"{case}.gguf"
        write_synthetic(path, _cfg(case), quant=quant, progress=False, tokenizer=tok)
        out[case] = str(path)
    return out


def _pread(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", list(CASES))
def test_metadata_and_directory_match_gguf_py(models, case):
    path = models[case]
    oracle = gguf.GGUFReader(path)
    with open_model(path) as model:
        expect = {k: f.contents() for k, f in oracle.fields.items() if not k.startswith("GGUF.")}
        assert model.metadata == expect
        assert list(model.tensors) == [t.name for t in oracle.tensors]
        for t in oracle.tensors:
            info = model.tensors[t.name]
            assert (info.ggml_type, info.n_bytes, info.offset, info.shard) == (t.tensor_type, t.n_bytes,
                                                                              t.data_offset, path)
            assert info.shape == tuple(reversed(t.shape.tolist()))
            assert model.raw(t.name).tobytes() == t.data.tobytes()
        assert model.config == _cfg(case)
        assert model.alignment == model.config.alignment == 4096
        assert model.shard_sizes == (os.path.getsize(path),)


@pytest.mark.parametrize("case", list(CASES))
def test_views_are_zero_copy_and_offsets_absolute(models, case):
    path = models[case]
    with open_model(path) as model:
        types = set()
        for name, info in model.tensors.items():
            assert info.offset % model.alignment == 0
            on_disk = _pread(path, info.offset, info.n_bytes)
            raw = model.raw(name)
            assert raw.dtype == np.uint8 and raw.shape == (info.n_rows, info.row_bytes)
            assert not raw.flags.owndata and not raw.flags.writeable  # a view of the read-only map, no copy
            assert raw.tobytes() == on_disk
            types.add(info.ggml_type)
            if info.ggml_type in (T.F32, T.F16, T.I32, T.I8):
                typed = model.typed(name)
                assert typed.shape == info.shape and not typed.flags.owndata
                np.testing.assert_array_equal(typed, np.frombuffer(on_disk, typed.dtype).reshape(info.shape))
            else:
                with pytest.raises(TypeError, match="quantized"):
                    model.typed(name)
        assert T.I32 in types  # tid2eid of the hash layer
        assert types & {T.F16, T.Q8_0, T.MXFP4, T.F32}


def test_bf16_typed_view(models, tmp_path):
    src = models["deepseek4-f32"]
    with open_model(src) as model:
        embd = model.typed("token_embd.weight").astype(ml_dtypes.bfloat16)
    dst = tmp_path / "bf16.gguf"
    copy_model(src, dst, tensors={"token_embd.weight": (embd, T.BF16)})
    with open_model(dst) as model:
        assert model.tensors["token_embd.weight"].ggml_type == T.BF16
        view = model.typed("token_embd.weight")
        assert view.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(view.astype(np.float32), embd.astype(np.float32))


def test_close_and_context_manager(models):
    model = open_model(models["deepseek4-f32"])
    kept = model.raw("output_norm.weight")
    expect = kept.tobytes()
    with model:
        pass
    with pytest.raises(ValueError, match="closed"):
        model.raw("output_norm.weight")
    assert kept.tobytes() == expect  # views handed out earlier keep their mapping alive
    with pytest.raises(KeyError, match="no tensor"):
        open_model(models["deepseek4-f32"]).raw("nope.weight")


def test_missing_file_and_directory(tmp_path):
    for path in (tmp_path / "absent.gguf", tmp_path):
        with pytest.raises(ModelFileError) as info:
            open_model(path)
        assert str(path) in str(info.value)


# ---- shard sets ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(models, tmp_path_factory) -> tuple[str, list[str]]:
    """The deepseek41 q8 model split into 3 shards by gguf-py's split writer."""
    single = models["deepseek41-q8"]
    with open_model(single) as model:
        per_shard = math.ceil(len(model.tensors) / 3)
    paths = copy_model(single, tmp_path_factory.mktemp("shards") / "m.gguf", split_max_tensors=per_shard)
    assert [os.path.basename(p) for p in paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return single, paths


def test_shards_merge_to_the_single_file(sharded):
    single_path, paths = sharded
    with open_model(single_path) as single:
        for entry in paths:  # any shard's path opens the whole set
            with open_model(entry) as model:
                assert [s.path for s in model.shards] == paths
                assert model.shard_sizes == tuple(os.path.getsize(p) for p in paths)
                assert model.alignment == 4096 and all(s.alignment == 4096 for s in model.shards)
                assert {k: v for k, v in model.metadata.items() if not k.startswith("split.")} == single.metadata
                assert model.metadata["split.count"] == 3 and model.metadata["split.no"] == 0
                assert model.config == single.config
                assert list(model.tensors) == list(single.tensors)
                for name, info in model.tensors.items():
                    ref = single.tensors[name]
                    assert (info.ggml_type, info.shape, info.n_bytes) == (ref.ggml_type, ref.shape, ref.n_bytes)
                    assert model.raw(name).tobytes() == single.raw(name).tobytes()
                    assert _pread(info.shard, info.offset, info.n_bytes) == single.raw(name).tobytes()
                assert len({info.shard for info in model.tensors.values()}) == 3


def test_missing_shard_is_named(sharded, tmp_path):
    _, paths = sharded
    copies = [tmp_path / os.path.basename(p) for p in paths]
    for src, dst in zip(paths, copies):
        dst.write_bytes(Path(src).read_bytes())
    copies[1].unlink()
    for entry in (copies[0], copies[2]):
        with pytest.raises(ModelFileError, match="missing shard 2 of 3") as info:
            open_model(entry)
        assert info.value.path == str(copies[1])


def test_inconsistent_shards(sharded, tmp_path):
    _, paths = sharded
    data = [Path(p).read_bytes() for p in paths]

    def shard_set(*contents: bytes) -> list:
        out = [tmp_path / f"x-{i + 1:05d}-of-{len(contents):05d}.gguf" for i in range(len(contents))]
        for p, c in zip(out, contents):
            write_bytes(p, c)
        return out

    # shard 3's bytes under shard 2's name: split.no disagrees with the file name
    bad = shard_set(data[0], data[2], data[2])
    with pytest.raises(ConfigError, match="split.no") as info:
        open_model(bad[0])
    assert info.value.path == str(bad[1])
    # two of three shards found by name, but the files say 3
    for p in bad:
        p.unlink()
    two = shard_set(data[0], data[1])
    with pytest.raises(ConfigError, match="split.count"):
        open_model(two[0])
    # shard 1 alone under a plain name
    plain = write_bytes(tmp_path / "plain.gguf", data[0])
    with pytest.raises(ConfigError, match="split.count") as info:
        open_model(plain)
    assert "without the -0000i-of-0000N.gguf" in str(info.value)


def test_duplicate_tensor_across_shards(sharded, tmp_path):
    _, paths = sharded
    second = read_header(paths[1])
    # a name of shard 1 and one of shard 2 of the same length, so the rename is a byte patch
    first, victim = next((a.name, b.name) for a in read_header(paths[0]).tensors for b in second.tensors
                         if len(a.name) == len(b.name))
    data = patch(Path(paths[1]).read_bytes(), tensor_field(second, victim, "name"), f"{len(first)}s", first.encode())
    out = [tmp_path / os.path.basename(p) for p in paths]
    for p, src in zip(out, paths):
        write_bytes(p, Path(src).read_bytes())
    write_bytes(out[1], data)
    with pytest.raises(ModelFileError, match="duplicate tensor") as info:
        open_model(out[0])
    assert info.value.tensor == first and info.value.path == str(out[1]) and str(out[0]) in str(info.value)
