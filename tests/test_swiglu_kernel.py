"""quant/swiglu_kernel.py: an FFN's hidden activations (SwiGLU, rounded to int8 blocks where the product reads them
so) in one launch.

Interpreted (any platform) the kernel's body is XLA:CPU's own silu, so against the reference spellings
(`swiglu`, `round_int8`, `triton_matvec._crumb_major`) every mode, limit and part layout is checked bit for bit, and
the values against a float64 numpy re-derivation. The products take a `SwiGLU` where they take x and give the bits
of the evaluated activation; `moe.routed_and_shared` lowered for CUDA holds one hidden launch (none with the
switch off). On a GPU (marker `gpu`): the compiled kernel at V4-Flash's and V4.1's FFN widths against XLA's
spelling, to f32 rounding (it prints whether they are equal), and the compiled FFN paths against each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.layers import moe
from jds41.quant import QTensor, co_launch, qmatvec, qmatvec_experts, swiglu_kernel, triton_matvec
from jds41.quant.int8_act import round_int8
from jds41.quant.planar import to_planar
from jds41.quant.random_blocks import random_quantized
from jds41.quant.swiglu_kernel import SwiGLU, hidden_rows, swiglu


def _pair(rng, X, F, scale=4.0):
    g = jnp.asarray(rng.standard_normal((X, F)) * scale, jnp.float32)
    u = jnp.asarray(rng.standard_normal((X, F)) * scale, jnp.float32)
    return g, u


def _equal(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want) and got
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _numpy_swiglu(g, u, limit):
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    if limit > 1e-6:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("limit", [0.0, 7.0, "traced"])
@pytest.mark.parametrize("X,F", [(6, 512), (1, 96), (3, 2304)])
def test_every_mode_gives_the_reference_bits_interpreted(X, F, limit):
    rng = np.random.default_rng(X * F)
    g, u = _pair(rng, X, F)
    lim = jnp.float32(7.0) if limit == "traced" else limit
    act = SwiGLU.of(g, u, lim)
    modes = ("f32", "int8") + (("int8-crumbs",) if F % 256 == 0 else ())
    outs = jax.jit(lambda a: hidden_rows((a,) * len(modes), modes, interpret=True))(act)
    want_h = swiglu(g, u, lim)
    want_q, want_d = round_int8(want_h)
    _equal(outs[0], want_h)
    _equal(outs[1], (want_q, want_d))
    if len(modes) == 3:
        _equal(outs[2], (triton_matvec._crumb_major(want_q), want_d))
    ref = _numpy_swiglu(g, u, 7.0 if limit != 0.0 else 0.0)
    assert np.max(np.abs(np.asarray(outs[0]) - ref)) <= 1e-6 * np.max(np.abs(ref))
    if limit != 0.0:  # the clamp is on: no value past silu(7) * 7
        assert np.max(np.abs(np.asarray(outs[0]))) <= 7.0 * 7.0


def test_a_part_gives_the_same_bits_alone_and_beside_others():
    rng = np.random.default_rng(3)
    routed, shared = SwiGLU.of(*_pair(rng, 6, 512), 10.0), SwiGLU.of(*_pair(rng, 1, 512), 0.0)
    together = hidden_rows((routed, shared), ("int8-crumbs", "f32"), interpret=True)
    _equal(together[0], hidden_rows((routed,), ("int8-crumbs",), interpret=True)[0])
    _equal(together[1], hidden_rows((shared,), ("f32",), interpret=True)[0])


def test_bad_parts_are_refused():
    g, u = _pair(np.random.default_rng(4), 2, 96)
    with pytest.raises(ValueError, match="mode"):
        hidden_rows((SwiGLU.of(g, u, 0.0),), ("bf16",), interpret=True)
    with pytest.raises(ValueError, match="whole blocks"):
        hidden_rows((SwiGLU.of(g, u, 0.0),), ("int8-crumbs",), interpret=True)  # 96 is not a multiple of 256
    with pytest.raises(ValueError, match="differ"):
        SwiGLU.of(g, u[:, :64], 0.0)
    with pytest.raises(ValueError, match="2F"):
        hidden_rows((SwiGLU(g[:, :95], 0.0),), ("f32",), interpret=True)
    with pytest.raises(ValueError, match="activations for"):
        hidden_rows((SwiGLU.of(g, u, 0.0),), ("f32", "int8"), interpret=True)


def _stack(rng, qtype, shape, act_round):
    raw = random_quantized(rng, qtype, shape)
    w = QTensor.from_raw(raw, qtype, shape, act_round)
    return w.with_layout(jnp.asarray(to_planar(raw, qtype)), "planar") if qtype != T.MXFP4 else w


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(triton_matvec, "INTERPRET", True)
    monkeypatch.setattr(co_launch, "ENABLED", True)
    monkeypatch.setattr(swiglu_kernel, "ENABLED", True)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.IQ2_XXS, T.MXFP4])
def test_the_int8_products_take_a_swiglu_and_give_the_evaluated_bits(interpreted, qtype):
    rng = np.random.default_rng(int(qtype))
    w = _stack(rng, qtype, (5, 32, 512), "int8")
    g, u = _pair(rng, 3, 512)
    idx = jnp.asarray([4, 0, 2], jnp.int32)
    got = jax.jit(lambda g, u: qmatvec_experts(SwiGLU.of(g, u, 7.0), w, idx))(g, u)
    _equal(got, jax.jit(lambda g, u: qmatvec_experts(swiglu(g, u, 7.0), w, idx))(g, u))


def test_the_f32_product_takes_a_swiglu_and_gives_the_evaluated_bits(interpreted):
    rng = np.random.default_rng(11)
    w = _stack(rng, T.Q8_0, (64, 512), None)
    g, u = _pair(rng, 1, 512)
    got = jax.jit(lambda g, u: qmatvec(SwiGLU.of(g[0], u[0], 0.0), w))(g, u)
    _equal(got, jax.jit(lambda g, u: qmatvec(swiglu(g[0], u[0], 0.0), w))(g, u))


def _ffn(rng, E=5, F=256, D=512):
    """A small V4.1-like FFN under the int8 numerics: IQ2_XXS gate/up, Q2_K down, Q8_0 shared expert, planar."""
    routed = tuple(_stack(rng, qt, s, "int8") for qt, s in ((T.IQ2_XXS, (E, F, D)), (T.IQ2_XXS, (E, F, D)),
                                                             (T.Q2_K, (E, D, F))))
    shared = tuple(_stack(rng, T.Q8_0, s, "int8") for s in ((F, D), (F, D), (D, F)))
    return routed, shared


def test_routed_and_shared_with_the_kernel_give_the_xla_spellings_bits_interpreted(interpreted, monkeypatch):
    rng = np.random.default_rng(12)
    routed, shared = _ffn(rng)
    x = jnp.asarray(rng.standard_normal(512) * 3, jnp.float32)
    idx, weight = jnp.asarray([2, 4, 1], jnp.int32), jnp.asarray([0.5, 0.3, 0.2], jnp.float32)
    run = lambda x: moe.routed_and_shared(x, routed, idx, weight, 7.0, shared, 10.0)  # noqa: E731
    traced = lambda: str(jax.make_jaxpr(lambda x: run(x))(x))  # noqa: E731 (a new function: jax caches traces)
    on = jax.jit(run)(x)
    assert traced().count("name=swiglu_hidden") == 1  # both activations, one launch
    monkeypatch.setattr(swiglu_kernel, "ENABLED", False)
    assert "swiglu_hidden" not in traced()
    _equal(on, jax.jit(lambda x: run(x))(x))


def _lowered_for_cuda(monkeypatch, fn, *args):
    from jds41.quant import int8_round_kernel

    monkeypatch.setattr(triton_matvec, "INTERPRET", False)
    monkeypatch.setattr(triton_matvec, "ENABLED", True)
    monkeypatch.setattr(triton_matvec, "has_triton_backend", lambda: True)
    monkeypatch.setattr(triton_matvec, "_BACKEND", True)
    monkeypatch.setattr(int8_round_kernel, "ENABLED", True)
    monkeypatch.setattr(co_launch, "ENABLED", True)
    fresh = lambda *a: fn(*a)  # noqa: E731 (a new function each time: jax caches traces by function)
    return jax.jit(fresh).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowered_for_cuda_an_ffn_prepares_its_down_products_in_one_launch(monkeypatch):
    rng = np.random.default_rng(13)
    routed, shared = _ffn(rng)
    x, idx, weight = jnp.ones(512, jnp.float32), jnp.arange(3, dtype=jnp.int32), jnp.ones(3, jnp.float32) / 3
    fn = lambda x, i, w: moe.routed_and_shared(x, routed, i, w, 7.0, shared, 10.0)  # noqa: E731
    monkeypatch.setattr(swiglu_kernel, "ENABLED", True)
    on = _lowered_for_cuda(monkeypatch, fn, x, idx, weight)
    # one hidden launch for both down products; the one rounding launch left is the gate/up product's x
    assert on.count('name = "swiglu_hidden"') == 1 and on.count('name = "round_int8"') == 1
    assert "stablehlo.exponential" not in on  # no XLA SwiGLU left (jax spells the sigmoid 1 / (1 + exp(-x)))
    assert "stablehlo.concatenate" not in on  # the gate/up launch's output read as written (co_launch's joint)
    monkeypatch.setattr(swiglu_kernel, "ENABLED", False)
    off = _lowered_for_cuda(monkeypatch, fn, x, idx, weight)
    assert "swiglu_hidden" not in off and off.count('name = "round_int8"') == 2
    assert off.count("stablehlo.exponential") == 2


# V4-Flash's FFN (6 routed experts and the shared one, 2048 wide: int8 for the MXFP4 down, f32 for the shared
# expert's Q8_0) and V4.1's (2304 wide, Q2_K's order)
@pytest.mark.gpu
@pytest.mark.parametrize("F,routed_mode", [(2048, "int8"), (2304, "int8-crumbs")])
def test_the_compiled_kernel_agrees_with_xla_on_the_gpu(F, routed_mode):
    rng = np.random.default_rng(F)
    routed, shared = SwiGLU.of(*_pair(rng, 6, F, 3.0), 10.0), SwiGLU.of(*_pair(rng, 1, F, 3.0), 0.0)
    (q, d), h = jax.jit(lambda r, s: hidden_rows((r, s), (routed_mode, "f32")))(routed, shared)
    want_h = jax.jit(lambda s: s.value())(shared)
    want_r = jax.jit(lambda r: r.value())(routed)
    want_q, want_d = jax.jit(round_int8)(want_r)
    if routed_mode == "int8-crumbs":
        want_q = triton_matvec._crumb_major(want_q)
    h_equal = bool(np.array_equal(np.asarray(h), np.asarray(want_h)))
    q_equal = float(np.mean(np.asarray(q) == np.asarray(want_q)))
    print(f"F={F}: h equal to XLA's {h_equal}, q equal {q_equal:.6f}, d max rel "
          f"{float(np.max(np.abs(np.asarray(d) - np.asarray(want_d)) / np.asarray(want_d))):.2e}")
    scale = float(np.max(np.abs(np.asarray(want_h))))
    assert np.max(np.abs(np.asarray(h) - np.asarray(want_h))) <= 2e-6 * scale
    np.testing.assert_allclose(np.asarray(d), np.asarray(want_d), rtol=2e-6)
    assert np.max(np.abs(np.asarray(q, np.int32) - np.asarray(want_q, np.int32))) <= 1  # a half-way value may move
    ref = _numpy_swiglu(routed.gate, routed.up, 10.0)
    back = np.asarray(q, np.float32)
    if routed_mode == "int8-crumbs":  # undo the permutation: value 4t + u of a block sits at 64u + t
        back = back.reshape(6, F // 256, 4, 64).swapaxes(2, 3).reshape(6, F)
    values = back.reshape(6, F // 32, 32) * np.asarray(d)[..., None]
    assert np.max(np.abs(values.reshape(6, F) - ref)) <= np.max(np.asarray(d)) * 0.5 * (1 + 1e-5)


@pytest.mark.gpu
def test_the_compiled_ffn_paths_agree_on_the_gpu():
    rng = np.random.default_rng(14)
    routed, shared = _ffn(rng, E=8, F=2304, D=1024)
    x = jnp.asarray(rng.standard_normal(1024) * 3, jnp.float32)
    idx, weight = jnp.asarray([2, 7, 1, 5], jnp.int32), jnp.asarray([0.4, 0.3, 0.2, 0.1], jnp.float32)
    together = jax.jit(lambda x: moe.routed_and_shared(x, routed, idx, weight, 7.0, shared, 10.0))(x)
    apart = jax.jit(lambda x: moe.routed_experts(x, *routed, idx, weight, 7.0) + moe.shared_expert(x, *shared, 10.0))(x)
    _equal(together, apart)
