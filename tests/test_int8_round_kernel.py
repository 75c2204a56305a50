"""The "int8" rounding as one Triton kernel (jds41/quant/int8_round_kernel.py), where the int8 products run on CUDA.

On every machine: the kernel in Pallas' interpreter against `round_int8` (the reference) bit for bit, on rows with zero
blocks, exact halves (ties to even), a value at the block maximum and the widths V4.1's products read, in value order
and in Q2_K's crumb-major order (`_crumb_major` of the reference); an int8 product through it equals the one through
XLA's rounding, bit for bit; lowered for CUDA, an int8 product rounds with the kernel where it is on (the default),
and with XLA's spelling under JDS41_INT8_ROUND_KERNEL=0. On a GPU (marker `gpu`): the compiled kernel against
`round_int8` compiled by XLA for the GPU, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.quant import QTensor, int8_round_kernel, qmatvec_experts, triton_matvec
from jds41.quant.int8_act import round_int8
from jds41.quant.int8_round_kernel import round_int8_rows
from jds41.quant.planar import to_planar
from jds41.quant.random_blocks import random_quantized
from jds41.quant.triton_matvec import _crumb_major

SHAPES = [(1, 5120), (6, 2304), (8, 4096), (1, 1280), (1, 8192), (3, 96)]  # V4.1's, and a row of 3 blocks


def _activation(X: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.choice([1e-3, 1.0, 40.0], (X, n // 32, 1))  # blocks of very different sizes
    x = (rng.standard_normal((X, n // 32, 32)) * scale).reshape(X, n).astype(np.float32)
    x[0, :32] = 0  # a zero block: q = 0, d = 0
    x[-1, 32:64] = np.concatenate([[127], np.arange(31) - 14.5])  # amax 127, so x * inv = x: halves, ties to even
    return x


@pytest.mark.parametrize("X,n", SHAPES)
def test_the_interpreted_kernel_rounds_as_the_reference(X, n):
    x = jnp.asarray(_activation(X, n, seed=n + X))
    want_q, want_d = jax.jit(round_int8)(x)
    q, d = round_int8_rows(x, interpret=True)
    assert q.dtype == jnp.int8 and q.shape == (X, n) and d.shape == (X, n // 32)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(d), np.asarray(want_d))
    assert np.abs(np.asarray(q)).max() == 127 and (np.asarray(q)[0, :32] == 0).all() and np.asarray(d)[0, 0] == 0
    if n % 256 == 0:
        qc, dc = round_int8_rows(x, crumb_major=True, interpret=True)
        np.testing.assert_array_equal(np.asarray(qc), np.asarray(_crumb_major(want_q)))
        np.testing.assert_array_equal(np.asarray(dc), np.asarray(want_d))


def test_the_scales_are_the_block_maxima_times_the_f32_reciprocal_of_127():
    """numpy's own block maxima times f32(1/127), bit for bit, from the reference and the kernel: the product XLA
    compiles a division by 127 into on every platform, which the GPU kernel's first run missed by dividing (the two
    differ in ~5% of values)."""
    x = _activation(4, 8192, seed=11)
    amax = np.abs(x.reshape(4, -1, 32)).max(axis=2)
    want = amax * np.float32(1 / 127)
    assert (want != amax / np.float32(127)).any()  # the two spellings differ on these values
    np.testing.assert_array_equal(np.asarray(jax.jit(round_int8)(jnp.asarray(x))[1]), want)
    np.testing.assert_array_equal(np.asarray(round_int8_rows(jnp.asarray(x), interpret=True)[1]), want)


def test_ties_round_to_even():
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [127, 0.5, 1.5, 2.5, -0.5, -2.5]  # amax 127, so inv = 1 and x * inv = x
    q, _ = round_int8_rows(jnp.asarray(x), interpret=True)
    assert np.asarray(q)[0, :6].tolist() == [127, 0, 2, 2, 0, -2]


def test_a_row_width_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        round_int8_rows(jnp.zeros((1, 48)), interpret=True)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        round_int8_rows(jnp.zeros((1, 96)), crumb_major=True, interpret=True)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.IQ2_XXS, T.Q8_0])
def test_an_int8_product_through_the_kernel_equals_the_one_through_xla_rounding(monkeypatch, qtype):
    """The product's path on CUDA, interpreted: the rounding kernel (Q2_K's q in its kernel's order) then the dp4a
    kernel (the default), against the same dp4a kernel fed by XLA's rounding (JDS41_INT8_ROUND_KERNEL=0)."""
    from jds41.quant import int8_act, qtensor

    rng = np.random.default_rng(11)
    raw = random_quantized(rng, qtype, (4, 32, 512))
    w = QTensor.from_raw(raw, qtype, (4, 32, 512), act_round="int8").with_layout(to_planar(raw, qtype), "planar")
    monkeypatch.setattr(qtensor, "INT8_TYPES", int8_act.PRODUCT_TYPES)
    monkeypatch.setattr(triton_matvec, "INTERPRET", True)
    idx = jnp.asarray([3, 0, 2], jnp.int32)
    monkeypatch.setattr(int8_round_kernel, "ENABLED", True)
    for x in (jnp.asarray(_activation(1, 512, seed=1)[0]), jnp.asarray(_activation(3, 512, seed=2))):
        got = np.asarray(qmatvec_experts(x, w, idx))
        monkeypatch.setattr(int8_round_kernel, "ENABLED", False)
        want = np.asarray(qmatvec_experts(x, w, idx))
        monkeypatch.setattr(int8_round_kernel, "ENABLED", True)
        np.testing.assert_array_equal(got, want)


def test_int8_products_round_with_the_kernel_on_cuda_where_switched_on(monkeypatch):
    rng = np.random.default_rng(4)
    raw = random_quantized(rng, T.IQ2_XXS, (8, 32, 512))
    w = QTensor.from_raw(raw, T.IQ2_XXS, (8, 32, 512), act_round="int8")
    x, idx = jnp.ones(512, jnp.float32), jnp.arange(3, dtype=jnp.int32)

    def lowered(platform):
        traced = jax.jit(lambda x, i: qmatvec_experts(x, w, i)).trace(x, idx)
        return traced.lower(lowering_platforms=(platform,)).as_text()

    assert triton_matvec.has_triton_backend()  # the pinned jax has it
    monkeypatch.setattr(int8_round_kernel, "ENABLED", True)
    assert "round_int8" in lowered("cuda") and "rows_matvec_int8" in lowered("cuda")
    assert "round_int8" not in lowered("cpu")
    monkeypatch.setattr(int8_round_kernel, "ENABLED", False)
    assert "round_int8" not in lowered("cuda") and "rows_matvec_int8" in lowered("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("X,n", SHAPES)
def test_the_compiled_kernel_rounds_as_xla_does_on_the_gpu(X, n):
    x = jnp.asarray(_activation(X, n, seed=3 * n + X))
    want_q, want_d = jax.jit(round_int8)(x)
    q, d = jax.jit(round_int8_rows)(x)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(d), np.asarray(want_d))
    if n % 256 == 0:
        qc, _ = jax.jit(lambda x: round_int8_rows(x, crumb_major=True))(x)
        np.testing.assert_array_equal(np.asarray(qc), np.asarray(_crumb_major(want_q)))


# Runs with JDS41_TRITON=interpret (read at import, hence a subprocess); argv: model, output .npy. Counts the
# rounding kernel's calls while the engine traces, and saves the logits of a prompt pass and of 6 greedy steps.
_ENGINE_RUN = r"""
import json, sys
import numpy as np
from jds41.engine import Engine, SamplingParams
from jds41.quant import int8_round_kernel, triton_matvec

calls = []
traced = int8_round_kernel.round_int8_rows
def counted(*args, **kwargs):
    calls.append(1)
    return traced(*args, **kwargs)
int8_round_kernel.round_int8_rows = counted
eng = Engine.open(sys.argv[1], max_ctx=48, numerics="int8")
toks = [int(t) for t in np.random.default_rng(5).integers(8, 400, 12)]
s = eng.session()
prompt_logits = s.feed(toks, all_logits=True)
gen = list(eng.session().generate(toks, 6, SamplingParams()))
np.save(sys.argv[2], prompt_logits)
print(json.dumps({"interpret": triton_matvec.INTERPRET, "enabled": int8_round_kernel.ENABLED,
                  "kernel_calls": len(calls), "generated": gen}))
"""


@pytest.mark.slow
def test_an_interpreted_int8_engine_gives_the_same_bits_with_and_without_the_rounding_kernel(tmp_path):
    """The default's promise at the engine level: on the CUDA path (here Pallas' interpreter), the two-bit products
    fed by the rounding kernel give the logits and greedy tokens of the same products fed by XLA's rounding."""
    import json
    import os
    import subprocess
    import sys

    from two_bit_model import two_bit_model

    model = two_bit_model(tmp_path)
    runs = {}
    for switch in ("1", "0"):
        # the rounding kernel alone rounds: the hidden launch and the sublayer input's blocks (the defaults since the
        # forty-fifth session) round with its code in launches of their own
        env = {**os.environ, "JDS41_TRITON": "interpret", "JDS41_INT8_ROUND_KERNEL": switch,
               "JDS41_SWIGLU_KERNEL": "0", "JDS41_MHC_ROUND": "0"}
        out = tmp_path / f"logits{switch}.npy"
        done = subprocess.run([sys.executable, "-c", _ENGINE_RUN, model, str(out)], env=env, capture_output=True,
                              text=True, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[switch] = (json.loads(done.stdout.strip().splitlines()[-1]), np.load(out))
    (on, on_logits), (off, off_logits) = runs["1"], runs["0"]
    assert on["interpret"] and off["interpret"]
    assert on["enabled"] and on["kernel_calls"] > 0  # the kernel really rounded (traced into the products)
    assert not off["enabled"] and off["kernel_calls"] == 0
    np.testing.assert_array_equal(on_logits, off_logits)
    assert on["generated"] == off["generated"]
