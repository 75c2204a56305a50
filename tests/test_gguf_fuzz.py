"""Fuzzing the GGUF reader: corrupted headers and random bytes end in success or ModelFileError, nothing else.

Inputs are built from valid tiny files (deepseek4 and deepseek41, no tokenizer, so the header is small and most
mutations hit structure rather than string bytes):
- random byte mutations anywhere in the header region,
- numeric header fields (counts, key/string/array lengths, value types, dims, tensor types, data offsets)
  overwritten with boundary values or random ones: the fields are located by parsing the valid file,
- truncation at any length (data section included),
- random bytes after a GGUF magic (and after a valid version).
Each example must finish within the hypothesis deadline and within MEMORY_LIMIT traced allocations, and an error
must be a ModelFileError that names the file and did not come from the reader's catch-all (which would mean a
check is missing). ~200 examples by default; `-m slow` adds a 2,000-example run.
"""

from __future__ import annotations

import tracemalloc
from datetime import timedelta
from pathlib import Path

import pytest
from gguf import GGUFValueType as V
from gguf_surgery import key_field, tensor_field, write_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jds41.checkpoints import Header, open_model, read_header
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.errors import ModelFileError

pytestmark = pytest.mark.timeout(600)
MEMORY_LIMIT = 64 << 20
_SCALAR_SIZES = {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
                 V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}
_BOUNDARY = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 24, 31, 32, 63, 64, 255, 256, 4095, 4096, 4097, (1 << 31) - 1,
             1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def header_fields(h: Header) -> list[tuple[int, int]]:
    """(offset, size) of every numeric field of the header: the ones a corrupt value can make dangerous."""
    fields = [(4, 4), (8, 8), (16, 8)]  # version, tensor count, key/value count
    for key, e in h.keys.items():
        fields += [(key_field(h, key, "key_len"), 8), (key_field(h, key, "type"), 4)]
        if e.value_type == V.STRING:
            fields.append((e.value_offset, 8))
        elif e.value_type == V.ARRAY:
            fields += [(e.value_offset, 4), (e.value_offset + 4, 8)]
            if e.item_type == V.STRING:  # the first few element lengths
                pos = e.value_offset + 12
                for s in h.metadata[key][:3]:
                    fields.append((pos, 8))
                    pos += 8 + len(s.encode())
        else:
            fields.append((e.value_offset, _SCALAR_SIZES[e.value_type]))
    for t in h.tensors:
        fields += [(tensor_field(h, t.name, "name_len"), 8), (tensor_field(h, t.name, "n_dims"), 4),
                   (tensor_field(h, t.name, "type"), 4), (tensor_field(h, t.name, "offset"), 8)]
        fields += [(tensor_field(h, t.name, "ne0") + 8 * i, 8) for i in range(len(t.ne))]
    return fields


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> list[tuple[bytes, list[tuple[int, int]], int]]:
    """(file bytes, header fields, header length) of each valid base file."""
    folder = tmp_path_factory.mktemp("fuzz-base")
    out = []
    for arch in ("deepseek4", "deepseek41"):
        path = folder / f"{arch}.gguf"
        write_synthetic(path, preset(arch, "tiny", layers=2), quant="q8", progress=False, tokenizer="none")
        h = read_header(path)
        out.append((path.read_bytes(), header_fields(h), h.tensor_info_end))
    return out


def corrupted(bases) -> st.SearchStrategy[bytes]:
    base = st.sampled_from(bases)

    @st.composite
    def byte_mutations(draw) -> bytes:
        data, _, header_len = draw(base)
        out = bytearray(data)
        for pos, value in draw(st.lists(st.tuples(st.integers(0, header_len - 1), st.integers(0, 255)),
                                        min_size=1, max_size=8)):
            out[pos] = value
        return bytes(out)

    @st.composite
    def field_overwrites(draw) -> bytes:
        data, fields, _ = draw(base)
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            pos, size = draw(st.sampled_from(fields))
            top = (1 << (8 * size)) - 1
            value = draw(st.one_of(st.sampled_from(_BOUNDARY), st.integers(0, top))) & top
            out[pos:pos + size] = value.to_bytes(size, "little")
        return bytes(out)

    @st.composite
    def truncations(draw) -> bytes:
        data, _, header_len = draw(base)
        cut = draw(st.one_of(st.integers(0, header_len + 64), st.integers(0, len(data))))
        return data[:cut]

    random_files = st.one_of(
        st.binary(max_size=2048).map(lambda b: b"GGUF" + b),
        st.tuples(st.sampled_from([2, 3]), st.binary(max_size=2048)).map(
            lambda v: b"GGUF" + v[0].to_bytes(4, "little") + v[1]),
    )
    return st.one_of(byte_mutations(), field_overwrites(), truncations(), random_files)


def open_or_fail_cleanly(path: Path) -> str:
    """Open `path`: 'ok', or the ModelFileError's message; anything else (or a memory blow-up) fails the test."""
    tracemalloc.start()
    try:
        with open_model(path):
            outcome = "ok"
    except ModelFileError as e:
        assert str(path) in str(e)
        assert "unexpected" not in str(e), f"reached the catch-all: {e}"
        outcome = str(e)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MEMORY_LIMIT, f"allocated {peak >> 20} MiB"
    return outcome


@pytest.mark.parametrize("examples", [200, pytest.param(2000, marks=pytest.mark.slow)])
def test_corrupt_headers_fail_cleanly(bases, tmp_path, examples):
    path = tmp_path / "fuzz.gguf"

    @settings(max_examples=examples, deadline=timedelta(seconds=2), database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=corrupted(bases))
    def check(data: bytes) -> None:
        open_or_fail_cleanly(write_bytes(path, data))

    check()


def test_the_bases_open(bases, tmp_path):
    for data, _, _ in bases:  # so "ok" outcomes in the fuzz runs are reachable
        assert open_or_fail_cleanly(write_bytes(tmp_path / "base.gguf", data)) == "ok"
