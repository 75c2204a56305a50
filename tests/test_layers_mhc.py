"""rms_norm and the mHC building blocks (jds41/layers/norm.py, mhc.py) against float64 numpy references.

The references below are written from the spec text (MODEL.md §2.1 / §2.6, LLAMACPP_DEEPSEEK4.md §3 "hc"), not
from the code under test. Metric: relative error ||got - ref|| / ||ref||; f32 against f64 must stay below 1e-5
(3e-5 for the 20-iteration Sinkhorn, whose divisions compound rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.layers.mhc import hc_collapse, hc_expand, hc_head, hc_head_rows, hc_mix, hc_mix_rows, hc_onehot_pre, hc_split
from jds41.layers.norm import rms_norm

H, D, EPS, HC_EPS = 4, 32, 1e-6, 1e-6
M = (2 + H) * H


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


# ---- float64 references (spec text) -----------------------------------------------------------------------------
def ref_rms(x, w, eps):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def ref_mix(x_HD, fn, eps):
    flat = np.asarray(x_HD, np.float64).reshape(-1)
    return np.asarray(fn, np.float64) @ (flat / np.sqrt(np.mean(flat ** 2) + eps))


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def ref_split(mix, scale, base, hc_eps, iters):
    mix, scale, base = (np.asarray(a, np.float64) for a in (mix, scale, base))
    pre = sigmoid(mix[:H] * scale[0] + base[:H]) + hc_eps
    post = 2.0 * sigmoid(mix[H:2 * H] * scale[1] + base[H:2 * H])
    logits = (mix[2 * H:] * scale[2] + base[2 * H:]).reshape(H, H)  # [src][dst] row-major
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    c = e / e.sum(axis=1, keepdims=True) + hc_eps  # softmax over dst
    c = c / (c.sum(axis=0, keepdims=True) + hc_eps)  # column sums (over src)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=1, keepdims=True) + hc_eps)
        c = c / (c.sum(axis=0, keepdims=True) + hc_eps)
    return pre, post, c


def ref_collapse(x_HD, pre):
    return np.einsum("h,hd->d", np.asarray(pre, np.float64), np.asarray(x_HD, np.float64))


def ref_expand(x_HD, out, post, comb):
    x = np.asarray(x_HD, np.float64)
    return np.asarray(post, np.float64)[:, None] * np.asarray(out, np.float64)[None] + np.asarray(comb).T @ x


def ref_head(x_HD, fn, scale, base, hc_eps, eps):
    pre = sigmoid(ref_mix(x_HD, fn, eps) * scale[0] + base) + hc_eps
    return ref_collapse(x_HD, pre)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _params(rng, scale_mag=1.0):
    fn = (rng.standard_normal((M, H * D)) / np.sqrt(H * D)).astype(np.float32)
    scale = (scale_mag * (0.5 + rng.random(3))).astype(np.float32)
    base = (0.5 * rng.standard_normal(M)).astype(np.float32)
    return fn, scale, base


# ---- norm ---------------------------------------------------------------------------------------------------------
def test_rms_norm_matches_reference(rng):
    x = (3.0 * rng.standard_normal((5, 64))).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    assert rel(jax.jit(rms_norm, static_argnums=2)(x, w, 1e-6), ref_rms(x, w, 1e-6)) < 1e-6
    # per-head q norm: no weight, leading head axis; V4.1's tiny eps 1e-20 stays finite
    assert rel(rms_norm(x, None, 1e-20), ref_rms(x, None, 1e-20)) < 1e-6


# ---- mix / split --------------------------------------------------------------------------------------------------
def test_hc_mix_is_fn_times_rms_normalised_flat_stream(rng):
    fn, _, _ = _params(rng)
    x = (5.0 * rng.standard_normal((H, D))).astype(np.float32)
    got = jax.jit(hc_mix, static_argnums=2)(x, fn, EPS)
    assert got.shape == (M,) and got.dtype == jnp.float32
    assert rel(got, ref_mix(x, fn, EPS)) < 1e-5
    # the flattening is copy-major: permuting copies must permute fn's column blocks
    perm = [2, 0, 3, 1]
    fn_p = fn.reshape(M, H, D)[:, perm].reshape(M, H * D)
    assert rel(hc_mix(x[perm], fn_p, EPS), ref_mix(x, fn, EPS)) < 1e-5


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_hc_split_matches_reference(rng, iters):
    _, scale, base = _params(rng)
    mix = (2.0 * rng.standard_normal(M)).astype(np.float32)
    pre, post, comb = jax.jit(hc_split, static_argnums=(3, 4))(mix, scale, base, HC_EPS, iters)
    rp, rq, rc = ref_split(mix, scale, base, HC_EPS, iters)
    assert pre.shape == (H,) and post.shape == (H,) and comb.shape == (H, H)
    assert rel(pre, rp) < 1e-6 and rel(post, rq) < 1e-6
    assert rel(comb, rc) < 3e-5


def test_sinkhorn_is_doubly_stochastic_after_enough_iterations(rng):
    # moderate logits (very peaked ones converge much more slowly: a property of Sinkhorn, not of the code)
    _, scale, base = _params(rng)
    mix = rng.standard_normal(M).astype(np.float32)
    comb1 = np.asarray(hc_split(mix, scale, base, HC_EPS, 1)[2], np.float64)
    comb = np.asarray(hc_split(mix, scale, base, HC_EPS, 20)[2], np.float64)
    assert np.all(comb > 0)
    np.testing.assert_allclose(comb.sum(axis=0), 1.0, atol=1e-5)  # columns: normalised last
    np.testing.assert_allclose(comb.sum(axis=1), 1.0, atol=1e-4)  # rows: converged
    # one iteration only fixes the columns; the rows are visibly off (so the test above is not vacuous)
    np.testing.assert_allclose(comb1.sum(axis=0), 1.0, atol=1e-5)
    assert np.abs(comb1.sum(axis=1) - 1.0).max() > 1e-2


def test_comb_layout_is_src_major():
    # a huge logit at flat comb index src*H + dst puts all of row src's softmax mass on dst; after the column
    # normalisation that entry is still its row's only non-negligible one (a transposed reading would put it in
    # row dst, column src)
    scale, base, mix = np.ones(3, np.float32), np.zeros(M, np.float32), np.zeros(M, np.float32)
    src, dst = 1, 3
    mix[2 * H + src * H + dst] = 30.0
    comb = np.asarray(hc_split(mix, scale, base, HC_EPS, 1)[2])
    assert np.argmax(comb[src]) == dst and np.delete(comb[src], dst).max() < 1e-5
    assert rel(comb, ref_split(mix, scale, base, HC_EPS, 1)[2]) < 1e-6


# ---- collapse / expand / head -------------------------------------------------------------------------------------
def test_collapse_expand_head_match_reference(rng):
    fn, scale, base = _params(rng)
    x = rng.standard_normal((H, D)).astype(np.float32)
    out = rng.standard_normal(D).astype(np.float32)
    pre, post, comb = ref_split(ref_mix(x, fn, EPS), scale, base, HC_EPS, 20)
    pre32, post32, comb32 = (a.astype(np.float32) for a in (pre, post, comb))
    assert rel(hc_collapse(x, pre32), ref_collapse(x, pre)) < 1e-6
    got = jax.jit(hc_expand)(x, out, post32, comb32)
    assert got.shape == (H, D) and rel(got, ref_expand(x, out, post, comb)) < 1e-6
    fn_h = (rng.standard_normal((H, H * D)) / np.sqrt(H * D)).astype(np.float32)
    sc_h = np.array([0.7], np.float32)
    base_h = rng.standard_normal(H).astype(np.float32)
    got = jax.jit(hc_head, static_argnums=(4, 5))(x, fn_h, sc_h, base_h, HC_EPS, EPS)
    assert got.shape == (D,) and rel(got, ref_head(x, fn_h, sc_h, base_h, HC_EPS, EPS)) < 1e-5


def _toy_sublayer(y_D, k):
    """A stand-in for attention / MoE: any fixed nonlinear map of the normed sublayer input."""
    return np.tanh(y_D * (1.0 + 0.25 * k))


@pytest.mark.parametrize("lag", [False, True])
def test_two_layer_stream_v4_and_v41_lag(rng, lag):
    """Two layers (4 sublayers) wired from the blocks, V4 (own pre) or V4.1 (pre handed to the next sublayer,
    layer 0 starts one-hot on copy 0, the output collapses with the last FFN's pre), against a float64 chain."""
    subs = [_params(rng) for _ in range(4)]
    norms = [rng.standard_normal(D).astype(np.float32) for _ in range(4)]
    fn_h = (rng.standard_normal((H, H * D)) / np.sqrt(H * D)).astype(np.float32)
    sc_h, base_h = np.array([0.7], np.float32), rng.standard_normal(H).astype(np.float32)
    emb = rng.standard_normal(D).astype(np.float32)

    # float64 reference
    x = np.repeat(emb.astype(np.float64)[None], H, axis=0)
    pre_prev = np.eye(H)[0]
    for s, (fn, scale, base) in enumerate(subs):
        pre, post, comb = ref_split(ref_mix(x, fn, EPS), scale, base, HC_EPS, 20)
        y = ref_rms(ref_collapse(x, pre_prev if lag else pre), norms[s], EPS)
        x = ref_expand(x, _toy_sublayer(y, s), post, comb)
        pre_prev = pre
    ref = ref_collapse(x, pre_prev) if lag else ref_head(x, fn_h, sc_h, base_h, HC_EPS, EPS)

    @jax.jit
    def run(emb):
        x = jnp.broadcast_to(emb, (H, D))
        pre_prev = hc_onehot_pre(H)
        for s, (fn, scale, base) in enumerate(subs):
            pre, post, comb = hc_split(hc_mix(x, fn, EPS), scale, base, HC_EPS, 20)
            y = rms_norm(hc_collapse(x, pre_prev if lag else pre), norms[s], EPS)
            x = hc_expand(x, jnp.tanh(y * (1.0 + 0.25 * s)), post, comb)
            pre_prev = pre
        return hc_collapse(x, pre_prev) if lag else hc_head(x, fn_h, sc_h, base_h, HC_EPS, EPS)

    assert rel(run(emb), ref) < 2e-5
    if lag:  # one-hot pre on copy 0 of the initial stream is exactly the embedding
        x0 = jnp.broadcast_to(jnp.asarray(emb), (H, D))
        assert np.array_equal(np.asarray(hc_collapse(x0, hc_onehot_pre(H))), emb)


# ---- row invariance -----------------------------------------------------------------------------------------------
def test_rows_bit_identical_to_decode(rng):
    """T = 1 and T = 3 rows, and the one-token calls, give bit-identical mixes, splits, expands and heads."""
    fn, scale, base = _params(rng)
    fn_h = (rng.standard_normal((H, H * D)) / np.sqrt(H * D)).astype(np.float32)
    sc_h, base_h = np.array([0.7], np.float32), rng.standard_normal(H).astype(np.float32)
    x_THD = rng.standard_normal((3, H, D)).astype(np.float32)
    out_TD = rng.standard_normal((3, D)).astype(np.float32)

    one = jax.jit(lambda x, o: _sublayer(x, o, fn, scale, base, fn_h, sc_h, base_h, single=True))
    rows = jax.jit(lambda x, o: _sublayer(x, o, fn, scale, base, fn_h, sc_h, base_h, single=False))
    r1 = rows(x_THD[:1], out_TD[:1])
    r3 = rows(x_THD, out_TD)
    d0 = one(x_THD[0], out_TD[0])
    for a1, a3, a0 in zip(r1, r3, d0, strict=True):
        assert np.array_equal(np.asarray(a1)[0], np.asarray(a3)[0])
        assert np.array_equal(np.asarray(a3)[0], np.asarray(a0))
    d2 = one(x_THD[2], out_TD[2])
    for a3, a0 in zip(r3, d2, strict=True):
        assert np.array_equal(np.asarray(a3)[2], np.asarray(a0))


def _sublayer(x, out, fn, scale, base, fn_h, sc_h, base_h, single):
    mix = hc_mix(x, fn, EPS) if single else hc_mix_rows(x, fn, EPS)
    pre, post, comb = hc_split(mix, scale, base, HC_EPS, 20)
    y = hc_collapse(x, pre)
    x2 = hc_expand(x, out, post, comb)
    head = hc_head(x2, fn_h, sc_h, base_h, HC_EPS, EPS) if single else hc_head_rows(x2, fn_h, sc_h, base_h, HC_EPS,
                                                                                     EPS)
    return mix, pre, post, comb, y, x2, head


def test_elementwise_blocks_broadcast_many_rows_bit_identically(rng):
    """split / collapse / expand take a leading token axis directly; 32 rows equal 32 one-token calls."""
    _, scale, base = _params(rng)
    mix = rng.standard_normal((32, M)).astype(np.float32)
    x = rng.standard_normal((32, H, D)).astype(np.float32)
    out = rng.standard_normal((32, D)).astype(np.float32)

    def blocks(mix, x, out):
        pre, post, comb = hc_split(mix, scale, base, HC_EPS, 20)
        return pre, post, comb, hc_collapse(x, pre), hc_expand(x, out, post, comb)

    f = jax.jit(blocks)
    many = [np.asarray(a) for a in f(mix, x, out)]
    for t in (0, 13, 31):
        for a_many, a_one in zip(many, f(mix[t], x[t], out[t]), strict=True):
            assert np.array_equal(a_many[t], np.asarray(a_one))
