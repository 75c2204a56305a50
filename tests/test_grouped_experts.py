"""Grouped routed experts (jds41/layers/grouped_experts.py): the wide prompt pass's expert products.

- values: against a float64 numpy re-derivation from gguf-py's dequantizers (MODEL.md §2.5 written out here, not
  taken from the code under test), and against decode's per-token `moe.routed_experts` (another summation order,
  so to f32 rounding, not bits);
- bits: a token's result is the same whatever other tokens share its group, its tiles and their order (the property
  the wide prompt pass rests on); with the tile fixed, group sizes 2 ... 40 and permutations all agree exactly;
- the tile plan: every pair lands in exactly one tile, each tile holds one expert's pairs.
"""

from __future__ import annotations

import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.layers.grouped_experts import grouped_routed_experts, tile_plan
from jds41.layers.moe import routed_experts
from jds41.quant import QTensor, qmatvec, qmatvec_experts
from jds41.quant import random_blocks as rb
from jds41.quant.qtensor import rows_as_dots

E, K, D, F = 12, 3, 256, 256  # 256: the K- and IQ-type blocks
LIMIT = 7.0
TILE = 4


def _stacks(rng, qtype, act_round=None):
    raws = [rb.random_quantized(rng, qtype, shape, 0.05) for shape in ((E, F, D), (E, F, D), (E, D, F))]
    qts = [QTensor.from_raw(r, qtype, s, act_round) for r, s in zip(raws, ((E, F, D), (E, F, D), (E, D, F)),
                                                                      strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        f64 = [np.asarray(gguf.quants.dequantize(r, qtype), np.float64) for r in raws]
    return qts, f64


def _routing(rng, n):
    """K distinct experts per token; the first half all pick expert 5 first (several tiles of one expert)."""
    others = [e for e in range(E) if e != 5]
    idx = np.stack([np.r_[5, rng.choice(others, K - 1, replace=False)] if t < n // 2 else
                    rng.choice(E, K, replace=False) for t in range(n)]).astype(np.int32)
    return idx, rng.uniform(0.1, 1.0, (n, K)).astype(np.float32)


def _ref(x, gate, up, down, idx, weight):
    """float64: y_t = sum_k W_down[e] (silu(min(W_gate[e] x, L)) * clip(W_up[e] x, -L, L) * w_k), e = idx[t, k]."""
    out = np.zeros((x.shape[0], D))
    for t in range(x.shape[0]):
        for e, wk in zip(idx[t], weight[t], strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            g, u = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
            out[t] += down[e] @ (g / (1 + np.exp(-g)) * u * wk)
    return out


grouped = jax.jit(grouped_routed_experts, static_argnums=(7,))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4, T.IQ2_XXS, T.F32], ids=lambda t: t.name)
def test_grouped_experts_match_a_float64_rederivation_and_decode(qtype):
    rng = np.random.default_rng(3)
    (gate, up, down), (g64, u64, d64) = _stacks(rng, qtype)
    n = 13
    x = rng.standard_normal((n, D)).astype(np.float32)
    idx, weight = _routing(rng, n)
    got = np.asarray(grouped(x, gate, up, down, idx, weight, LIMIT, TILE), np.float64)
    ref = _ref(x.astype(np.float64), g64, u64, d64, idx, weight)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    per_token = jax.jit(jax.vmap(lambda x, i, w: routed_experts(x, gate, up, down, i, w, LIMIT)))(x, idx, weight)
    np.testing.assert_allclose(got, np.asarray(per_token, np.float64), rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_a_tokens_result_does_not_depend_on_its_group():
    rng = np.random.default_rng(4)
    (gate, up, down), _ = _stacks(rng, T.Q8_0, act_round="ggml-cpu")
    n = 40
    x = rng.standard_normal((n, D)).astype(np.float32)
    idx, weight = _routing(rng, n)
    whole = np.asarray(grouped(x, gate, up, down, idx, weight, LIMIT, TILE))
    checked = 0
    for size in (2, 3, 7, 16, 29):
        for start in (0, n - size, 5):
            sel = np.arange(start, start + size)
            part = np.asarray(grouped(x[sel], gate, up, down, idx[sel], weight[sel], LIMIT, TILE))
            np.testing.assert_array_equal(part, whole[sel])
            checked += 1
    perm = rng.permutation(n)
    shuffled = np.asarray(grouped(x[perm], gate, up, down, idx[perm], weight[perm], LIMIT, TILE))
    np.testing.assert_array_equal(shuffled, whole[perm])
    assert checked == 15 and np.abs(whole).min() > 0


def test_the_tile_plan_covers_every_pair_once_with_one_expert_per_tile():
    rng = np.random.default_rng(5)
    P, tile = 50, 4
    idx_P = rng.integers(0, E, P).astype(np.int32)
    idx_P[:20] = 3  # 20 pairs of one expert: 5 tiles
    order, n_tiles, tile_expert, tile_start, tile_rows = (np.asarray(a) for a in
                                                         jax.jit(tile_plan, static_argnums=(1, 2))(idx_P, E, tile))
    counts = np.bincount(idx_P, minlength=E)
    assert int(n_tiles) == int(np.sum((counts + tile - 1) // tile))
    assert tile_expert.shape[0] == P // tile + min(E, P) >= int(n_tiles)
    seen = []
    for j in range(int(n_tiles)):
        pairs = order[tile_start[j]: tile_start[j] + tile_rows[j]]
        assert 0 < tile_rows[j] <= tile and (idx_P[pairs] == tile_expert[j]).all()
        seen.extend(pairs.tolist())
    assert sorted(seen) == list(range(P))
    assert (np.diff(order[idx_P[order] == 3]) > 0).all()  # stable: an expert's pairs keep token order


def test_a_one_row_tile_is_refused():
    rng = np.random.default_rng(6)
    (gate, up, down), _ = _stacks(rng, T.F32)
    with pytest.raises(ValueError, match="at least 2 rows"):
        grouped_routed_experts(jnp.zeros((2, D)), gate, up, down, jnp.zeros((2, K), jnp.int32),
                               jnp.ones((2, K)), LIMIT, 1)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.IQ2_XXS], ids=lambda t: t.name)
def test_rows_as_dots_spells_batched_products_as_one_matrix_product(qtype):
    """The wide pass's dense products: under rows_as_dots a vmap of qmatvec / qmatvec_experts over rows is one
    `dot_general` on the dequantized weight (no per-row multiply-and-sum), with the values of a float64
    re-derivation from gguf-py's dequantizer; outside the context the decode spelling is back."""
    rng = np.random.default_rng(3)
    (gate, _, _), (gate64, _, _) = _stacks(rng, qtype)
    x = rng.standard_normal((6, D)).astype(np.float32)
    w = QTensor(gate.data[2], qtype, (F, D))
    def rows(x):  # a new function per trace: jax caches a traced function's jaxpr, and the context is not its key
        return jax.vmap(lambda r: qmatvec(r, w))(x)

    def experts(x):
        return jax.vmap(lambda r: qmatvec_experts(r, gate, jnp.asarray([4, 1], jnp.int32)))(x)

    with rows_as_dots():
        dense_jaxpr = str(jax.make_jaxpr(rows)(x))
        expert_jaxpr = str(jax.make_jaxpr(experts)(x))
        got, got_e = jax.jit(rows)(x), jax.jit(experts)(x)
    assert "dot_general" in dense_jaxpr and "reduce_sum" not in dense_jaxpr
    assert "dot_general" in expert_jaxpr and "reduce_sum" not in expert_jaxpr
    assert "dot_general" not in str(jax.make_jaxpr(lambda x: rows(x))(x))  # the context is left: decode's spelling
    want = x.astype(np.float64) @ gate64[2].T
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())
    want_e = np.einsum("ti,koi->tko", x.astype(np.float64), gate64[[4, 1]])
    np.testing.assert_allclose(np.asarray(got_e), want_e, rtol=0, atol=2e-5 * np.abs(want_e).max())
