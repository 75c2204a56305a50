"""The fused sublayer input (jds41/layers/mhc_kernel.py): mHC's mix, split, Sinkhorn, collapse and the sublayer's
RMS norm as two Triton kernels, the fast path on CUDA.

On every machine: the kernels in Pallas' interpreter against the XLA composition of mhc.py and norm.py (the
reference) and a float64 numpy re-derivation of MODEL.md §2.1, with V4.1's handed-over pre and V4's own; a row's
outputs do not depend on the rows around it (alone, in a block, under vmap); `model.sublayer_input` lowers to the
Triton calls for CUDA only. On a GPU (marker `gpu`): the compiled kernels at V4.1's width against the reference,
and a row alone against the same row in a block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.checkpoints import presets
from jds41.layers.mhc import hc_collapse, hc_mix, hc_split
from jds41.layers.mhc_kernel import sublayer_input_rows
from jds41.layers.norm import rms_norm
from jds41.model import sublayer_input

TRITON_CALL = "__gpu$xla.gpu.triton"
RMS_EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20


def _case(n: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 4, d)).astype(np.float32),
            "fn": (rng.standard_normal((24, 4 * d)) * 0.05).astype(np.float16),  # ds4 files keep HC tensors F16
            "scale": np.array([0.7, 1.3, 0.9], np.float32), "base": rng.standard_normal(24).astype(np.float32),
            "prev": rng.random((n, 4)).astype(np.float32), "norm": (rng.random(d) + 0.5).astype(np.float32)}


def _kernel(c, lag, iters=ITERS, interpret=True):
    return sublayer_input_rows(jnp.asarray(c["x"]), jnp.asarray(c["fn"]), c["scale"], c["base"], c["prev"],
                               c["norm"], rms_eps=RMS_EPS, hc_eps=HC_EPS, iters=iters, lag=lag, interpret=interpret)


def _xla(c, n, lag):
    pre, post, comb = hc_split(hc_mix(c["x"][n], c["fn"], RMS_EPS), c["scale"], c["base"], HC_EPS, ITERS)
    return rms_norm(hc_collapse(c["x"][n], c["prev"][n] if lag else pre), c["norm"], RMS_EPS), pre, post, comb


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _numpy(c, n, lag):
    """MODEL.md §2.1 in float64: mix = fn @ RMS-normalised stream, split, Sinkhorn, collapse, RMS norm * weight."""
    x = c["x"][n].astype(np.float64)
    flat = x.reshape(-1)
    mix = c["fn"].astype(np.float64) @ (flat / np.sqrt(np.mean(flat ** 2) + RMS_EPS))
    s, b = c["scale"].astype(np.float64), c["base"].astype(np.float64)
    pre = _sigmoid(mix[:4] * s[0] + b[:4]) + HC_EPS
    post = 2 * _sigmoid(mix[4:8] * s[1] + b[4:8])
    lg = (mix[8:] * s[2] + b[8:]).reshape(4, 4)
    e = np.exp(lg - lg.max(-1, keepdims=True))
    comb = e / e.sum(-1, keepdims=True) + HC_EPS
    comb = comb / (comb.sum(-2, keepdims=True) + HC_EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + HC_EPS)
        comb = comb / (comb.sum(-2, keepdims=True) + HC_EPS)
    y = (c["prev"][n] if lag else pre) @ x
    return y / np.sqrt(np.mean(y ** 2) + RMS_EPS) * c["norm"], pre, post, comb


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("lag", [True, False], ids=["v41-handed-over-pre", "v4-own-pre"])
def test_the_interpreted_kernels_equal_the_reference_and_a_float64_derivation(lag):
    c = _case(3, 64)
    got = _kernel(c, lag)
    assert [o.shape for o in got] == [(3, 64), (3, 4), (3, 4), (3, 4, 4)]
    for n in range(3):
        for g, x, ref in zip((o[n] for o in got), _xla(c, n, lag), _numpy(c, n, lag), strict=True):
            assert _rel(g, x) < 1e-6 and _rel(g, ref) < 1e-5
    if lag:  # the handed-over pre is what collapses: another one gives another input, the same mixes
        other = _kernel({**c, "prev": c["prev"][::-1].copy()}, lag)
        assert not np.allclose(other[0], got[0]) and np.array_equal(other[3], got[3])


def test_a_rows_outputs_do_not_depend_on_the_rows_around_it():
    c = _case(3, 64, seed=1)
    block = [np.asarray(o) for o in _kernel(c, True, iters=3)]  # fewer rounds compile faster in the interpreter
    for r in (0, 2):
        alone = _kernel({k: (v[r:r + 1] if k in ("x", "prev") else v) for k, v in c.items()}, True, iters=3)
        for a, b in zip(alone, block, strict=True):
            np.testing.assert_array_equal(np.asarray(a)[0], b[r])
    vm = jax.vmap(lambda x, p: tuple(o[0] for o in sublayer_input_rows(
        x[None], jnp.asarray(c["fn"]), c["scale"], c["base"], p[None], c["norm"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
        iters=3, lag=True, interpret=True)))(jnp.asarray(c["x"]), jnp.asarray(c["prev"]))
    for a, b in zip(vm, block, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_sublayer_input_lowers_to_the_kernels_on_cuda_only():
    cfg = presets.preset("deepseek41", "tiny", 2)
    c = _case(1, cfg.dim)
    w = {"hc_attn_fn": c["fn"], "hc_attn_scale": c["scale"], "hc_attn_base": c["base"], "attn_norm": c["norm"]}
    fn = lambda x, p: sublayer_input(cfg, w, "attn", x, p)  # noqa: E731
    args = (jax.ShapeDtypeStruct((4, cfg.dim), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))
    for platform, want in (("cuda", True), ("cpu", False)):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert (text.count(TRITON_CALL) >= 2) is want, platform


@pytest.mark.gpu
@pytest.mark.parametrize("lag", [True, False], ids=["v41-handed-over-pre", "v4-own-pre"])
def test_the_compiled_kernels_agree_with_the_reference_on_the_gpu(lag):
    c = _case(4, 5120, seed=2)  # V4.1's model width
    got = [np.asarray(o) for o in _kernel(c, lag, interpret=False)]
    for n in range(4):
        for g, x in zip((o[n] for o in got), jax.jit(lambda n=n: _xla(c, n, lag))(), strict=True):
            assert _rel(g, x) < 1e-5
    alone = _kernel({k: (v[1:2] if k in ("x", "prev") else v) for k, v in c.items()}, lag, interpret=False)
    for a, b in zip(alone, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a)[0], b[1])
