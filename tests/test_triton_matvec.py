"""The Triton kernel of the one-token quantized products (jds41/quant/triton_matvec.py), the decode fast path on CUDA.

On every machine: the kernel, run in Pallas' interpreter, against a float64 re-derivation from gguf-py's
dequantizer, for every format and row layout it takes (MXFP4, IQ2_XXS and Q2_K as in the file and planar, Q8_0
planar; x shared by the K experts and one x per expert; clamped indices; a tile that is not the default; a row split
in four; every MXFP4 nibble code, subnormal-free); and the wiring: lowered for CUDA, the products of
`qmatvec_experts` and `qmatvec` are the Triton custom call, lowered for the CPU they are not, and Q8_0 rows in the
file's layout, stacks past 2^31 bytes and llama.cpp's activation rounding keep the XLA spelling everywhere.
On a GPU (marker `gpu`): the compiled kernel at the V4-Flash and V4.1 shapes against the XLA spelling it replaces,
and a vmapped kernel (row-batched decode) bit for bit against one call per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from kernel_reference import reference_rows_matvec
from kernel_reference import rel_error as _rel

from jds41.quant import QTensor, qmatvec, qmatvec_experts
from jds41.quant.planar import to_planar
from jds41.quant.qtensor import xla_rows_matvec
from jds41.quant.random_blocks import random_quantized
from jds41.quant.triton_matvec import (
    BLOCKS,
    KINDS,
    MEASURED_TILES,
    _e2m1_doubled,
    _splits_from,
    default_tile,
    rows_matvec,
)

KIND_LIST = sorted(KINDS, key=lambda k: (k[0].name, k[1]))

TRITON_CALL = "__gpu$xla.gpu.triton"


def _case(qtype, E=5, n_out=24, n_in=1024, seed=0):
    rng = np.random.default_rng(seed)
    return rng, random_quantized(rng, qtype, (E, n_out, n_in))


def test_every_nibble_decodes_to_ggmls_doubled_e2m1_value():
    want = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # ggml's kvalues_mxfp4
    q = jnp.arange(256, dtype=jnp.uint32)
    np.testing.assert_array_equal(np.asarray(_e2m1_doubled(q, 0)), np.tile(want, 16))
    np.testing.assert_array_equal(np.asarray(_e2m1_doubled(q, 4)), np.repeat(want, 16))


def _rows(raw, layout, qtype):
    return jnp.asarray(to_planar(raw, qtype) if layout == "planar" else raw)


@pytest.mark.parametrize("qtype,layout", KIND_LIST)
@pytest.mark.parametrize("x_rows", ["shared", "per-expert"])
def test_the_interpreted_kernel_equals_a_float64_reference(x_rows, qtype, layout):
    rng, raw = _case(qtype)
    idx = np.array([4, 0, 2, 9, -3], np.int32)  # 9 and -3 clamp to the stack, as jnp.take(mode="clip") does
    x = rng.standard_normal((1 if x_rows == "shared" else len(idx), 1024)).astype(np.float32)
    want = reference_rows_matvec(x, raw, idx, qtype)  # from the GGML rows, whatever layout the kernel reads
    rows = _rows(raw, layout, qtype)
    got = rows_matvec(jnp.asarray(x), rows, jnp.asarray(idx), qtype, layout=layout, interpret=True)
    assert got.shape == (len(idx), raw.shape[1]) and got.dtype == jnp.float32
    assert _rel(got, want) < 1e-6
    # another tile sums the blocks in other groups: the same values to f32 rounding
    other = rows_matvec(jnp.asarray(x), rows, jnp.asarray(idx), qtype, layout=layout, interpret=True,
                        tile=(8, 2, 4))
    assert _rel(other, want) < 1e-6
    # a row split four ways: four programs sum a quarter of the row each, and their sums are added
    split = rows_matvec(jnp.asarray(x), rows, jnp.asarray(idx), qtype, layout=layout, interpret=True,
                        tile=(8, 1, 4, 4))
    assert _rel(split, want) < 1e-6


def test_short_rows_and_odd_row_counts_take_smaller_tiles():
    rng, raw = _case(T.MXFP4, E=2, n_out=12, n_in=64)  # 2 blocks per row, 12 rows: tile (4, 2)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    idx = np.array([1, 0], np.int32)
    got = rows_matvec(jnp.asarray(x), jnp.asarray(raw), jnp.asarray(idx), T.MXFP4, interpret=True)
    assert _rel(got, reference_rows_matvec(x, raw, idx, T.MXFP4)) < 1e-6
    with pytest.raises(ValueError, match="rows of"):
        rows_matvec(jnp.asarray(x[:, :32]), jnp.asarray(raw), jnp.asarray(idx), T.MXFP4, interpret=True)
    with pytest.raises(ValueError, match="does not take"):  # Q8_0 only in the planar layout
        rows_matvec(jnp.asarray(x), jnp.asarray(raw), jnp.asarray(idx), T.Q8_0, interpret=True)


def test_the_measured_tiles_divide_their_shapes_and_sum_as_the_reference():
    assert MEASURED_TILES, "JDS41_MEASURED_TILES=0 in the test environment"
    for (qtype, K, n_out, n_in), tile in MEASURED_TILES.items():
        bo, nb, warps, splits = tile
        assert default_tile(qtype, K, n_out, n_in) == tile
        assert n_out % bo == 0 and (n_in // BLOCKS[qtype][0]) % (nb * splits) == 0 and warps in (1, 2, 4, 8)
    rng, raw = _case(T.Q8_0, E=2, n_out=16, n_in=5120)  # V4.1's model width: 160 blocks a row
    x = rng.standard_normal((1, 5120)).astype(np.float32)
    idx = np.array([1, 0], np.int32)
    want = reference_rows_matvec(x, raw, idx, T.Q8_0)
    for tile in {t for (q, _, _, n_in), t in MEASURED_TILES.items() if q == T.Q8_0 and n_in == 5120}:
        got = rows_matvec(jnp.asarray(x), _rows(raw, "planar", T.Q8_0), jnp.asarray(idx), T.Q8_0, layout="planar",
                          interpret=True, tile=tile)
        assert _rel(got, want) < 1e-6, tile


def _lowered(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_decode_products_lower_to_the_kernel_on_cuda_only():
    _, raw = _case(T.MXFP4, E=8, n_out=32, n_in=512)
    stack = QTensor.from_raw(raw, T.MXFP4, (8, 32, 512))
    dense = QTensor.from_raw(raw[0], T.MXFP4, (32, 512))
    x, idx = jnp.ones(512, jnp.float32), jnp.arange(3, dtype=jnp.int32)
    for fn, args in ((lambda x, i: qmatvec_experts(x, stack, i), (x, idx)), (lambda x: qmatvec(x, dense), (x,))):
        assert TRITON_CALL in _lowered(fn, *args, platform="cuda")
        assert TRITON_CALL not in _lowered(fn, *args, platform="cpu")
    rng = np.random.default_rng(1)
    q8_raw = random_quantized(rng, T.Q8_0, (8, 32, 512))
    q8_planar = QTensor.from_raw(q8_raw, T.Q8_0, (8, 32, 512)).with_layout(to_planar(q8_raw, T.Q8_0), "planar")
    assert TRITON_CALL in _lowered(lambda x, i: qmatvec_experts(x, q8_planar, i), x, idx, platform="cuda")
    q2k_raw = random_quantized(rng, T.Q2_K, (8, 32, 512))
    q2k = QTensor.from_raw(q2k_raw, T.Q2_K, (8, 32, 512))  # V4.1's down stacks, as in the file
    assert TRITON_CALL in _lowered(lambda x, i: qmatvec_experts(x, q2k, i), x, idx, platform="cuda")
    rounded = QTensor.from_raw(raw, T.MXFP4, (8, 32, 512), act_round="ggml-cpu")  # the llama.cpp oracle's numerics
    q8 = QTensor.from_raw(q8_raw, T.Q8_0, (8, 32, 512))  # GGML Q8_0 rows: XLA reads them (tiers keep them so)
    huge = QTensor.abstract(T.MXFP4, (1024, 4096, 4096))  # 2.3 GB: past the kernel's 32-bit offsets
    for other in (rounded, q8, huge):
        x_in = jax.ShapeDtypeStruct((other.n_cols,), jnp.float32)
        assert TRITON_CALL not in _lowered(lambda w, x, i: qmatvec_experts(x, w, i), other, x_in, idx, platform="cuda")


# V4-Flash's decode shapes: routed gate/up, routed down (one x per expert), a dense MXFP4 matrix, the Q8_0 head;
# V4.1's kv and shared-expert gate/up (Q8_0, measured tiles with rows split in five), routed gate/up (IQ2_XXS, 20
# blocks a row) and down (Q2_K, 9 blocks a row: where the kernel takes it).
GPU_SHAPES = [(T.MXFP4, 256, 2048, 4096, 1), (T.MXFP4, 256, 4096, 2048, 6), (T.MXFP4, 1, 4096, 4096, 1),
              (T.Q8_0, 1, 129280, 4096, 1), (T.Q8_0, 8, 32768, 1024, 1), (T.Q8_0, 1, 512, 5120, 1),
              (T.Q8_0, 1, 2304, 5120, 1), (T.IQ2_XXS, 384, 2304, 5120, 1),
              (T.Q2_K, 384, 5120, 2304, 6)]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,E,n_out,n_in,X,layout", [(*shape, lay) for shape in GPU_SHAPES
                                                         for lay in ("ggml", "planar") if (shape[0], lay) in KINDS])
def test_the_compiled_kernel_agrees_with_the_xla_spelling_on_the_gpu(qtype, E, n_out, n_in, X, layout):
    rng = np.random.default_rng(3)
    one = random_quantized(rng, qtype, (1, min(n_out, 2048), n_in))
    raw = np.concatenate([np.tile(one, (1, -(-n_out // one.shape[1]), 1))[:, :n_out] for _ in range(min(E, 8))])
    K = 6 if E > 1 else 1
    idx = jnp.asarray(rng.integers(0, raw.shape[0], K), jnp.int32)
    x = jnp.asarray(rng.standard_normal((X if X > 1 else 1, n_in)), jnp.float32)
    rows = jax.device_put(to_planar(raw, qtype) if layout == "planar" else raw)
    got = np.asarray(jax.jit(lambda x, r, i: rows_matvec(x, r, i, qtype, layout=layout))(x, rows, idx))
    want = np.asarray(jax.jit(lambda x, r, i: xla_rows_matvec(x, r, i, qtype))(x, jax.device_put(raw), idx))
    assert np.isfinite(got).all() and _rel(got, want.astype(np.float64)) < 1e-5


@pytest.mark.gpu
def test_a_vmapped_kernel_gives_each_row_the_bits_of_its_own_call():
    """Row-batched decode (jds41/block_step.py) vmaps the one-token products: each row must keep the bits of the
    unbatched kernel, which is what keeps width-W decode exact against drafting at width W."""
    rng, raw = _case(T.MXFP4, E=16, n_out=256, n_in=2048)
    raw = jnp.asarray(raw)
    xs = jnp.asarray(rng.standard_normal((5, 1, 2048)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 16, (5, 6)), jnp.int32)
    one = jax.jit(lambda x, i: rows_matvec(x, raw, i, T.MXFP4))
    batched = np.asarray(jax.jit(jax.vmap(lambda x, i: rows_matvec(x, raw, i, T.MXFP4)))(xs, idx))
    for r in range(5):
        np.testing.assert_array_equal(batched[r], np.asarray(one(xs[r], idx[r])))


def test_the_ab_switches_parse_type_names_and_name_what_is_wrong():
    assert _splits_from("Q2_K=3,IQ2_XXS=5") == {T.Q2_K: 3, T.IQ2_XXS: 5}
    assert _splits_from("") == {}
    for bad, said in (("Q2_K", "TYPE=S"), ("Q2_K=0", "TYPE=S"), ("Q4_K=2", "Q4_K"), ("nope=2", "nope")):
        with pytest.raises(ValueError, match=said):
            _splits_from(bad)
