"""Broken GGUF files: each one must fail fast, within a small memory bound, with a ModelFileError that names the
file and, where one is at fault, the tensor or key.

Every broken file starts from a valid tiny synthetic model (deepseek4 with the synthetic tokenizer, so the header
holds large string arrays; deepseek41 for the Engram token map). Byte positions come from parsing the valid
file (`read_header` section offsets + the GGUF record layout, see gguf_surgery.py); edits that change sizes go
through `copy_model` (gguf-py's writer).
"""

from __future__ import annotations

import dataclasses
import re
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf_surgery import DROP, copy_model, data_start, key_field, patch, tensor_field, write_bytes

from jds41.checkpoints import Header, open_model, read_header
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.errors import ConfigError, ModelFileError

pytestmark = pytest.mark.timeout(60)
TIME_LIMIT_S = 2.0  # the valid file opens in ~50 ms; a hang or quadratic walk shows up far above this
MEMORY_LIMIT = 32 << 20  # traced Python + numpy allocations while opening (the valid file needs ~2 MB)
ALIGN = 4096  # the presets' general.alignment


@dataclasses.dataclass
class Ctx:
    valid: Path
    data: bytes
    header: Header
    tmp: Path

    @property
    def data_start(self) -> int:
        return data_start(self.header, ALIGN)

    def tensor(self, name: str):
        return next(t for t in self.header.tensors if t.name == name)

    def write(self, data: bytes) -> Path:
        return write_bytes(self.tmp / "broken.gguf", data)

    def copy(self, **edits) -> Path:
        return Path(copy_model(self.valid, self.tmp / "broken.gguf", **edits)[0])


def _valid(folder: Path, arch: str) -> Path:
    path = folder / f"{arch}.gguf"
    write_synthetic(path, preset(arch, "tiny", layers=2), quant="f32", progress=False)
    return path


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("valid")
    return {arch: _valid(folder, arch) for arch in ("deepseek4", "deepseek41")}


def _ctx(valid: Path, tmp: Path) -> Ctx:
    return Ctx(valid, valid.read_bytes(), read_header(valid), tmp)


def open_fails(path: Path, error: type = ModelFileError) -> ModelFileError:
    """Open `path`, expecting `error`; check it came quickly, within MEMORY_LIMIT, and names the file."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            open_model(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.2f} s"
    assert peak < MEMORY_LIMIT, f"allocated {peak >> 20} MiB"
    assert str(path) in str(info.value)
    assert "unexpected" not in str(info.value), "reached the catch-all: a check is missing"
    return info.value


def test_valid_files_open_within_the_same_bounds(valid_files):
    for path in valid_files.values():
        tracemalloc.start()
        start = time.perf_counter()
        open_model(path).close()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert time.perf_counter() - start < TIME_LIMIT_S and peak < MEMORY_LIMIT


# ---- the table: id -> (build the broken file, expected error, names in the message, pattern) -------------------
TK = "tokenizer.ggml.tokens"
NORM0, NORM1 = "blk.0.attn_norm.weight", "blk.1.attn_norm.weight"
TID, SINKS = "blk.0.ffn_gate_tid2eid.weight", "blk.0.attn_sinks.weight"


def _last_tensor(c: Ctx):
    return max(c.header.tensors, key=lambda t: t.offset)


def _same_length_keys(c: Ctx) -> tuple[str, str]:
    keys = list(c.header.keys)
    return next((a, b) for a in keys for b in keys if a < b and len(a) == len(b))


Case = tuple[Callable[[Ctx], Path], type, tuple[str, ...], str]
CASES: dict[str, Case] = {
    # truncation, at every section
    "truncated_in_magic": (lambda c: c.write(c.data[:2]), ModelFileError, (), r"truncated: magic"),
    "empty_file": (lambda c: c.write(b""), ModelFileError, (), r"truncated: magic"),
    "truncated_in_counts": (lambda c: c.write(c.data[:12]), ModelFileError, (), r"truncated: tensor count"),
    "truncated_in_key_name": (lambda c: c.write(c.data[:key_field(c.header, TK, "key") + 5]), ModelFileError, (),
                              r"key/value entry #\d+ .*truncated"),
    "truncated_in_kv_value": (lambda c: c.write(c.data[:key_field(c.header, TK, "value") + 100]), ConfigError,
                              (TK,), r"truncated"),
    "truncated_in_tensor_info": (lambda c: c.write(c.data[:tensor_field(c.header, NORM1, "type") + 2]),
                                 ModelFileError, (NORM1,), r"truncated: type"),
    "truncated_in_padding": (lambda c: c.write(c.data[:c.header.tensor_info_end + 1]), ModelFileError, (),
                             r"truncated: the data section would start"),
    "truncated_in_first_tensor": (lambda c: c.write(c.data[:c.data_start + 10]), ModelFileError,
                                  ("token_embd.weight",), r"past the end of the file"),
    "truncated_in_last_tensor": (lambda c: c.write(c.data[:c.data_start + _last_tensor(c).offset + 2]),
                                 ModelFileError, (), r"past the end of the file"),
    # magic and version
    "bad_magic": (lambda c: c.write(patch(c.data, 0, "4s", b"GGML")), ModelFileError, (), r"not a GGUF file"),
    "version_4": (lambda c: c.write(patch(c.data, 4, "I", 4)), ModelFileError, (), r"unsupported GGUF version 4"),
    "version_max": (lambda c: c.write(patch(c.data, 4, "I", 0xFFFFFFFF)), ModelFileError, (),
                    r"unsupported GGUF version 4294967295"),
    "version_1": (lambda c: c.write(patch(c.data, 4, "I", 1)), ModelFileError, (), r"unsupported GGUF version 1"),
    "big_endian": (lambda c: c.write(patch(c.data, 4, ">I", 3)), ModelFileError, (), r"big-endian"),
    # counts
    "absurd_tensor_count": (lambda c: c.write(patch(c.data, 8, "Q", 1 << 63)), ModelFileError, (),
                            r"tensor count \d+ is impossible"),
    "tensor_count_plus_one": (lambda c: c.write(patch(c.data, 8, "Q", len(c.header.tensors) + 1)), ModelFileError,
                              (), r"overlaps tensor ''"),  # the extra record is read from the zero padding
    "absurd_kv_count": (lambda c: c.write(patch(c.data, 16, "Q", (1 << 64) - 1)), ModelFileError, (),
                        r"key/value count \d+ is impossible"),
    "kv_count_plus_one": (lambda c: c.write(patch(c.data, 16, "Q", len(c.header.keys) + 1)), ModelFileError, (),
                          r"tensor info #0 .*exceeds the limit"),  # tensor 0 read as a key
    # strings and arrays
    "absurd_key_length": (lambda c: c.write(patch(c.data, key_field(c.header, TK, "key_len"), "Q", 1 << 63)),
                          ModelFileError, (), r"key/value entry #\d+ .*key length"),
    "absurd_string_length": (lambda c: c.write(patch(c.data, key_field(c.header, "general.name", "value"), "Q",
                                                     1 << 62)), ConfigError, ("general.name",), r"length"),
    "string_length_past_end": (lambda c: c.write(patch(c.data, key_field(c.header, "general.name", "value"), "Q",
                                                       len(c.data))), ConfigError, ("general.name",), r"truncated"),
    "absurd_array_length": (lambda c: c.write(patch(c.data, key_field(c.header, TK, "length"), "Q", 1 << 60)),
                            ConfigError, (TK,), r"array length \d+ of STRING needs"),
    "absurd_tensor_name_length": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM1, "name_len"), "Q",
                                                          1 << 40)), ModelFileError, (), r"tensor info #\d+"),
    "key_not_utf8": (lambda c: c.write(patch(c.data, key_field(c.header, "general.name", "key"), "B", 0xFF)),
                     ModelFileError, (), r"not valid UTF-8"),
    "nesting_too_deep": (lambda c: c.copy(keys={"x.deep": ([[[1]]], V.ARRAY, V.ARRAY)}), ConfigError, ("x.deep",),
                         r"nested"),
    # value types
    "unknown_value_type": (lambda c: c.write(patch(c.data, key_field(c.header, "general.name", "type"), "I", 13)),
                           ConfigError, ("general.name",), r"unknown value type 13"),
    "unknown_array_item_type": (lambda c: c.write(patch(c.data, key_field(c.header, TK, "item_type"), "I", 99)),
                                ConfigError, (TK,), r"unknown array item type 99"),
    "duplicate_key": (lambda c: c.write(patch(c.data, key_field(c.header, _same_length_keys(c)[1], "key"),
                                              f"{len(_same_length_keys(c)[0])}s", _same_length_keys(c)[0].encode())),
                      ConfigError, (), r"duplicate key"),
    # tensor records
    "wrong_shape": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "ne0"), "Q", 32)), ModelFileError,
                    (NORM0,), r"shape \(32,\), expected \(64,\)"),
    "wrong_type_tid2eid_f32": (lambda c: c.write(patch(c.data, tensor_field(c.header, TID, "type"), "I", T.F32)),
                               ModelFileError, (TID,), r"type F32 not allowed .*allowed: I32"),
    "unknown_ggml_type": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "type"), "I", 99)),
                          ModelFileError, (NORM0,), r"unknown ggml type id 99"),
    "partial_quant_block": (lambda c: c.write(patch(c.data, tensor_field(c.header, SINKS, "type"), "I", T.Q8_0)),
                            ModelFileError, (SINKS,), r"row length 2 is not a multiple of Q8_0's block size 32"),
    "quantized_vector": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "type"), "I", T.Q8_0)),
                         ModelFileError, (NORM0,), r"type Q8_0 not allowed for a vector tensor"),
    "too_many_dims": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "n_dims"), "I", 5)),
                      ModelFileError, (NORM0,), r"5 dimensions"),
    "offset_past_end": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "offset"), "Q",
                                                -(-len(c.data) // ALIGN) * ALIGN)), ModelFileError, (NORM0,),
                        r"past the end of the file"),
    "absurd_offset": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "offset"), "Q", 1 << 63)),
                      ModelFileError, (NORM0,), r"past the end of the file"),
    "misaligned_offset": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM0, "offset"), "Q",
                                                  c.tensor(NORM0).offset + 32)), ModelFileError, (NORM0,),
                          r"not a multiple of the alignment 4096"),
    "overlapping_data": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM1, "offset"), "Q",
                                                 c.tensor(NORM0).offset)), ModelFileError, (NORM0, NORM1),
                         r"overlaps"),
    "duplicate_tensor": (lambda c: c.write(patch(c.data, tensor_field(c.header, NORM1, "name"), f"{len(NORM0)}s",
                                                 NORM0.encode())), ModelFileError, (NORM0,), r"duplicate tensor"),
    "missing_tensor": (lambda c: c.copy(tensors={"blk.1.attn_kv.weight": DROP}), ModelFileError,
                       ("blk.1.attn_kv.weight",), r"required tensor missing"),
    "unknown_extra_tensor": (lambda c: c.copy(tensors={"blk.0.markov_w1.weight": (np.zeros(64, np.float32), T.F32)}),
                             ModelFileError, ("blk.0.markov_w1.weight",), r"unknown tensor"),
    # keys
    "alignment_not_power_of_two": (lambda c: c.write(patch(c.data, key_field(c.header, "general.alignment",
                                                                             "value"), "I", 3000)),
                                   ConfigError, ("general.alignment",), r"power of two"),
    "alignment_mistyped": (lambda c: c.copy(keys={"general.alignment": (4096, V.UINT64)}), ConfigError,
                           ("general.alignment",), r"must be a UINT32"),
    "wrong_architecture": (lambda c: c.copy(keys={"general.architecture": ("deepseek2", V.STRING)}), ConfigError,
                           ("general.architecture",), r"unsupported architecture 'deepseek2'"),
    "missing_architecture": (lambda c: c.copy(keys={"general.architecture": DROP}), ConfigError,
                             ("general.architecture",), r"unsupported architecture None"),
    "missing_required_key": (lambda c: c.copy(keys={"deepseek4.expert_count": DROP}), ConfigError,
                             ("deepseek4.expert_count",), r"required key not found"),
    "mistyped_key": (lambda c: c.copy(keys={"deepseek4.block_count": ("2", V.STRING)}), ConfigError,
                     ("deepseek4.block_count",), r"expected an integer, got str"),
    "tokens_not_vocab_size": (lambda c: c.copy(keys={TK: (c.header.metadata[TK][:-1], V.ARRAY, V.STRING)}),
                              ConfigError, (TK,), r"has 511 tokens, vocab_size is 512"),
    "token_type_length": (lambda c: c.copy(keys={"tokenizer.ggml.token_type": ([1, 1], V.ARRAY, V.INT32)}),
                          ConfigError, ("tokenizer.ggml.token_type",), r"one per token"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_file(case, valid_files, tmp_path):
    build, error, names, pattern = CASES[case]
    path = build(_ctx(valid_files["deepseek4"], tmp_path))
    err = open_fails(path, error)
    for name in names:
        assert repr(name) in str(err), f"{name!r} not named in: {err}"
    assert re.search(pattern, str(err)), str(err)


# ---- the Engram token map (deepseek41) --------------------------------------------------------------------------
TMAP = "deepseek41.engram.token_map"


@pytest.mark.parametrize("value,pattern", [
    (lambda tmap: tmap[:-1], r"has 511 entries, expected 512"),
    (lambda tmap: tmap[:-1] + [1 << 31], r"values must lie in \[0, 2147483648\)"),
], ids=["short", "out_of_range"])
def test_bad_token_map(valid_files, tmp_path, value, pattern):
    c = _ctx(valid_files["deepseek41"], tmp_path)
    tmap = c.header.metadata[TMAP]
    assert len(tmap) == 512 and max(tmap) < 1 << 31  # the valid file's map passes
    err = open_fails(c.copy(keys={TMAP: (value(tmap), V.ARRAY, V.UINT64)}), ConfigError)
    assert err.key == TMAP and re.search(pattern, str(err)), str(err)


def test_token_map_required_with_engram(valid_files, tmp_path):
    c = _ctx(valid_files["deepseek41"], tmp_path)
    err = open_fails(c.copy(keys={TMAP: DROP}), ConfigError)
    assert err.key == TMAP and "required key not found" in str(err)


def test_token_map_of_strings(valid_files, tmp_path):
    c = _ctx(valid_files["deepseek41"], tmp_path)
    err = open_fails(c.copy(keys={TMAP: (["1"] * 512, V.ARRAY, V.STRING)}), ConfigError)
    assert err.key == TMAP and "array of integers" in str(err)


def test_array_of_arrays_is_read_as_nested_lists(valid_files, tmp_path):
    c = _ctx(valid_files["deepseek4"], tmp_path)
    with open_model(c.copy(keys={"x.nested": ([[1, 2], [3]], V.ARRAY, V.ARRAY)})) as model:
        assert model.metadata["x.nested"] == [[1, 2], [3]]
