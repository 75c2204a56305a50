"""A sublayer's input as Triton launches (jds41/layers/mhc_input_kernel.py): V4.1's under the lag in two (on by
default; JDS41_MHC_KERNEL=0 takes XLA's), V4's unlagged in three (on by
default too; JDS41_MHC_KERNEL_V4=0 takes XLA's for V4).

On every machine, both forms: the kernels in Pallas' interpreter against the XLA spelling (layers/mhc.py's mix,
split and collapse, layers/norm.py's norm: the reference) and a float64 numpy re-derivation of MODEL.md §2.1; each
row's result does not depend on the rows around it (alone, in a block, permuted, under vmap); switched on,
`model.sublayer_input` lowers to the kernels for CUDA only, and switched off it does not. On a GPU (marker `gpu`):
the compiled kernels against the XLA spelling at V4.1's and V4's shapes, and a row alone against the same row in a
block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mhc_reference import numpy_sinkhorn

from jds41 import model
from jds41.layers import mhc_input_kernel
from jds41.layers.mhc import hc_collapse, hc_mix, hc_split
from jds41.layers.mhc_input_kernel import sublayer_input_rows
from jds41.layers.norm import rms_norm
from jds41.quant.int8_act import round_int8

TRITON_CALL = "__gpu$xla.gpu.triton"
RMS_EPS, HC_EPS = 1e-6, 1e-6


def _inputs(n: int, d: int, seed: int = 0):
    """Streams [n, 4, d], handed-over pres [n, 4], fn [24, 4d], scale [3], base [24], norm [d] at V4.1-like scales."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 4, d)) * rng.uniform(0.2, 5, (n, 1, 1))).astype(np.float32)
    pre = rng.uniform(0.05, 1.0, (n, 4)).astype(np.float32)
    fn = (rng.standard_normal((24, 4 * d)) / np.sqrt(4 * d)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = rng.standard_normal(24).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, d).astype(np.float32)
    return x, pre, fn, scale, base, norm


def _xla(x, pre_prev, fn, scale, base, norm, iters):
    """The reference: mhc's XLA spelling, row by row; `pre_prev` None: each row's own pre collapses (V4)."""
    def row(x_HD, p):
        pre, post, comb = hc_split(hc_mix(x_HD, fn, RMS_EPS), scale, base, HC_EPS, iters)
        return rms_norm(hc_collapse(x_HD, pre if p is None else p), norm, RMS_EPS), pre, post, comb
    if pre_prev is None:
        return jax.jit(jax.vmap(lambda x_HD: row(x_HD, None)))(jnp.asarray(x))
    return jax.jit(jax.vmap(row))(jnp.asarray(x), jnp.asarray(pre_prev))


def _numpy(x, pre_prev, fn, scale, base, norm, iters):
    """MODEL.md §2.1 in float64: RMS-normalised flat stream, the mix, the split with Sinkhorn, the collapse (with
    the lagged pre, or with the row's own where `pre_prev` is None)."""
    x, fn, scale, base, norm = (np.asarray(a, np.float64) for a in (x, fn, scale, base, norm))
    n = x.shape[0]
    flat = x.reshape(n, -1)
    mix = (flat / np.sqrt((flat ** 2).mean(1, keepdims=True) + RMS_EPS)) @ fn.T  # [n, 24]
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    pre = sig(mix[:, :4] * scale[0] + base[:4]) + HC_EPS
    post = 2 * sig(mix[:, 4:8] * scale[1] + base[4:8])
    c = numpy_sinkhorn((mix[:, 8:] * scale[2] + base[8:]).reshape(n, 4, 4), HC_EPS, iters)
    y = np.einsum("nh,nhd->nd", pre if pre_prev is None else np.asarray(pre_prev, np.float64), x)
    h = y / np.sqrt((y ** 2).mean(1, keepdims=True) + RMS_EPS) * norm
    return h, pre, post, c


def _kernel(args, iters, **layout):
    x, pre_prev, fn, scale, base, norm = args
    pre_prev = None if pre_prev is None else jnp.asarray(pre_prev)
    return sublayer_input_rows(jnp.asarray(x), pre_prev, jnp.asarray(fn), jnp.asarray(scale),
                               jnp.asarray(base), jnp.asarray(norm), rms_eps=RMS_EPS, hc_eps=HC_EPS, iters=iters,
                               interpret=True, **layout)


def _unlagged(args):
    """V4's inputs: no handed-over pre."""
    return [args[0], None, *args[2:]]


@pytest.mark.parametrize("lag", ["lagged", "unlagged"])
@pytest.mark.parametrize("most_cols", [128, 32])
def test_the_interpreted_kernels_equal_the_xla_spelling_and_a_float64_rederivation(most_cols, lag):
    args = _inputs(3, 384)  # three first-launch programs of 128 columns (twelve of 32)
    args = args if lag == "lagged" else _unlagged(args)
    got = [np.asarray(a) for a in _kernel(args, 20, most_cols=most_cols)]
    for name, g, x, ref in zip(("h", "pre", "post", "comb"), got, _xla(*args, 20), _numpy(*args, 20)):
        scale = np.abs(ref).max()
        np.testing.assert_allclose(g, np.asarray(x), rtol=0, atol=2e-6 * scale, err_msg=name)
        np.testing.assert_allclose(g, ref, rtol=0, atol=2e-6 * scale, err_msg=name)
    # the kernels really ran: the mix is summed in another order (fn @ x, then the RMS), so its bits differ
    assert not all(np.array_equal(g, np.asarray(x)) for g, x in zip(got, _xla(*args, 20)))


@pytest.mark.parametrize("lag", ["lagged", "unlagged"])
@pytest.mark.parametrize("most_cols", [128, 32])
def test_round_h_adds_hs_int8_blocks_as_the_rounding_gives_them(most_cols, lag):
    """The FFN input's int8 blocks written by h's launch (round_h): h and the rest unchanged, (q, d) bit for bit
    `round_int8` of that h (what the routed gate/up launch would otherwise round in a launch of its own)."""
    args = _inputs(2, 384, seed=4)
    args = args if lag == "lagged" else _unlagged(args)
    plain = [np.asarray(a) for a in _kernel(args, 3, most_cols=most_cols)]
    got = [np.asarray(a) for a in _kernel(args, 3, most_cols=most_cols, round_h=True)]
    assert len(got) == 6
    for g, p in zip(got[:4], plain):
        np.testing.assert_array_equal(g, p)
    q, d = round_int8(jnp.asarray(got[0]))
    np.testing.assert_array_equal(got[4], np.asarray(q))
    np.testing.assert_array_equal(got[5], np.asarray(d))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        _kernel(_inputs(1, 16 * 3, seed=5), 3, most_cols=16, round_h=True)  # 16 columns a program


def test_a_layout_the_kernels_cannot_take_is_refused():
    for layout in ({"most_cols": 48}, {"most_cols": 8}, {"partial_warps": 3}):
        with pytest.raises(ValueError, match="columns a power of two"):
            _kernel(_inputs(1, 128), 3, **layout)


@pytest.mark.parametrize("lag", ["lagged", "unlagged"])
def test_a_rows_input_does_not_depend_on_the_rows_around_it(lag):
    iters = 3  # the property does not depend on Sinkhorn's round count; fewer rounds run faster interpreted
    args = list(_inputs(5, 192, seed=1))  # three programs of 64 columns; for V4, args[1] is sliced but unused
    run = (lambda a: _kernel(a, iters)) if lag == "lagged" else (lambda a: _kernel(_unlagged(a), iters))  # noqa: E731
    block = [np.asarray(a) for a in run(args)]
    perm = np.array([3, 0, 4, 1, 2])
    for got, want in zip(run([args[0][perm], args[1][perm], *args[2:]]), block):
        np.testing.assert_array_equal(np.asarray(got), want[perm])
    for r in (0, 4):
        alone = run([args[0][r:r + 1], args[1][r:r + 1], *args[2:]])
        for got, want in zip(alone, block):
            np.testing.assert_array_equal(np.asarray(got)[0], want[r])
    x, pre_prev, fn, scale, base, norm = (jnp.asarray(a) for a in args)
    vm = jax.vmap(lambda xr, pr: run([xr[None], pr[None], fn, scale, base, norm]))(x, pre_prev)
    for got, want in zip(vm, block):
        np.testing.assert_array_equal(np.asarray(got)[:, 0], want)


@pytest.mark.parametrize("lag", ["lagged", "unlagged"])
@pytest.mark.parametrize("enabled", [True, False])
def test_the_sublayer_input_lowers_to_the_kernels_on_cuda_only_when_switched_on(monkeypatch, enabled, lag):
    """V4.1's (lagged) under JDS41_MHC_KERNEL, V4's (unlagged) under JDS41_MHC_KERNEL_V4 as well."""
    lagged = lag == "lagged"
    monkeypatch.setattr(mhc_input_kernel, "ENABLED", True if not lagged else enabled)
    monkeypatch.setattr(mhc_input_kernel, "ENABLED_V4", enabled)
    d = 64
    cfg = type("Cfg", (), {"hc_lag": lagged, "hc_mult": 4, "dim": d, "hc_mix": 24, "rms_eps": RMS_EPS,
                           "hc_eps": HC_EPS, "hc_sinkhorn_iters": 3})()
    _, _, fn, scale, base, norm = _inputs(1, d)
    w = {"hc_attn_fn": fn, "hc_attn_scale": scale, "hc_attn_base": base, "attn_norm": norm}
    x = jax.ShapeDtypeStruct((4, d), jnp.float32)
    p = jax.ShapeDtypeStruct((4,), jnp.float32)
    run = lambda x_HD, pre: model.sublayer_input(cfg, w, "attn", x_HD, pre)  # noqa: E731
    names = ("mhc_input_partials", "mhc_input_normed_split") if lagged else (
        "mhc_input_mix_partials", "mhc_input_split_collapse", "mhc_input_normed")
    for platform, sinkhorn_only in (("cuda", not enabled), ("cpu", None)):
        text = jax.jit(run).trace(x, p).lower(lowering_platforms=(platform,)).as_text()
        if platform == "cpu":
            assert TRITON_CALL not in text
        else:  # switched off, the only Triton call is hc_split's Sinkhorn kernel
            assert TRITON_CALL in text and all((f'"{name}"' in text) is enabled for name in names)
            assert ("mhc_sinkhorn" in text) is sinkhorn_only


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [{}, {"most_cols": 32, "partial_warps": 1}], ids=["default", "32-cols-1-warp"])
@pytest.mark.parametrize("shape", ["v41", "v4"])
def test_the_compiled_kernels_agree_with_the_xla_spelling_on_the_gpu(layout, shape):
    args = _inputs(4, 5120 if shape == "v41" else 4096, seed=2)
    if shape == "v4":
        args = _unlagged(args)
    run = lambda a: sublayer_input_rows(*(None if v is None else jnp.asarray(v) for v in a),  # noqa: E731
                                        rms_eps=RMS_EPS, hc_eps=HC_EPS, iters=20, **layout)
    got = [np.asarray(a) for a in run(args)]
    for name, g, x in zip(("h", "pre", "post", "comb"), got, _xla(*args, 20)):
        np.testing.assert_allclose(g, np.asarray(x), rtol=0, atol=1e-5 * np.abs(np.asarray(x)).max(), err_msg=name)
    alone = run([args[0][2:3], None if args[1] is None else args[1][2:3], *args[2:]])
    for g, a in zip(got, alone):
        np.testing.assert_array_equal(np.asarray(a)[0], g[2])
