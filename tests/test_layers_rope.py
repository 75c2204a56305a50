"""RoPE (jds41/layers/rope.py) against a float64 numpy statement of llama.cpp's formula, plus its properties.

The reference below is written from the YaRN formula of ggml (ggml_rope_yarn_corr_dims / rope_yarn with
ext_factor 1, freq_scale 1/factor, mscale cancelled) as LLAMACPP_DEEPSEEK4.md §3 states it, pair by pair in plain
Python floats, independently of the vectorised code under test.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jds41.checkpoints.presets import preset
from jds41.layers.rope import apply_rope, layer_rope_freqs, rope_freqs, yarn_corr_dims

V4_YARN = (16.0, 65536, 32.0, 1.0)


def ref_freqs(R: int, base: float, yarn=None) -> np.ndarray:
    """float64 per-pair frequencies, one pair at a time."""
    out = []
    if yarn:
        factor, orig, b_fast, b_slow = yarn
        cd = [R * math.log(orig / (b * 2 * math.pi)) / (2 * math.log(base)) for b in (b_fast, b_slow)]
        lo, hi = max(0, math.floor(cd[0])), min(R - 1, math.ceil(cd[1]))
    for k in range(R // 2):
        theta_extrap = base ** (-2.0 * k / R)
        theta = theta_extrap
        if yarn:
            y = (k - lo) / max(0.001, hi - lo)
            ramp_mix = (1 - min(1.0, max(0.0, y))) * 1.0  # ext_factor = 1
            theta_interp = theta_extrap / factor
            theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
        out.append(theta)
    return np.array(out, dtype=np.float64)


def ref_rope(x: np.ndarray, pos: np.ndarray, freqs64: np.ndarray, inverse=False) -> np.ndarray:
    """x [T, ..., K] float64, pos [T]: adjacent pairs of the last 2*len(freqs) dims."""
    x = np.array(x, dtype=np.float64)
    R = 2 * len(freqs64)
    K = x.shape[-1]
    for t in range(x.shape[0]):
        for k in range(R // 2):
            ang = float(pos[t]) * freqs64[k] * (-1 if inverse else 1)
            i0, i1 = K - R + 2 * k, K - R + 2 * k + 1
            a, b = x[t, ..., i0].copy(), x[t, ..., i1].copy()
            x[t, ..., i0] = a * math.cos(ang) - b * math.sin(ang)
            x[t, ..., i1] = a * math.sin(ang) + b * math.cos(ang)
    return x


@pytest.mark.parametrize("R,base,yarn", [(64, 10000.0, None), (64, 160000.0, V4_YARN),
                                         (16, 160000.0, (16.0, 1024, 32.0, 1.0)), (8, 10000.0, (4.0, 4096, 32.0, 1.0)),
                                         (64, 160000.0, (1.0, 65536, 32.0, 1.0))])
def test_freqs_match_formula(R, base, yarn):
    got = rope_freqs(R, base, yarn)
    assert got.dtype == np.float32 and got.shape == (R // 2,)
    np.testing.assert_array_equal(got, ref_freqs(R, base, yarn).astype(np.float32))
    np.testing.assert_array_equal(got, rope_freqs(R, base, yarn))  # deterministic


def test_v4_yarn_numbers():
    """V4: ramp from pair 15 to 25; pairs <= 15 unscaled, pairs >= 25 divided by 16."""
    assert yarn_corr_dims(64, 160000.0, 65536, 32.0, 1.0) == (15.0, 25.0)
    plain, yarn = rope_freqs(64, 160000.0), rope_freqs(64, 160000.0, V4_YARN)
    np.testing.assert_array_equal(yarn[:16], plain[:16])
    np.testing.assert_allclose(yarn[25:], plain[25:] / 16, rtol=1e-7)
    assert np.all(yarn[16:25] < plain[16:25]) and np.all(yarn[16:25] > plain[16:25] / 16)


def test_layer_freqs_follow_ratio():
    for arch in ("deepseek4", "deepseek41"):
        cfg = preset(arch, "full")
        yarn = (cfg.rope_factor, cfg.rope_orig_ctx, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        for layer in range(cfg.n_layers):
            want = (rope_freqs(cfg.rope_dim, cfg.rope_base) if cfg.ratio(layer) == 0
                    else rope_freqs(cfg.rope_dim, cfg.compress_rope_base, yarn))
            np.testing.assert_array_equal(layer_rope_freqs(cfg, layer), want)
    cfg = preset("deepseek4", "full")
    assert cfg.ratio(0) == 0 and cfg.ratio(2) == 4
    np.testing.assert_array_equal(layer_rope_freqs(cfg, 0), ref_freqs(64, 10000.0).astype(np.float32))
    np.testing.assert_array_equal(layer_rope_freqs(cfg, 2), ref_freqs(64, 160000.0, V4_YARN).astype(np.float32))


@pytest.mark.parametrize("yarn", [None, V4_YARN])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_matches_reference(yarn, inverse):
    rng = np.random.default_rng(0)
    T, H, K, R = 6, 3, 96, 64
    x = rng.standard_normal((T, H, K)).astype(np.float32)
    pos = np.array([0, 1, 7, 127, 1000, 4095], np.int32)
    freqs = rope_freqs(R, 160000.0, yarn)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), freqs, inverse=inverse))
    want = ref_rope(x, pos, ref_freqs(R, 160000.0, yarn), inverse)
    # The only rounding that grows with p is the f32 angle p * f (half an ulp of p * f <= p * 2^-24 rad).
    tol = (2 * pos * 2.0 ** -24 + 2e-6)[:, None, None] * np.abs(x).max()
    assert np.all(np.abs(got - want) <= tol)
    # With the angle rounded to f32 exactly as the code does, float64 trig agrees to f32 precision.
    ang32 = (pos.astype(np.float32)[:, None] * freqs[None, :]).astype(np.float64)
    want32 = np.stack([ref_rope(x[t:t + 1], np.ones(1), ang32[t], inverse)[0] for t in range(T)])
    np.testing.assert_allclose(got, want32, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(got[..., :K - R], x[..., :K - R])  # non-rope dims untouched


def test_large_positions_close_to_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    pos = np.array([65535, 300_000, 1_048_575], np.int32)
    freqs = rope_freqs(64, 160000.0, V4_YARN)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), freqs))
    want = ref_rope(x, pos, freqs.astype(np.float64))  # same f32 freqs: only the angle product is rounded
    err = np.abs(got - want).max(axis=-1)
    assert np.all(err < 8 * pos * 2.0 ** -24 + 1e-5), err


def test_scalar_pos_and_dtype():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    freqs = rope_freqs(8, 10000.0)
    a = apply_rope(jnp.asarray(x), 5, freqs)
    b = apply_rope(jnp.asarray(x), jnp.full((4,), 5, jnp.int32), freqs)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    xb = jnp.asarray(x, jnp.bfloat16)
    assert apply_rope(xb, 5, freqs).dtype == jnp.bfloat16
    with pytest.raises(ValueError):
        apply_rope(jnp.asarray(x), jnp.zeros((3,), jnp.int32), freqs)


@pytest.mark.parametrize("yarn", [None, V4_YARN])
def test_inverse_undoes_forward_and_norm_preserved(yarn):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 4, 128)).astype(np.float32))
    pos = jnp.asarray([0, 3, 64, 511, 9999], jnp.int32)
    freqs = rope_freqs(64, 160000.0, yarn)
    y = apply_rope(x, pos, freqs)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(y), axis=-1), np.linalg.norm(np.asarray(x), axis=-1),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(apply_rope(y, pos, freqs, inverse=True)), np.asarray(x), atol=1e-5)


@pytest.mark.parametrize("yarn", [None, V4_YARN])
def test_relative_position(yarn):
    """q(p) . k(s) depends only on p - s."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((64,)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((64,)).astype(np.float32))
    freqs = rope_freqs(64, 160000.0 if yarn else 10000.0, yarn)
    for delta in (0, 1, 5, 100):
        dots = [float(jnp.dot(apply_rope(q, s + delta, freqs), apply_rope(k, s, freqs))) for s in (0, 17, 250, 3000)]
        # f32 angles: the error grows like s * 2^-24 rad per pair
        np.testing.assert_allclose(dots, dots[0], atol=1e-3)
