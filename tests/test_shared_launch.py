"""Several products of one x as one kernel launch (triton_matvec.launch with a tuple of stacks; qtensor's
`qmatvec_parts` and `qmatvec_experts_parts`): the gate and up products of a layer's experts and shared expert.

On every machine, in Pallas' interpreter: the f32 kernel for every format and layout it takes, and the int8 kernel for
each of its kinds, give each stack of a shared launch the bits of its own launch (shared and per-expert x, the rule's
tile and a row split); the qtensor entries give the separate calls' bits through the kernel path and keep them when the
stacks cannot share (another format); lowered for CUDA, a layer's gate and up are one Triton call (the default), and
two when they cannot share or it is switched off (JDS41_SHARED_LAUNCH=0). On a GPU (marker `gpu`): the
compiled shared launch at V4.1's routed gate/up (int8) and shared-expert gate/up (f32) shapes, bit for bit against one
launch per stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.quant import QTensor, qmatvec, qmatvec_experts, qmatvec_experts_parts, qmatvec_parts, triton_matvec
from jds41.quant.int8_act import round_int8
from jds41.quant.planar import to_planar
from jds41.quant.random_blocks import random_quantized
from jds41.quant.triton_int8 import KINDS as INT8_KINDS
from jds41.quant.triton_int8 import rows_matvec_int8
from jds41.quant.triton_matvec import KINDS, rows_matvec

TRITON_CALL = "__gpu$xla.gpu.triton"


def _stacks(qtype, layout, shape, seed):
    rng = np.random.default_rng(seed)
    raws = [random_quantized(rng, qtype, shape) for _ in range(2)]
    rows = [jnp.asarray(to_planar(r, qtype) if layout == "planar" else r) for r in raws]
    return rng, raws, rows


def _equal_each(got, want):
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("qtype,layout", sorted(KINDS, key=lambda k: (k[0].name, k[1])))
def test_a_shared_f32_launch_gives_each_stack_its_own_bits(qtype, layout):
    rng, _, rows = _stacks(qtype, layout, (5, 16, 1024), seed=1)
    idx = jnp.asarray([4, 0, 2], jnp.int32)
    for X in (1, 3):
        x = jnp.asarray(rng.standard_normal((X, 1024)), jnp.float32)
        for tile in (None, (8, 1, 4, 4)):  # the rule's, and a row split in four
            got = rows_matvec(x, tuple(rows), idx, qtype, layout=layout, interpret=True, tile=tile)
            _equal_each(got, [rows_matvec(x, r, idx, qtype, layout=layout, interpret=True, tile=tile) for r in rows])


@pytest.mark.parametrize("qtype,layout", sorted(INT8_KINDS, key=lambda k: (k[0].name, k[1])))
def test_a_shared_int8_launch_gives_each_stack_its_own_bits(qtype, layout):
    rng, _, rows = _stacks(qtype, layout, (5, 16, 1024), seed=2)
    idx = jnp.asarray([1, 3, 0], jnp.int32)
    q, d = round_int8(jnp.asarray(rng.standard_normal((1, 1024)), jnp.float32))
    got = rows_matvec_int8(q, d, tuple(rows), idx, qtype, layout, interpret=True)
    _equal_each(got, [rows_matvec_int8(q, d, r, idx, qtype, layout, interpret=True) for r in rows])


@pytest.mark.parametrize("act_round", [None, "int8"])
def test_the_parts_entries_give_the_separate_calls_bits(monkeypatch, act_round):
    from jds41.quant import qtensor

    monkeypatch.setattr(triton_matvec, "INTERPRET", True)
    monkeypatch.setattr(qtensor, "_SHARED_LAUNCH", True)
    rng, raws, rows = _stacks(T.IQ2_XXS, "planar", (6, 32, 512), seed=3)
    gate, up = (QTensor.from_raw(r, T.IQ2_XXS, (6, 32, 512), act_round).with_layout(p, "planar")
                for r, p in zip(raws, rows, strict=True))
    x, idx = jnp.asarray(rng.standard_normal(512), jnp.float32), jnp.asarray([5, 1, 2], jnp.int32)
    _equal_each(qmatvec_experts_parts(x, (gate, up), idx), [qmatvec_experts(x, w, idx) for w in (gate, up)])
    dense = [QTensor.from_raw(r[0], T.IQ2_XXS, (32, 512), act_round).with_layout(p[0], "planar")
             for r, p in zip(raws, rows, strict=True)]
    _equal_each(qmatvec_parts(x, tuple(dense)), [qmatvec(x, w) for w in dense])
    other = QTensor.from_raw(random_quantized(rng, T.MXFP4, (6, 32, 512)), T.MXFP4, (6, 32, 512), act_round)
    _equal_each(qmatvec_experts_parts(x, (gate, other), idx), [qmatvec_experts(x, w, idx) for w in (gate, other)])


def test_a_layers_gate_and_up_lower_to_one_triton_call_on_cuda(monkeypatch):
    from jds41.quant import int8_round_kernel, qtensor

    monkeypatch.setattr(int8_round_kernel, "ENABLED", True)
    monkeypatch.setattr(qtensor, "_SHARED_LAUNCH", True)
    rng = np.random.default_rng(4)
    stack = lambda qtype: QTensor.from_raw(random_quantized(rng, qtype, (8, 32, 512)), qtype, (8, 32, 512),  # noqa
                                           act_round="int8")
    x, idx = jnp.ones(512, jnp.float32), jnp.arange(3, dtype=jnp.int32)

    def launches(ws):
        """(product launches, rounding launches) in the lowered program: each launch is a call of its jitted
        function (a kernel's custom call is written once, in that function)."""
        traced = jax.jit(lambda x, i: qmatvec_experts_parts(x, ws, i)).trace(x, idx)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert TRITON_CALL in text
        return text.count("call @rows_matvec"), text.count("call @round_int8_rows(")

    assert launches((stack(T.IQ2_XXS),)) == (1, 1)
    assert launches((stack(T.IQ2_XXS), stack(T.IQ2_XXS))) == (1, 1)  # gate and up: one launch, x rounded once
    assert launches((stack(T.IQ2_XXS), stack(T.MXFP4)))[0] == 2  # MXFP4 reads x as is: its own f32 launch
    monkeypatch.setattr(qtensor, "_SHARED_LAUNCH", False)  # JDS41_SHARED_LAUNCH=0
    assert launches((stack(T.IQ2_XXS), stack(T.IQ2_XXS)))[0] == 2


# V4.1's routed gate/up (IQ2_XXS under int8, x shared by 6 experts) and shared-expert gate/up (Q8_0 planar, f32)
@pytest.mark.gpu
@pytest.mark.parametrize("qtype,E,n_out,n_in,int8", [(T.IQ2_XXS, 8, 2304, 5120, True), (T.Q8_0, 1, 2304, 5120, False)])
def test_the_compiled_shared_launch_gives_each_stack_its_own_bits_on_the_gpu(qtype, E, n_out, n_in, int8):
    rng, _, rows = _stacks(qtype, "planar", (E, n_out, n_in), seed=5)
    rows = [jax.device_put(r) for r in rows]
    idx = jnp.asarray(rng.integers(0, E, 6 if E > 1 else 1), jnp.int32)
    x = jnp.asarray(rng.standard_normal((1, n_in)), jnp.float32)
    if int8:
        q, d = round_int8(x)
        run = jax.jit(lambda raw: rows_matvec_int8(q, d, raw, idx, qtype, "planar"))
    else:
        run = jax.jit(lambda raw: rows_matvec(x, raw, idx, qtype, layout="planar"))
    _equal_each(run(tuple(rows)), [run(r) for r in rows])
