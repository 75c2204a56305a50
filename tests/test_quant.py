"""jds41.quant against gguf-py: bit-exact dequantization of every supported type, and the quantized products.

Bit-exactness is checked on the f32 bit patterns (so -0.0 vs +0.0 and NaN payloads would count), against
`gguf.quants.dequantize`, on (a) uniformly random blocks with finite f16 fields (`random_bits`), (b) gguf-py's own
quantization of normal data where gguf-py can quantize, and (c) valid synthetic blocks (`random_quantized`).

Products are checked against float64 numpy on gguf-py's dequantized weights with the classic bound for any
summation order in f32: |y - y64| <= n * eps32 * sum_i |w_i x_i| (plus the f32 rounding of the result itself).
"""

from __future__ import annotations

import ast
import pathlib
import warnings
import zlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.quant import (
    SUPPORTED_TYPES,
    QTensor,
    block_size,
    dequantize,
    qmatmul,
    qmatvec,
    qmatvec_experts,
    row_bytes,
)
from jds41.quant import random_blocks as rb

ALL = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
IDS = [t.name for t in ALL]
EPS32 = float(np.finfo(np.float32).eps)


def ref_dequant(raw: np.ndarray, qtype) -> np.ndarray:
    with warnings.catch_warnings():  # gguf-py's MXFP4 overflows to inf for e8m0 = 255, as ggml does
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)


def assert_same_bits(got, want) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert not np.isnan(want).any(), "inputs are built NaN-free"
    bad = got.view(np.uint32) != want.view(np.uint32)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} of {bad.size} values differ; first at {i}: {got[i]!r} vs {want[i]!r}")


@jax.jit
def _jit_dequant(qt: QTensor):
    return qt.dequantize()


# jitted once per (type, shape): eager dispatch would compile every small op of a decoder separately
_dequant = jax.jit(dequantize, static_argnums=(1, 2))


# ---------------------------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("qtype", ALL, ids=IDS)
@pytest.mark.parametrize("shape", [(8, 512), (3, 5, 256)], ids=["2d", "experts"])
def test_random_bits_bit_exact(qtype, shape):
    raw = rb.random_bits(np.random.default_rng(zlib.crc32(f"{qtype.name}{shape}".encode())), qtype, shape)
    want = ref_dequant(raw, qtype)
    assert_same_bits(_dequant(raw, qtype, shape), want)
    assert_same_bits(_jit_dequant(QTensor.from_raw(raw, qtype, shape)), want)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4], ids=lambda t: t.name)
def test_gguf_quantize_round_trip_bit_exact(qtype):
    rng = np.random.default_rng(7)
    data = rng.standard_normal((2, 8, 256)).astype(np.float32) * np.float32(3.0)
    data[0, 0, :32] = 0.0  # an all-zero block (Q8_0 d = 0, MXFP4 e = 0)
    raw = rb.quantize(data, qtype)
    want = ref_dequant(gguf.quants.quantize(data, qtype), qtype)
    assert_same_bits(_jit_dequant(QTensor.from_raw(raw, qtype, data.shape)), want)


def test_mxfp4_every_scale_and_code():
    """All 256 e8m0 scales x 16 codes, including the f32-subnormal results XLA:CPU would flush in a multiply."""
    e, code = np.meshgrid(np.arange(256), np.arange(16), indexing="ij")
    raw = np.zeros((256 * 16, 17), np.uint8)
    raw[:, 0] = e.ravel()
    raw[:, 1:] = (code.ravel() | (code.ravel() << 4))[:, None]
    raw = raw.reshape(16, -1)
    assert_same_bits(_dequant(raw, T.MXFP4, None), ref_dequant(raw, T.MXFP4))


def test_iq2xxs_sign_rule_matches_gguf_table():
    # blocks.py expands 7 sign bits with their parity instead of carrying gguf-py's ksigns table
    i = list(range(128))
    parity = np.array([v.bit_count() & 1 for v in i])
    assert np.array_equal(np.array(i) | (parity << 7), np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8))


@pytest.mark.parametrize("qtype", ALL, ids=IDS)
def test_random_quantized_is_valid_and_scaled(qtype):
    scale = 0.02
    raw = rb.random_quantized(np.random.default_rng(3), qtype, (2, 16, 512), scale)
    assert raw.dtype == np.uint8 and raw.shape == (2, 16, row_bytes(qtype, 512))
    want = ref_dequant(raw, qtype)
    assert np.isfinite(want).all()
    assert abs(want.mean()) < 0.05 * scale and 0.8 * scale < want.std() < 1.25 * scale
    assert_same_bits(_dequant(raw, qtype, (2, 16, 512)), want)


def test_random_quantized_streams_into_memmap(tmp_path, monkeypatch):
    monkeypatch.setattr(rb, "_CHUNK_VALUES", 3 * 256)  # force several chunks, one ragged
    shape = (10, 256)
    mm = np.lib.format.open_memmap(tmp_path / "w.npy", mode="w+", dtype=np.uint8, shape=(10, row_bytes(T.Q4_K, 256)))
    got = rb.random_quantized(np.random.default_rng(0), T.Q4_K, shape, 0.1, out=mm)
    assert got is mm
    mm.flush()
    again = rb.random_quantized(np.random.default_rng(0), T.Q4_K, shape, 0.1)
    assert np.array_equal(np.load(tmp_path / "w.npy"), again)
    with pytest.raises(ValueError, match="out must be"):
        rb.random_quantized(np.random.default_rng(0), T.Q4_K, shape, out=np.empty((10, 5), np.uint8))


def test_quantize_wraps_gguf_py_and_refuses_the_rest():
    data = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    for qtype in (T.BF16, T.Q8_0, T.MXFP4):
        assert np.array_equal(rb.quantize(data, qtype), gguf.quants.quantize(data, qtype))
    assert np.array_equal(rb.quantize(data, T.F16), data.astype(np.float16).view(np.uint8))
    for qtype in (T.Q4_K, T.Q2_K, T.IQ2_XXS):
        with pytest.raises(NotImplementedError, match="random_quantized"):
            rb.quantize(np.zeros((1, 256), np.float32), qtype)


def test_random_blocks_has_no_jax_import():
    tree = ast.parse(pathlib.Path(rb.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in names if m.split(".")[0] in ("jax", "jaxlib", "jds41")]
    assert set(rb._GENERATORS) == set(SUPPORTED_TYPES)


def test_sizes_and_errors():
    assert (block_size(T.Q8_0), block_size(T.Q4_K), block_size(T.MXFP4), block_size(T.F16)) == (32, 256, 32, 1)
    assert (row_bytes(T.Q8_0, 64), row_bytes(T.IQ2_XXS, 512), row_bytes(T.BF16, 3)) == (68, 132, 6)
    with pytest.raises(ValueError, match="whole blocks"):
        row_bytes(T.Q4_K, 128)
    with pytest.raises(NotImplementedError, match="Q4_0"):
        row_bytes(T.Q4_0, 64)
    with pytest.raises(ValueError, match="needs 68 bytes"):
        QTensor.from_raw(np.zeros(67, np.uint8), T.Q8_0, (1, 64))


# ---------------------------------------------------------------------------------------------------------------
# QTensor


def test_qtensor_wraps_bytes_without_copy_and_is_a_pytree():
    raw = rb.random_quantized(np.random.default_rng(0), T.Q8_0, (4, 64), 1.0)
    flat = raw.reshape(-1)
    qt = QTensor.from_raw(flat, T.Q8_0, (4, 64))
    assert np.shares_memory(qt.data, flat) and qt.data.shape == (4, 68) and qt.nbytes == raw.nbytes
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    assert len(leaves) == 1 and leaves[0] is qt.data
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (back.qtype, back.shape) == (T.Q8_0, (4, 64))

    bf = rb.quantize(np.ones((2, 8), np.float32), T.BF16)
    qb = QTensor.from_raw(bf, T.BF16, (2, 8))
    assert qb.data.dtype == jnp.bfloat16 and np.shares_memory(qb.data, bf) and qb.nbytes == 32
    assert_same_bits(qb.dequantize(), np.ones((2, 8), np.float32))

    ab = QTensor.abstract(T.MXFP4, (8, 256, 64))
    assert ab.data.shape == (8, 256, 34) and ab.nbytes == 8 * 256 * 34
    out = jax.eval_shape(lambda w, x: qmatvec_experts(x, w, jnp.zeros(6, jnp.int32)), ab,
                         jax.ShapeDtypeStruct((64,), jnp.float32))
    assert out.shape == (6, 256) and out.dtype == jnp.float32


# ---------------------------------------------------------------------------------------------------------------
# products


def check_close(y, w64, x64, what):
    """|y - x@w.T| within n*eps32 of sum |w x| (any f32 summation order), per output."""
    y = np.asarray(y, np.float64)
    ref = np.einsum("...i,...oi->...o", x64, w64)
    bound = w64.shape[-1] * EPS32 * np.einsum("...i,...oi->...o", np.abs(x64), np.abs(w64)) + EPS32 * np.abs(ref)
    err = np.abs(y - ref)
    assert (err <= bound).all(), f"{what}: worst err/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"
    return ref


@pytest.mark.parametrize("qtype", ALL, ids=IDS)
def test_qmatvec_and_qmatmul_match_float64(qtype):
    rng = np.random.default_rng(11)
    out_f, in_f = 48, 512
    raw = rb.random_quantized(rng, qtype, (out_f, in_f), 0.05)
    w = QTensor.from_raw(raw, qtype, (out_f, in_f))
    w64 = ref_dequant(raw, qtype).astype(np.float64)
    x = rng.standard_normal((5, in_f)).astype(np.float32)
    # one jit for all three keeps the compile count (the cost on 2 cores) down
    y1, yt, yt1 = jax.jit(lambda x, w: (qmatvec(x[0], w), qmatmul(x, w), qmatmul(x[:1], w)))(x, w)
    check_close(y1, w64, x[0].astype(np.float64), "qmatvec")
    check_close(yt, w64, x.astype(np.float64), "qmatmul")
    check_close(yt1, w64, x[:1].astype(np.float64), "qmatmul T=1")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4, T.Q4_K, T.IQ2_XXS, T.BF16], ids=lambda t: t.name)
def test_qmatvec_experts_reads_the_selected_experts(qtype):
    rng = np.random.default_rng(5)
    E, out_f, in_f = 6, 16, 256
    raw = rb.random_quantized(rng, qtype, (E, out_f, in_f), 0.05)
    w = QTensor.from_raw(raw, qtype, (E, out_f, in_f))
    w64 = ref_dequant(raw, qtype).astype(np.float64)
    idx = np.array([4, 0, 4, 5], np.int32)  # unsorted, repeated
    x1 = rng.standard_normal(in_f).astype(np.float32)
    xk = rng.standard_normal((4, in_f)).astype(np.float32)
    y1, yk = jax.jit(lambda x1, xk, w, i: (qmatvec_experts(x1, w, i), qmatvec_experts(xk, w, i)))(x1, xk, w, idx)
    ref = check_close(y1, w64[idx], np.broadcast_to(x1, (4, in_f)).astype(np.float64), "shared x")
    check_close(yk, w64[idx], xk.astype(np.float64), "per-expert x")
    # the right experts, not merely some: every other expert's output is far from the selected one's
    for k, e in enumerate(idx):
        for other in set(range(E)) - {int(e)}:
            assert np.abs(w64[other] @ x1 - ref[k]).max() > 1e-3


def test_products_follow_a_scan_sliced_stack():
    """A [L, out, in] stack scanned over layers: the per-layer leaf loses L but `shape` keeps it (documented)."""
    rng = np.random.default_rng(2)
    raw = rb.random_quantized(rng, T.Q4_K, (3, 8, 256), 0.1)
    w = QTensor.from_raw(raw, T.Q4_K, (3, 8, 256))
    x = rng.standard_normal(256).astype(np.float32)

    def step(carry, w_layer):
        return carry, qmatvec(x, w_layer)

    _, ys = jax.jit(lambda w: jax.lax.scan(step, 0, w))(w)
    w64 = ref_dequant(raw, T.Q4_K).astype(np.float64)
    check_close(ys, w64, np.broadcast_to(x, (3, 256)).astype(np.float64), "scan")


def test_product_shape_errors():
    w = QTensor.from_raw(rb.random_quantized(np.random.default_rng(0), T.Q8_0, (4, 64)), T.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="64"):
        qmatvec(jnp.zeros(32), w)
    with pytest.raises(ValueError, match="x\\[T, in\\]"):
        qmatmul(jnp.zeros(64), w)
