"""The router's top-K as one Triton program (jds41/layers/topk_kernel.py), the selection on CUDA.

On every machine: the kernel in Pallas' interpreter against `lax.top_k` (the reference), bit for bit, on rows with
exact ties, -inf scores, the router's widths and widths that are not powers of two; the router built on it routes
as before; lowered for CUDA the router's selection is the Triton call unless switched off. On a GPU (marker
`gpu`): the compiled kernel against `lax.top_k`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jds41.checkpoints.presets import preset
from jds41.layers import router, topk_kernel
from jds41.layers.topk_kernel import top_k_rows
from jds41.quant import QTensor

TRITON_CALL = "__gpu$xla.gpu.triton"


def _rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    """Scores with exact ties (values on a coarse grid), some rows with few finite values."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal((n_rows, n)) * 4) / 4  # ~30 distinct values: many exact ties
    x[1, : n - 3] = -np.inf  # fewer finite scores than K: the rest are -inf ties
    x[2] = -np.inf
    x[3, ::7] = 100.0  # the top is one tie of many
    return x.astype(np.float32)


@pytest.mark.parametrize("n,k", [(384, 6), (256, 6), (100, 8), (7, 7), (64, 1)])
def test_the_interpreted_kernel_is_lax_top_k_bit_for_bit(n, k):
    x = jnp.asarray(_rows(6, n, seed=n + k))
    got_v, got_i = top_k_rows(x, k, interpret=True)
    want_v, want_i = lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    assert got_i.dtype == jnp.int32


def _route_args(seed: int):
    cfg = dataclasses.replace(preset("deepseek41", "tiny"), dim=128, n_experts=384, n_experts_used=6)  # V4.1 width
    rng = np.random.default_rng(seed)
    gate = QTensor.from_raw(rng.standard_normal((cfg.n_experts, cfg.dim)).astype(np.float32), 0,
                            (cfg.n_experts, cfg.dim))
    return cfg, gate, jnp.asarray(rng.standard_normal(cfg.dim), jnp.float32), \
        jnp.asarray(rng.standard_normal(cfg.n_experts) * 0.1, jnp.float32)


def test_the_router_on_the_kernel_routes_as_before(monkeypatch):
    monkeypatch.setattr(topk_kernel, "ROUTE_ENABLED", False)  # the top-K alone (JDS41_ROUTE_KERNEL=0): its bits
    cfg, gate, x, bias = _route_args(3)
    want = jax.jit(lambda x: router.route(x, gate, bias, cfg))(x)
    monkeypatch.setattr(topk_kernel, "ENABLED", True)
    monkeypatch.setattr(topk_kernel.triton_matvec, "INTERPRET", True)
    assert topk_kernel.applies(cfg.n_experts, cfg.n_experts_used)
    got = jax.jit(lambda x: router.route(x, gate, bias, cfg))(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_selection_lowers_to_the_kernel_on_cuda_only_where_switched_on(monkeypatch):
    cfg, gate, x, bias = _route_args(4)

    def lowered(platform):
        traced = jax.jit(lambda x: router.route(x, gate, bias, cfg)).trace(x)
        return traced.lower(lowering_platforms=(platform,)).as_text()

    monkeypatch.setattr(topk_kernel, "ROUTE_ENABLED", False)  # JDS41_ROUTE_KERNEL=0: the top-K alone
    monkeypatch.setattr(topk_kernel, "ENABLED", False)  # JDS41_TOPK_KERNEL=0
    assert "router_top_k" not in lowered("cuda")
    monkeypatch.setattr(topk_kernel, "ENABLED", True)  # the default
    assert topk_kernel.applies(cfg.n_experts, cfg.n_experts_used)  # the pinned jax has Pallas' Triton backend
    assert "router_top_k" in lowered("cuda") and TRITON_CALL in lowered("cuda")
    assert "router_top_k" not in lowered("cpu")


@pytest.mark.gpu
def test_the_compiled_kernel_is_lax_top_k_on_the_gpu():
    for n in (384, 256):
        x = jnp.asarray(_rows(64, n, seed=n))
        got_v, got_i = jax.jit(lambda x: top_k_rows(x, 6))(x)
        want_v, want_i = jax.jit(lambda x: lax.top_k(x, 6))(x)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


# The router's whole selection in one program (topk_kernel.route, the default; JDS41_ROUTE_KERNEL=0 keeps the top-K
# alone): against router.py's XLA spelling (`_plain_selection`, the reference): the same picks in the same order,
# weights and scores to f32 rounding.
@pytest.mark.parametrize("gating,norm,bias", [("sqrtsoftplus", True, True), ("sigmoid", True, True),
                                              ("softmax", False, False), ("sqrtsoftplus", False, False)])
def test_the_interpreted_route_kernel_routes_as_the_xla_spelling(gating, norm, bias):
    cfg = dataclasses.replace(preset("deepseek4", "tiny"), n_experts=256, n_experts_used=6, gating_func=gating,
                              expert_weights_norm=norm, expert_weights_scale=1.5)
    rng = np.random.default_rng(len(gating) + norm)
    logits = (rng.standard_normal((8, 256)) * 3).astype(np.float32)
    b = jnp.asarray(rng.standard_normal(256) * 0.1, jnp.float32) if bias else None
    got = topk_kernel.route_rows(jnp.asarray(logits), b, k=6, gating=gating, norm=norm, scale=1.5, interpret=True)
    for row in range(8):
        want = jax.jit(lambda lg: router._plain_selection(lg, b, cfg))(jnp.asarray(logits[row]))
        np.testing.assert_array_equal(np.asarray(got[0][row]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[1][row]), np.asarray(want[1]), rtol=2e-6)
        np.testing.assert_allclose(np.asarray(got[2][row]), np.asarray(want[2]), rtol=2e-6, atol=1e-12)
    assert got[0].dtype == jnp.int32


@pytest.mark.parametrize("enabled", [True, False])
def test_the_router_lowers_to_the_route_kernel_on_cuda_only_where_switched_on(monkeypatch, enabled):
    cfg, gate, x, bias = _route_args(5)
    monkeypatch.setattr(topk_kernel, "ROUTE_ENABLED", enabled)
    for platform in ("cuda", "cpu"):
        text = jax.jit(lambda x: router.route(x, gate, bias, cfg)).trace(x).lower(
            lowering_platforms=(platform,)).as_text()
        assert ('"router_select"' in text) is (enabled and platform == "cuda")
        assert ('"router_top_k"' in text) is (not enabled and platform == "cuda")
    hashed = jax.jit(lambda x: router.route(x, gate, None, cfg, hash_ids_K=jnp.arange(6))).trace(x)
    assert "router_select" not in hashed.lower(lowering_platforms=("cuda",)).as_text()  # hash layers: no selection


@pytest.mark.gpu
def test_the_compiled_route_kernel_routes_as_the_xla_spelling_on_the_gpu():
    cfg = dataclasses.replace(preset("deepseek4", "tiny"), n_experts=256, n_experts_used=6,
                              gating_func="sqrtsoftplus", expert_weights_norm=True, expert_weights_scale=1.5)
    rng = np.random.default_rng(9)
    logits = jnp.asarray(rng.standard_normal((64, 256)) * 3, jnp.float32)
    b = jnp.asarray(rng.standard_normal(256) * 0.1, jnp.float32)
    got = topk_kernel.route_rows(logits, b, k=6, gating="sqrtsoftplus", norm=True, scale=1.5)
    want = jax.jit(jax.vmap(lambda lg: router._plain_selection(lg, b, cfg)))(logits)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=2e-6)
