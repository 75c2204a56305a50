"""Products of different formats, shapes and inputs as one kernel launch (quant/co_launch.py): the routed experts'
and the shared expert's gate/up products in one launch, their down products in another.

On every machine, in Pallas' interpreter: the launch order holds every program of every job once, each job's in
its own order and spread over the launch; a co-launch gives each job the bits of its own launch (the int8 two-bit
kinds beside f32 Q8_0 and MXFP4, shared and per-expert x, row splits); jobs of different warp counts are refused;
`products` gives the separate calls' bits and falls back to them where one launch cannot hold the requests;
`moe.routed_and_shared` gives `routed_experts + shared_expert`'s bits with the switch on, and
`model.attention_products` (an attention sublayer's products of its input) the separate `qmatvec`s' bits;
JDS41_TILES' spelling; lowered for CUDA, the requests are one Triton call with the switch on and two with it off,
and a V4 layer's attention products one call. On a GPU (marker `gpu`): the compiled co-launch at V4.1's shapes,
bit for bit against separate launches (2 passed on an H100 at 47db046, results/co_launch_gpu_tests40_h100.txt),
and at V4-Flash's (its MXFP4 gate/up beside the shared expert's; a CSA layer's seven attention products). The
engine's invariances with it on run in tests/test_triton_engine.py ("co_launch", "int8", "mhc_v4").
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41 import model
from jds41.layers import moe
from jds41.layers.compressor import CompressorSpec
from jds41.quant import QTensor, co_launch, qmatvec, qmatvec_experts_parts, qmatvec_parts, triton_int8, triton_matvec
from jds41.quant.int8_act import round_int8
from jds41.quant.planar import to_planar
from jds41.quant.random_blocks import random_quantized

TRITON_CALL = "__gpu$xla.gpu.triton"


def _rows(rng, qtype, shape, layout="planar"):
    raw = random_quantized(rng, qtype, shape)
    return raw, jnp.asarray(to_planar(raw, qtype) if layout == "planar" else raw)


def _equal(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want) and got
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("counts", [(6, 1), (8640, 1440), (5760, 1280), (3, 5, 2), (1, 1)])
def test_the_order_holds_every_program_once_spread_over_the_launch(counts):
    job, local = co_launch.order(counts)
    assert len(job) == sum(counts)
    for i, n in enumerate(counts):
        np.testing.assert_array_equal(local[job == i], np.arange(n))  # each job's programs once, in order
        at = np.flatnonzero(job == i) / len(job)
        # spread: program p of job i sits within one program of the fraction (p + 1/2) / n of the launch
        assert np.max(np.abs(at - (np.arange(n) + 0.5) / n)) <= (len(counts) + 1) / len(job) + 1e-12


def _gate_up_jobs(rng, K=3, E=5, F=32, D=512):
    """V4.1's gate/up pair in small: IQ2_XXS int8 routed stacks (x shared) and Q8_0 f32 shared expert rows."""
    (_, g), (_, u) = _rows(rng, T.IQ2_XXS, (E, F, D)), _rows(rng, T.IQ2_XXS, (E, F, D))
    (_, gs), (_, us) = _rows(rng, T.Q8_0, (1, F, D)), _rows(rng, T.Q8_0, (1, F, D))
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.float32)
    q, d = round_int8(x)
    idx = jnp.asarray(rng.integers(0, E, K), jnp.int32)
    return (triton_int8.int8_job(q, d, (g, u), idx, T.IQ2_XXS, "planar", interpret=True),
            triton_matvec.matvec_job(x, (gs, us), jnp.zeros(1, jnp.int32), T.Q8_0, "planar"))


def _down_jobs(rng, K=3, E=5, F=512, D=32, splits=3):
    """The down pair in small: Q2_K int8 routed rows (an x a row, split in three) and Q8_0 f32 shared rows."""
    (_, w), (_, ws) = _rows(rng, T.Q2_K, (E, D, F)), _rows(rng, T.Q8_0, (1, D, F))
    h = jnp.asarray(rng.standard_normal((K, F)), jnp.float32)
    q, d = round_int8(h)
    idx = jnp.asarray(rng.integers(0, E, K), jnp.int32)
    return (triton_int8.int8_job(q, d, w, idx, T.Q2_K, "planar", interpret=True, tile=(8, 1, 4, 2)),
            triton_matvec.matvec_job(jnp.asarray(rng.standard_normal((1, F)), jnp.float32), ws,
                                     jnp.zeros(1, jnp.int32), T.Q8_0, "planar"))


def _mxfp4_job(rng, K=2, E=4, n_out=16, n_in=256):
    raw = jnp.asarray(random_quantized(rng, T.MXFP4, (E, n_out, n_in)))
    x = jnp.asarray(rng.standard_normal((1, n_in)), jnp.float32)
    return triton_matvec.matvec_job(x, raw, jnp.asarray(rng.integers(0, E, K), jnp.int32), T.MXFP4, "ggml")


@pytest.mark.parametrize("which", ["gate_up", "down", "three"])
def test_a_co_launch_gives_each_job_the_bits_of_its_own_launch(which):
    rng = np.random.default_rng({"gate_up": 1, "down": 2, "three": 3}[which])
    if which == "gate_up":
        jobs = _gate_up_jobs(rng)
    elif which == "down":
        jobs = _down_jobs(rng)
    else:
        jobs = (*_down_jobs(rng), _mxfp4_job(rng))
    got = co_launch.co_launch(jobs, interpret=True)
    _equal(got, tuple(triton_matvec.launch(job, interpret=True) for job in jobs))
    for job, y in zip(jobs, got, strict=True):  # and the results have each launch's structure
        assert isinstance(y, tuple) == (not job.one_stack)


def test_jobs_of_different_warp_counts_are_refused():
    a, b = _gate_up_jobs(np.random.default_rng(4))
    b = b.__class__(**{**b.__dict__, "tile": (*b.tile[:2], 8, b.tile[3])})
    with pytest.raises(ValueError, match="warp counts"):
        co_launch.co_launch((a, b), interpret=True)


def _layer(rng, act_round="int8", E=5, F=32, D=512, shared_qtype=T.Q8_0):
    """A small V4.1-like FFN: IQ2_XXS gate/up and Q2_K down experts (int8 numerics), Q8_0 shared expert, planar."""
    def qt(qtype, shape):
        raw, rows = _rows(rng, qtype, shape)
        return QTensor.from_raw(raw, qtype, shape, act_round).with_layout(rows, "planar")

    routed = (qt(T.IQ2_XXS, (E, F, D)), qt(T.IQ2_XXS, (E, F, D)), qt(T.Q2_K, (E, D, F)))
    shared = (qt(shared_qtype, (F, D)), qt(shared_qtype, (F, D)), qt(shared_qtype, (D, F)))
    return routed, shared


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(triton_matvec, "INTERPRET", True)
    monkeypatch.setattr(co_launch, "ENABLED", True)


def test_products_give_the_separate_calls_bits(interpreted):
    rng = np.random.default_rng(5)
    (gate, up, _), (gs, us, _) = _layer(rng, F=256)
    x = jnp.asarray(rng.standard_normal(512), jnp.float32)
    idx = jnp.asarray([4, 0, 2], jnp.int32)
    requests = (co_launch.Experts(x, (gate, up), idx), co_launch.Dense(x, (gs, us)))
    assert co_launch._one_launch(requests)
    _equal(co_launch.products(requests), (qmatvec_experts_parts(x, (gate, up), idx), qmatvec_parts(x, (gs, us))))


def test_joint_products_are_each_requests_products_side_by_side(interpreted, monkeypatch):
    rng = np.random.default_rng(16)
    (gate, up, _), (gs, us, _) = _layer(rng, F=256)
    x = jnp.asarray(rng.standard_normal(512), jnp.float32)
    idx = jnp.asarray([4, 0, 2], jnp.int32)
    requests = (co_launch.Experts(x, (gate, up), idx), co_launch.Dense(x, (gs, us)))
    want = tuple(jnp.concatenate(y, axis=-1) for y in co_launch.products(requests))
    assert [w.shape for w in want] == [(3, 512), (512,)]
    _equal(co_launch.products(requests, joint=True), want)
    monkeypatch.setattr(co_launch, "ENABLED", False)  # the separate calls' fallback joins them too
    _equal(co_launch.products(requests, joint=True), want)


def test_products_fall_back_to_separate_calls_where_one_launch_cannot_hold_them(interpreted, monkeypatch):
    rng = np.random.default_rng(6)
    (gate, up, _), (gs, us, _) = _layer(rng, F=256)
    x, idx = jnp.asarray(rng.standard_normal(512), jnp.float32), jnp.asarray([1, 3], jnp.int32)
    mixed = QTensor.from_raw(random_quantized(rng, T.MXFP4, (5, 256, 512)), T.MXFP4, (5, 256, 512), "int8")
    cases = [(co_launch.Experts(x, (gate, mixed), idx), co_launch.Dense(x, (gs,))),  # the routed pair cannot share
             (co_launch.Dense(x, (gs, us)),)]  # one request: nothing to put beside it
    for requests in cases:
        assert not co_launch._one_launch(requests)
        _equal(co_launch.products(requests), tuple(co_launch._separately(r) for r in requests))
    requests = (co_launch.Experts(x, (gate, up), idx), co_launch.Dense(x, (gs, us)))
    monkeypatch.setattr(co_launch, "ENABLED", False)  # JDS41_CO_LAUNCH=0
    assert not co_launch._one_launch(requests)


@pytest.mark.parametrize("limits", [(0.0, 0.0), (7.0, 10.0)])
def test_routed_and_shared_gives_the_separate_functions_bits(interpreted, limits):
    rng = np.random.default_rng(7)
    routed, shared = _layer(rng, F=256)
    x = jnp.asarray(rng.standard_normal(512) * 3, jnp.float32)
    idx, weight = jnp.asarray([2, 4, 1], jnp.int32), jnp.asarray([0.5, 0.3, 0.2], jnp.float32)
    run = jax.jit(lambda x: moe.routed_and_shared(x, routed, idx, weight, limits[0], shared, limits[1]))
    want = jax.jit(lambda x: moe.routed_experts(x, *routed, idx, weight, limits[0])
                   + moe.shared_expert(x, *shared, limits[1]))(x)
    _equal(run(x), want)
    assert str(jax.make_jaxpr(run)(x)).count("co_int8_") == 2  # gate/up and down: two co-launches
    _equal(jax.jit(lambda x: moe.routed_and_shared(x, routed, idx, weight, limits[0], None, None))(x),
           jax.jit(lambda x: moe.routed_experts(x, *routed, idx, weight, limits[0]))(x))


def _rounding_calls_for_cuda(monkeypatch, run, x):
    """With the kernels lowered for CUDA from here on: blocks -> the rounding launches of run(x, x's blocks if
    `blocks` else None), counted as calls of the jitted rounding function (defined once in the text)."""
    from jds41.quant import int8_round_kernel

    monkeypatch.setattr(triton_matvec, "INTERPRET", False)
    monkeypatch.setattr(triton_matvec, "has_triton_backend", lambda: True)
    monkeypatch.setattr(triton_matvec, "_BACKEND", True)
    monkeypatch.setattr(int8_round_kernel, "ENABLED", True)

    def rounds(blocks: bool) -> int:
        fn = (lambda x: run(x, round_int8(x))) if blocks else (lambda x: run(x, None))
        return jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text().count("call @round_int8_rows(")

    return rounds


def test_routed_and_shared_with_xs_blocks_given_gives_the_same_bits_without_rounding_again(interpreted, monkeypatch):
    """x's int8 blocks handed in (as the sublayer input's launch writes them, model.rounds_ffn_input) replace the
    gate/up launch's own rounding of x: the same bits, and lowered for CUDA one rounding launch fewer; with the
    shared expert's Q8_0 rounding too (JDS41_INT8_Q8_0=1) it reads them as well: no rounding launch at all."""
    from jds41.quant import int8_act, qtensor

    rng = np.random.default_rng(15)
    routed, shared = _layer(rng, F=256)
    x = jnp.asarray(rng.standard_normal(512) * 3, jnp.float32)
    idx, weight = jnp.asarray([2, 4, 1], jnp.int32), jnp.asarray([0.5, 0.3, 0.2], jnp.float32)
    run = lambda x, blocks: moe.routed_and_shared(x, routed, idx, weight, 7.0, shared, 10.0, x_blocks=blocks)  # noqa
    f32_shared = jax.jit(lambda x: run(x, round_int8(x)))(x)
    _equal(f32_shared, jax.jit(lambda x: run(x, None))(x))
    rounds = _rounding_calls_for_cuda(monkeypatch, run, x)
    assert (rounds(True), rounds(False)) == (0, 1)  # the down products' rounding is the hidden launch's
    monkeypatch.setattr(qtensor, "INT8_TYPES", int8_act.PRODUCT_TYPES)
    assert (rounds(True), rounds(False)) == (0, 2)  # the routed and the shared gate/up's
    monkeypatch.setattr(triton_matvec, "INTERPRET", True)
    q8 = jax.jit(lambda x: run(x, round_int8(x)))(x)
    _equal(q8, jax.jit(lambda x: run(x, None))(x))
    assert not np.array_equal(np.asarray(q8), np.asarray(f32_shared))  # the shared expert's products did read int8


# A V4 CSA layer's products of its attention input (W_qa, W_kv, the compressor's and the indexer compressor's
# W_kv and W_gate, the indexer's W_proj), Q8_0 planar, at [n_out] x D
_V4_ATTENTION = {"attn_q_a": 64, "attn_kv": 32, "attn_compressor_kv": 64, "attn_compressor_gate": 64,
                 "indexer_compressor_kv": 32, "indexer_compressor_gate": 32, "indexer.proj": 16}


def _v4_attention_layer(rng, D=512, scale=1, act_round=None):
    """(lp, w): the plan fields `model.attention_products` reads and the seven weights, `scale` x their rows
    (`act_round`: their activation rounding, QTensor.act_round)."""
    def qt(n_out):
        shape = (n_out * scale, D)
        raw, rows = _rows(rng, T.Q8_0, shape)
        return QTensor.from_raw(raw, T.Q8_0, shape, act_round=act_round).with_layout(rows, "planar")

    spec = lambda width: CompressorSpec(4, width, True, True, True, 8)  # noqa: E731  (ratio 4, overlapped)
    lp = SimpleNamespace(cmp=spec(32 * scale), idx_cmp=spec(16 * scale), runs_indexer=True)
    return lp, {name: qt(n) for name, n in _V4_ATTENTION.items()}


def test_attention_products_give_the_separate_products_bits(interpreted):
    rng = np.random.default_rng(10)
    lp, w = _v4_attention_layer(rng)
    h = jnp.asarray(rng.standard_normal(512), jnp.float32)
    made = jax.jit(lambda h: model.attention_products(lp, w, h))(h)
    assert sorted(made) == sorted(_V4_ATTENTION)
    _equal([made[n] for n in sorted(made)], [jax.jit(lambda h, n=n: qmatvec(h, w[n]))(h) for n in sorted(made)])
    assert str(jax.make_jaxpr(lambda h: model.attention_products(lp, w, h))(h)).count("pallas_call") == 1
    hca = SimpleNamespace(cmp=CompressorSpec(128, 32, False, True, False, 8), idx_cmp=None, runs_indexer=False)
    assert sorted(model.attention_products(hca, w, h)) == ["attn_compressor_gate", "attn_compressor_kv",
                                                          "attn_kv", "attn_q_a"]


def test_attention_products_with_hs_blocks_given_give_the_same_bits_without_rounding_again(interpreted, monkeypatch):
    """Under the int8 numerics with the Q8_0 products rounding too (JDS41_INT8_Q8_0=1), h's int8 blocks handed in
    (as the sublayer input's launch writes them, model.rounds_attention_input) replace the shared launch's own
    roundings of h: the same bits, and lowered for CUDA no rounding launch where there were five. Without Q8_0
    among the rounded formats the blocks are not read: the products are the f32 ones."""
    from jds41.quant import int8_act, qtensor

    rng = np.random.default_rng(16)
    lp, w = _v4_attention_layer(rng, act_round="int8")
    h = jnp.asarray(rng.standard_normal(512) * 2, jnp.float32)
    run = lambda h, blocks: model.attention_products(lp, w, h, blocks)  # noqa: E731
    f32 = jax.jit(lambda h: run(h, None))(h)
    monkeypatch.setattr(qtensor, "INT8_TYPES", int8_act.PRODUCT_TYPES)
    given = jax.jit(lambda h: run(h, round_int8(h)))(h)
    rounded = jax.jit(lambda h: run(h, None))(h)
    _equal([given[n] for n in sorted(given)], [rounded[n] for n in sorted(rounded)])
    assert all(not np.array_equal(np.asarray(rounded[n]), np.asarray(f32[n])) for n in rounded)  # int8 really read
    # model.step hands them in where the sublayer input's launch can write them and W_qa reads int8 blocks
    plan = SimpleNamespace(cfg=SimpleNamespace(hc_mult=4, dim=512, hc_mix=24, hc_lag=False))
    assert model.rounds_attention_input(plan, w)
    monkeypatch.setattr(qtensor, "INT8_TYPES", int8_act.PRODUCT_TYPES - {T.Q8_0})  # the default: Q8_0 reads f32
    assert not model.rounds_attention_input(plan, w)
    monkeypatch.setattr(qtensor, "INT8_TYPES", int8_act.PRODUCT_TYPES)
    assert not model.rounds_attention_input(SimpleNamespace(cfg=SimpleNamespace(hc_mult=4, dim=528, hc_mix=24,
                                                                                hc_lag=False)), w)
    monkeypatch.setattr(co_launch, "ATTENTION", False)
    assert not model.rounds_attention_input(plan, w)
    monkeypatch.setattr(co_launch, "ATTENTION", True)
    rounds = _rounding_calls_for_cuda(monkeypatch, run, h)
    assert (rounds(True), rounds(False)) == (0, 5)  # one a request (W_qa, W_kv, two compressors, W_proj) without


def test_lowered_for_cuda_the_requests_are_one_triton_call_with_the_switch_on(monkeypatch):
    from jds41.quant import int8_round_kernel

    monkeypatch.setattr(triton_matvec, "INTERPRET", False)
    monkeypatch.setattr(triton_matvec, "ENABLED", True)
    monkeypatch.setattr(triton_matvec, "has_triton_backend", lambda: True)
    monkeypatch.setattr(triton_matvec, "_BACKEND", True)
    monkeypatch.setattr(int8_round_kernel, "ENABLED", True)
    rng = np.random.default_rng(8)
    (gate, up, _), (gs, us, _) = _layer(rng, F=256)
    x, idx = jnp.ones(512, jnp.float32), jnp.arange(3, dtype=jnp.int32)

    def lowered():
        fn = lambda x, i: co_launch.products((co_launch.Experts(x, (gate, up), i), co_launch.Dense(x, (gs, us))))  # noqa
        return jax.jit(fn).trace(x, idx).lower(lowering_platforms=("cuda",)).as_text()

    monkeypatch.setattr(co_launch, "ENABLED", True)
    on = lowered()
    assert 'name = "co_int8_iq2_xxs_planar_q8_0_planar"' in on and "call @rows_matvec" not in on
    monkeypatch.setattr(co_launch, "ENABLED", False)
    off = lowered()
    assert "co_int8" not in off and off.count("call @rows_matvec") == 2  # the routed int8 and the shared f32 launch
    lp, w = _v4_attention_layer(rng)
    monkeypatch.setattr(co_launch, "ENABLED", True)
    v4 = jax.jit(lambda h: model.attention_products(lp, w, h)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert v4.count("__gpu$xla.gpu.triton") == 1 and 'name = "co_q8_0_planar_q8_0_planar' in v4


# V4.1's shapes: the routed gate/up (IQ2_XXS int8, 6 of 8 experts, x shared) with the shared expert's (Q8_0 f32),
# and the routed down (Q2_K int8, an x an expert) with the shared expert's down (Q8_0 f32); V4-Flash's gate/up
# (MXFP4 f32 beside Q8_0 f32, [2048, 4096]; passed on an H100 in the forty-second session); a V4-Flash CSA
# layer's seven products of its attention input (Q8_0, [1024 .. 64, 4096]: `model.attention_products`)
@pytest.mark.gpu
@pytest.mark.parametrize("pair", ["gate_up", "down", "v4_gate_up", "v4_attention"])
def test_the_compiled_co_launch_gives_each_job_its_own_bits_on_the_gpu(pair):
    rng = np.random.default_rng(9)
    if pair == "v4_attention":
        lp, w = _v4_attention_layer(rng, D=4096, scale=16)
        h = jnp.asarray(rng.standard_normal(4096), jnp.float32)
        together = jax.jit(lambda h: model.attention_products(lp, w, h))(h)
        alone = {n: jax.jit(lambda h, n=n: qmatvec(h, w[n]))(h) for n in together}
        assert sorted(together) == sorted(_V4_ATTENTION)
        _equal([together[n] for n in sorted(together)], [alone[n] for n in sorted(together)])
        return
    if pair == "v4_gate_up":
        (_, g), (_, u) = _rows(rng, T.MXFP4, (8, 2048, 4096)), _rows(rng, T.MXFP4, (8, 2048, 4096))
        (_, gs), (_, us) = _rows(rng, T.Q8_0, (1, 2048, 4096)), _rows(rng, T.Q8_0, (1, 2048, 4096))
        x = jnp.asarray(rng.standard_normal((1, 4096)), jnp.float32)
        idx = jnp.asarray(rng.integers(0, 8, 6), jnp.int32)
        jobs = lambda: (triton_matvec.matvec_job(x, (g, u), idx, T.MXFP4, "planar"),  # noqa: E731
                        triton_matvec.matvec_job(x, (gs, us), jnp.zeros(1, jnp.int32), T.Q8_0, "planar"))
    elif pair == "gate_up":
        (_, g), (_, u) = _rows(rng, T.IQ2_XXS, (8, 2304, 5120)), _rows(rng, T.IQ2_XXS, (8, 2304, 5120))
        (_, gs), (_, us) = _rows(rng, T.Q8_0, (1, 2304, 5120)), _rows(rng, T.Q8_0, (1, 2304, 5120))
        x = jnp.asarray(rng.standard_normal((1, 5120)), jnp.float32)
        q, d = round_int8(x)
        idx = jnp.asarray(rng.integers(0, 8, 6), jnp.int32)
        # the shared gate/up at its measured tile of 4 warps: a co-launch has one warp count
        jobs = lambda: (triton_int8.int8_job(q, d, (g, u), idx, T.IQ2_XXS, "planar"),  # noqa: E731
                        triton_matvec.matvec_job(x, (gs, us), jnp.zeros(1, jnp.int32), T.Q8_0, "planar"))
    else:
        (_, w), (_, ws) = _rows(rng, T.Q2_K, (8, 5120, 2304)), _rows(rng, T.Q8_0, (1, 5120, 2304))
        h = jnp.asarray(rng.standard_normal((6, 2304)), jnp.float32)
        q, d = round_int8(h)
        idx = jnp.asarray(rng.integers(0, 8, 6), jnp.int32)
        xs = jnp.asarray(rng.standard_normal((1, 2304)), jnp.float32)
        jobs = lambda: (triton_int8.int8_job(q, d, w, idx, T.Q2_K, "planar"),  # noqa: E731
                        triton_matvec.matvec_job(xs, ws, jnp.zeros(1, jnp.int32), T.Q8_0, "planar"))
    together = jax.jit(lambda: co_launch.co_launch(jobs(), interpret=False))()
    alone = jax.jit(lambda: tuple(triton_matvec.launch(job, interpret=False) for job in jobs()))()
    _equal(together, alone)


def test_jds41_tiles_spells_measured_tiles_and_refuses_what_it_cannot_read():
    assert triton_matvec._tiles_from("Q8_0:1:2304:5120=16,8,4,5;IQ2_XXS:6:2304:5120=16,2,4,5") == {
        (T.Q8_0, 1, 2304, 5120): (16, 8, 4, 5), (T.IQ2_XXS, 6, 2304, 5120): (16, 2, 4, 5)}
    assert triton_matvec._tiles_from("") == {}
    for bad in ("Q8_0:1:2304=16,8,4,5", "Q8_0:1:2304:5120=16,8,4", "Q8_0:1:2304:5120=16,8,0,5", "F16:1:2:3=1,1,1,1"):
        with pytest.raises(ValueError, match="JDS41_TILES"):
            triton_matvec._tiles_from(bad)

