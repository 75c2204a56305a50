"""The Mosaic GPU Q8_0 product (jds41/quant/mgpu_matvec.py): in Pallas' GPU interpreter against a float64
re-derivation from gguf-py's dequantizer, its CUDA lowering (which runs on any host) at V4.1's shapes, its checks;
compiled against XLA's spelling under the `gpu` marker. Speed is experiments/bench_kernels.py --mgpu's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from kernel_reference import reference_rows_matvec, rel_error

from jds41.quant import QTensor, qmatvec, qmatvec_experts, qtensor
from jds41.quant.mgpu_matvec import TARGET_CTAS, default_splits, q8_0_matvec, supported
from jds41.quant.planar import to_planar
from jds41.quant.qtensor import xla_rows_matvec
from jds41.quant.random_blocks import random_quantized


@pytest.mark.parametrize("x_rows,stages,splits", [(1, 1, 1), (2, 3, None)])
def test_the_interpreted_kernel_equals_a_float64_reference(x_rows, stages, splits):
    rng = np.random.default_rng(0)
    raw = random_quantized(rng, T.Q8_0, (2, 64, 512))  # one CTA of rows, two pipeline steps a row
    idx = np.array([1, 7], np.int32)  # 7 clamps to the stack
    x = rng.standard_normal((x_rows, 512)).astype(np.float32)
    got = q8_0_matvec(jnp.asarray(x), jnp.asarray(to_planar(raw, T.Q8_0)), jnp.asarray(idx), stages=stages,
                      splits=splits, interpret=True)  # None: the rule's 2 (2 CTAs a split, 2 steps a row)
    assert got.shape == (2, 64) and got.dtype == jnp.float32
    assert rel_error(got, reference_rows_matvec(x, raw, idx, T.Q8_0)) < 1e-6


# V4.1's dense Q8_0 products (attention q_a, kv, q_b, o_a in 8 groups, o_b, the shared expert, the head) as
# (experts, out, in, K, x rows)
V41_SHAPES = [(16, 1280, 5120, 1, 1), (48, 512, 5120, 1, 1), (4, 32768, 1280, 1, 1), (32, 1024, 4096, 8, 8),
              (4, 5120, 8192, 1, 1), (12, 2304, 5120, 1, 1), (12, 5120, 2304, 1, 1), (1, 129280, 5120, 1, 1)]


def test_the_split_rule_divides_the_steps_and_fills_the_gpu_where_it_can():
    for _, n_out, n_in, K, _ in V41_SHAPES:
        steps, splits = n_in // 256, default_splits(K, n_out, n_in)
        assert steps % splits == 0
        ctas = K * (n_out // 64) * splits
        assert ctas >= TARGET_CTAS or splits == steps, (n_out, n_in)
        assert splits == 1 or K * (n_out // 64) * max(d for d in range(1, splits) if steps % d == 0) < TARGET_CTAS
    assert default_splits(1, 129280, 5120) == 1 and default_splits(1, 512, 5120) == 20  # the head; kv: one a step


def test_it_lowers_for_cuda_at_every_v41_q8_0_shape():
    for E, n_out, n_in, K, X in V41_SHAPES:
        assert supported(n_out, n_in)
        args = (jax.ShapeDtypeStruct((X, n_in), jnp.float32),
                jax.ShapeDtypeStruct((E, n_out, n_in // 32 * 34), jnp.uint8), jax.ShapeDtypeStruct((K,), jnp.int32))
        text = jax.jit(lambda x, r, i: q8_0_matvec(x, r, i)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (n_out, n_in)


def test_rows_it_cannot_take_are_refused_with_the_shape():
    x, idx = jnp.ones((1, 512), jnp.float32), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"\[96, 512\]"):  # not whole 64-row CTAs
        q8_0_matvec(x, jnp.zeros((1, 96, 544), jnp.uint8), idx, interpret=True)
    with pytest.raises(ValueError, match="rows of 512 bytes"):  # GGML-sized rows of another format
        q8_0_matvec(x, jnp.zeros((1, 64, 512), jnp.uint8), idx, interpret=True)
    with pytest.raises(ValueError, match="3 splits do not divide a row's 2 steps"):
        q8_0_matvec(x, jnp.zeros((1, 64, 544), jnp.uint8), idx, splits=3, interpret=True)
    assert not supported(64, 320)  # 320 inputs: not whole 256-value steps


def test_the_switch_routes_planar_q8_0_products_to_it_on_cuda_only(monkeypatch):
    rng = np.random.default_rng(1)
    raw = random_quantized(rng, T.Q8_0, (1, 128, 512))[0]
    planar = QTensor.from_raw(raw, T.Q8_0, (128, 512)).with_layout(jnp.asarray(to_planar(raw[None], T.Q8_0)[0]),
                                                                    "planar")
    odd = QTensor.from_raw(raw[:96], T.Q8_0, (96, 512)).with_layout(
        jnp.asarray(to_planar(raw[None, :96], T.Q8_0)[0]), "planar")  # 96 rows: not whole 64-row CTAs
    x = jnp.asarray(rng.standard_normal(512), jnp.float32)

    def lowered(w, platform):
        return jax.jit(lambda x: qmatvec(x, w)).trace(x).lower(lowering_platforms=(platform,)).as_text()

    monkeypatch.setattr(qtensor, "_MOSAIC_Q8", True)
    on = lowered(planar, "cuda")
    assert "mosaic_gpu" in on and "rows_matvec_q8_0_planar" not in on
    stack = QTensor.from_raw(np.stack([raw, raw]), T.Q8_0, (2, 128, 512)).with_layout(
        jnp.asarray(to_planar(np.stack([raw, raw]), T.Q8_0)), "planar")  # a stack read by index (o_a's groups)
    experts = jax.jit(lambda x: qmatvec_experts(jnp.stack([x, -x]), stack, jnp.arange(2, dtype=jnp.int32))).trace(
        x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in experts and "rows_matvec_q8_0_planar" not in experts
    assert "mosaic_gpu" not in lowered(odd, "cuda")  # the Triton kernel keeps the shapes it cannot take
    assert "mosaic_gpu" not in lowered(planar, "cpu")
    want = reference_rows_matvec(np.asarray(x)[None], raw[None], np.zeros(1, np.int32), T.Q8_0)[0]
    assert rel_error(qmatvec(x, planar), want) < 1e-6  # on the CPU: XLA's spelling, as before
    monkeypatch.setattr(qtensor, "_MOSAIC_Q8", False)
    assert "mosaic_gpu" not in lowered(planar, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("E,n_out,n_in,K,X", V41_SHAPES)
def test_the_compiled_kernel_agrees_with_the_xla_spelling_on_the_gpu(E, n_out, n_in, K, X):
    rng = np.random.default_rng(3)
    one = random_quantized(rng, T.Q8_0, (1, min(n_out, 2048), n_in))
    raw = np.tile(one, (min(E, 4), -(-n_out // one.shape[1]), 1))[:, :n_out]
    idx = jnp.asarray(rng.integers(0, raw.shape[0], K), jnp.int32)
    x = jnp.asarray(rng.standard_normal((X, n_in)), jnp.float32)
    want = np.asarray(jax.jit(lambda x, r, i: xla_rows_matvec(x, r, i, T.Q8_0))(x, jax.device_put(raw), idx))
    rows = jax.device_put(to_planar(raw, T.Q8_0))
    for stages, splits in ((2, None), (4, None), (4, 1)):
        got = np.asarray(jax.jit(lambda x, r, i, st=stages, sp=splits: q8_0_matvec(x, r, i, stages=st, splits=sp))(
            x, rows, idx))
        assert np.isfinite(got).all() and rel_error(got, want.astype(np.float64)) < 1e-5, (stages, splits)
    # row-batched decode (jds41/block_step.py) vmaps the one-token products: each row keeps its own call's bits
    one_call = jax.jit(lambda x: q8_0_matvec(x, rows, idx))
    xs = jnp.stack([x, x * 0.5, -x])
    batched = np.asarray(jax.jit(jax.vmap(one_call))(xs))
    for r in range(3):
        np.testing.assert_array_equal(batched[r], np.asarray(one_call(xs[r])))
