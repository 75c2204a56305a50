"""Router and experts (jds41/layers/router.py, moe.py) against float64 numpy references written from the spec
(MODEL.md §2.4 / §2.5, LLAMACPP_DEEPSEEK4.md §3 FFN paragraph), not from the code under test.

Metric: relative error ||got - ref|| / ||ref||; f32 against f64 must stay below 1e-5. Discrete outputs (expert
ids) must match exactly; rows of the T-token forms must equal decode bit for bit (np.array_equal).
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.checkpoints.presets import preset
from jds41.layers.moe import routed_experts, routed_experts_rows, shared_expert, shared_expert_rows
from jds41.layers.router import route, route_rows
from jds41.quant import QTensor

E, K, D, F = 16, 4, 64, 32
LIMIT = 10.0


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def cfg_with(**kw):
    base = dataclasses.replace(preset("deepseek4", "tiny"), n_experts=E, n_experts_used=K)
    return dataclasses.replace(base, **kw)


def q(a: np.ndarray) -> QTensor:
    return QTensor.from_raw(np.ascontiguousarray(a, np.float32), T.F32, a.shape)


# ---- float64 references (spec text) -----------------------------------------------------------------------------
def ref_scores(logits, gating):
    z = np.asarray(logits, np.float64)
    if gating == "sqrtsoftplus":
        return np.sqrt(np.log1p(np.exp(z)))
    if gating == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_route(x, gate_w, bias, cfg, hash_ids=None):
    s = ref_scores(np.asarray(gate_w, np.float64) @ np.asarray(x, np.float64), cfg.gating_func)
    if hash_ids is None:
        sel = s + (0.0 if bias is None else np.asarray(bias, np.float64))
        idx = np.argsort(-sel, kind="stable")[:cfg.n_experts_used]  # stable: lower index first on ties
    else:
        idx = np.asarray(hash_ids)
    w = s[idx]
    if cfg.expert_weights_norm:
        w = w / max(w.sum(), 6.103515625e-5)
    return idx, w * cfg.expert_weights_scale, s


def ref_expert(x, wg, wu, wd, weight, limit):
    x = np.asarray(x, np.float64)
    g, u = np.asarray(wg, np.float64) @ x, np.asarray(wu, np.float64) @ x
    if limit > 1e-6:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    h = g / (1.0 + np.exp(-g)) * u * weight  # weight before down
    return np.asarray(wd, np.float64) @ h


def ref_routed(x, gate, up, down, idx, w, limit):
    return sum(ref_expert(x, gate[e], up[e], down[e], wk, limit) for e, wk in zip(idx, w, strict=True))


# ---- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _router_weights(rng):
    gate_w = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    return gate_w, bias


def _experts(rng, scale=1.0):
    gate = (scale * rng.standard_normal((E, F, D)) / np.sqrt(D)).astype(np.float32)
    up = (scale * rng.standard_normal((E, F, D)) / np.sqrt(D)).astype(np.float32)
    down = (rng.standard_normal((E, D, F)) / np.sqrt(F)).astype(np.float32)
    return gate, up, down


# ---- router -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gating", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_reference(rng, gating, norm):
    cfg = cfg_with(gating_func=gating, expert_weights_norm=norm)
    gate_w, bias = _router_weights(rng)
    fn = jax.jit(lambda x, gw, b: route(x, gw, b, cfg))
    for _ in range(4):
        x = (2.0 * rng.standard_normal(D)).astype(np.float32)
        r = fn(x, q(gate_w), bias)
        idx, w, s = ref_route(x, gate_w, bias, cfg)
        assert r.idx_K.dtype == jnp.int32 and r.weight_K.dtype == jnp.float32 and r.scores_E.shape == (E,)
        np.testing.assert_array_equal(np.asarray(r.idx_K), idx)
        assert rel(r.weight_K, w) < 1e-5 and rel(r.scores_E, s) < 1e-5
        assert int(r.swaps) == 0


def test_bias_changes_selection_only(rng):
    cfg = cfg_with()
    gate_w, _ = _router_weights(rng)
    x = rng.standard_normal(D).astype(np.float32)
    s = ref_scores(gate_w.astype(np.float64) @ x, cfg.gating_func)
    low = int(np.argmin(s))
    bias = np.zeros(E, np.float32)
    bias[low] = 100.0  # forces the lowest-scoring expert in, ranked first
    r = route(x, q(gate_w), bias, cfg)
    assert int(r.idx_K[0]) == low
    idx, w, _ = ref_route(x, gate_w, bias, cfg)
    assert rel(r.weight_K, w) < 1e-5
    # its weight is its unbiased score's share, not a biased one
    assert abs(float(r.weight_K[0]) - s[low] / s[idx].sum() * cfg.expert_weights_scale) < 1e-5


def test_weight_sum_clamp(rng):
    # sigmoid of very negative logits: the K scores sum to << 2^-14, so the sum is clamped at 6.103515625e-5
    cfg = cfg_with(gating_func="sigmoid")
    gate_w, _ = _router_weights(rng)
    x = rng.standard_normal(D).astype(np.float32)
    gate_w = gate_w * 0.1
    bias_w = np.zeros((E, D), np.float32)
    bias_w[:, 0] = -20.0 / max(abs(float(x[0])), 1e-3) * np.sign(x[0])  # shifts every logit by about -20
    gw = gate_w + bias_w
    r = route(x, q(gw), None, cfg)
    idx, w, s = ref_route(x, gw, None, cfg)
    assert s[idx].sum() < 6.103515625e-5
    np.testing.assert_array_equal(np.asarray(r.idx_K), idx)
    assert rel(r.weight_K, w) < 1e-5
    assert rel(r.weight_K, s[idx] / 6.103515625e-5 * cfg.expert_weights_scale) < 1e-5


def test_hash_routing(rng):
    cfg = cfg_with()
    gate_w, bias = _router_weights(rng)
    x = rng.standard_normal(D).astype(np.float32)
    hash_ids = np.array([11, 3, 3, 0], np.int32)  # tid2eid rows may repeat an expert; taken as given
    r = jax.jit(lambda x, h: route(x, q(gate_w), None, cfg, hash_ids_K=h))(x, hash_ids)
    _, w, _ = ref_route(x, gate_w, None, cfg, hash_ids)
    np.testing.assert_array_equal(np.asarray(r.idx_K), hash_ids)
    assert rel(r.weight_K, w) < 1e-5
    with pytest.raises(ValueError, match="no selection bias"):
        route(x, q(gate_w), bias, cfg, hash_ids_K=hash_ids)


def test_topk_ties_lower_index_wins(rng):
    """Identical gate rows give exactly equal scores; on a tie the lower expert index is selected first."""
    cfg = cfg_with()
    x = rng.standard_normal(D).astype(np.float32)
    gate_w = (0.1 * rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    gate_w[[2, 9, 13]] = 3.0 * x / np.dot(x, x)  # logit ~3, three-way tie at the top
    gate_w[[11, 4]] = 2.0 * x / np.dot(x, x)  # logit ~2, a tie across the K = 4 cut: 4 must win over 11
    bias = np.zeros(E, np.float32)
    r = route(x, q(gate_w), bias, cfg)
    sc = np.asarray(r.scores_E)
    assert sc[2] == sc[9] == sc[13] and sc[4] == sc[11]
    np.testing.assert_array_equal(np.asarray(r.idx_K), [2, 9, 13, 4])
    # the primitive itself, as documented
    np.testing.assert_array_equal(np.asarray(jax.lax.top_k(jnp.array([1.0, 3.0, 3.0, 0.0, 3.0]), 2)[1]), [1, 2])


def test_lean_margin_zero_is_plain_topk(rng):
    cfg = cfg_with()
    gate_w, bias = _router_weights(rng)
    tiers = rng.integers(0, 3, E).astype(np.int32)
    plain = jax.jit(lambda x: route(x, q(gate_w), bias, cfg))
    lean0 = jax.jit(lambda x: route(x, q(gate_w), bias, cfg, lean=(tiers, 0.0)))
    xs = rng.standard_normal((16, D)).astype(np.float32)
    xs[0] = 0.0  # all logits 0: every score ties, the hardest case for margin 0
    for x in xs:
        a, b = plain(x), lean0(x)
        np.testing.assert_array_equal(np.asarray(a.idx_K), np.asarray(b.idx_K))
        np.testing.assert_array_equal(np.asarray(a.weight_K), np.asarray(b.weight_K))
        assert int(b.swaps) == 0


def test_lean_prefers_faster_tier_within_margin(rng):
    cfg = cfg_with(expert_weights_norm=True)
    gate_w = np.zeros((E, D), np.float32)
    x = np.zeros(D, np.float32)
    x[0] = 1.0
    logits = np.linspace(2.0, -2.0, E).astype(np.float32)  # expert e has the e-th best score
    gate_w[:, 0] = logits
    tiers = np.full(E, 2, np.int32)
    tiers[[1, 5, 6]] = 0  # 1 is in the plain top-4; 5 and 6 are just outside it
    tiers[0] = 1
    s = ref_scores(logits, cfg.gating_func)
    margin = float(s[3] - s[5]) + 1e-4  # 4 and 5 are within the margin of the 4th score; 6 is not
    assert s[3] - s[6] > margin
    r = route(x, q(gate_w), None, cfg, lean=(tiers, margin))
    # eligible: plain top-4 {0,1,2,3} + {4, 5}; keep by (tier, score): 1, 5 (tier 0), 0 (tier 1), then 2 (tier 2)
    np.testing.assert_array_equal(np.asarray(r.idx_K), [0, 1, 2, 5])
    assert int(r.swaps) == 1
    w = s[[0, 1, 2, 5]]
    assert rel(r.weight_K, w / w.sum() * cfg.expert_weights_scale) < 1e-5


def test_route_rows_bit_identical_to_decode(rng):
    cfg = cfg_with()
    gate_w, bias = _router_weights(rng)
    xs = rng.standard_normal((3, D)).astype(np.float32)
    hs = rng.integers(0, E, (3, K)).astype(np.int32)
    tiers = rng.integers(0, 3, E).astype(np.int32)
    one = jax.jit(lambda x: route(x, q(gate_w), bias, cfg, lean=(tiers, 0.05)))
    rows = jax.jit(lambda x: route_rows(x, q(gate_w), bias, cfg, lean=(tiers, 0.05)))
    hash_one = jax.jit(lambda x, h: route(x, q(gate_w), None, cfg, hash_ids_K=h))
    hash_rows = jax.jit(lambda x, h: route_rows(x, q(gate_w), None, cfg, hash_ids_TK=h))
    hashed = [hash_one(x, h) for x, h in zip(xs, hs, strict=True)]
    for r1, r3, d in ((rows(xs[:1]), rows(xs), [one(x) for x in xs]),
                      (hash_rows(xs[:1], hs[:1]), hash_rows(xs, hs), hashed)):
        for f1, f3, *fd in zip(r1, r3, *d, strict=True):
            assert np.array_equal(np.asarray(f1)[0], np.asarray(f3)[0])
            for t in range(3):
                assert np.array_equal(np.asarray(f3)[t], np.asarray(fd[t]))


# ---- experts ------------------------------------------------------------------------------------------------------
def test_routed_experts_with_active_clamps(rng):
    gate, up, down = _experts(rng, scale=8.0)  # large activations: both clamps bind
    x = (2.0 * rng.standard_normal(D)).astype(np.float32)
    idx = np.array([5, 0, 12, 7], np.int32)
    w = np.array([0.6, 0.4, 0.3, 0.2], np.float32)
    g = np.einsum("kfd,d->kf", gate[idx].astype(np.float64), x)
    u = np.einsum("kfd,d->kf", up[idx].astype(np.float64), x)
    assert (g > LIMIT).any() and (u > LIMIT).any() and (u < -LIMIT).any() and (g < -LIMIT).any()
    fn = jax.jit(lambda x, i, w: routed_experts(x, q(gate), q(up), q(down), i, w, LIMIT))
    got = fn(x, idx, w)
    assert got.shape == (D,) and got.dtype == jnp.float32
    assert rel(got, ref_routed(x, gate, up, down, idx, w, LIMIT)) < 1e-5
    # the clamps matter here: the unclamped reference is far away, and limit 0 switches them off
    assert rel(ref_routed(x, gate, up, down, idx, w, 0.0), ref_routed(x, gate, up, down, idx, w, LIMIT)) > 0.1
    got0 = routed_experts(x, q(gate), q(up), q(down), idx, w, 0.0)
    assert rel(got0, ref_routed(x, gate, up, down, idx, w, 0.0)) < 1e-5


def test_unselected_experts_are_never_read(rng):
    gate, up, down = _experts(rng)
    x = rng.standard_normal(D).astype(np.float32)
    idx = np.array([3, 14, 8, 1], np.int32)
    w = np.array([0.5, 0.2, 0.2, 0.1], np.float32)
    fn = jax.jit(lambda x, g, u, d: routed_experts(x, g, u, d, idx, w, LIMIT))  # QTensors are pytree args
    clean = np.asarray(fn(x, q(gate), q(up), q(down)))
    poisoned = [a.copy() for a in (gate, up, down)]
    others = np.setdiff1d(np.arange(E), idx)
    for a in poisoned:
        a[others] = np.nan
    got = np.asarray(fn(x, *(q(a) for a in poisoned)))
    assert np.isfinite(got).all() and np.array_equal(got, clean)


def test_shared_expert(rng):
    gate, up, down = (a[0] for a in _experts(rng, scale=8.0))
    x = (2.0 * rng.standard_normal(D)).astype(np.float32)
    got = jax.jit(lambda x: shared_expert(x, q(gate), q(up), q(down), LIMIT))(x)
    assert rel(got, ref_expert(x, gate, up, down, 1.0, LIMIT)) < 1e-5


def test_quantized_experts_q8_0(rng):
    """Q8_0 stacks (as in ds4 files' shared/attention matrices; MXFP4/Q2_K experts go the same way): the layer
    reads QTensor bytes; reference = float64 on gguf-py's dequantization of the same bytes."""
    gate, up, down = _experts(rng, scale=4.0)
    qs = [gguf.quants.quantize(a, T.Q8_0) for a in (gate, up, down)]
    deq = [gguf.quants.dequantize(b, T.Q8_0) for b in qs]
    qt = [QTensor.from_raw(b, T.Q8_0, a.shape) for b, a in zip(qs, (gate, up, down), strict=True)]
    x = rng.standard_normal(D).astype(np.float32)
    idx = np.array([9, 2, 15, 4], np.int32)
    w = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    got = jax.jit(lambda x: routed_experts(x, *qt, idx, w, LIMIT))(x)
    assert rel(got, ref_routed(x, *deq, idx, w, LIMIT)) < 1e-5


def test_moe_rows_bit_identical_to_decode(rng):
    gate, up, down = _experts(rng, scale=4.0)
    xs = rng.standard_normal((3, D)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(3)]).astype(np.int32)
    w = rng.random((3, K)).astype(np.float32)
    one = jax.jit(lambda x, i, w: routed_experts(x, q(gate), q(up), q(down), i, w, LIMIT)
                  + shared_expert(x, q(gate[0]), q(up[0]), q(down[0]), LIMIT))
    rows = jax.jit(lambda x, i, w: routed_experts_rows(x, q(gate), q(up), q(down), i, w, LIMIT)
                   + shared_expert_rows(x, q(gate[0]), q(up[0]), q(down[0]), LIMIT))
    r1, r3 = np.asarray(rows(xs[:1], idx[:1], w[:1])), np.asarray(rows(xs, idx, w))
    assert np.array_equal(r1[0], r3[0])
    for t in range(3):
        assert np.array_equal(r3[t], np.asarray(one(xs[t], idx[t], w[t])))
    ref = [ref_routed(xs[t], gate, up, down, idx[t], w[t], LIMIT) + ref_expert(xs[t], gate[0], up[0], down[0], 1.0,
                                                                                LIMIT) for t in range(3)]
    assert rel(r3, np.stack(ref)) < 1e-5
