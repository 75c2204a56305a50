"""Triton's pipelining of the step loops (jds41/quant/loop_stages.py): the loop attribute in the lowered Triton
module (CUDA lowering runs on the CPU), a staged kernel's products bit for bit the unstaged ones' (in Pallas'
interpreter here; compiled, under the `gpu` marker), and the switch's parsing. Speed is measured in
experiments/bench_kernels.py --stages, never here."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from kernel_reference import reference_rows_matvec
from kernel_reference import rel_error as _rel

from jds41.quant import loop_stages, triton_int8
from jds41.quant import triton_matvec as tm
from jds41.quant.int8_act import round_int8, xla_int8_rows_matvec
from jds41.quant.planar import to_planar
from jds41.quant.qtensor import xla_rows_matvec
from jds41.quant.random_blocks import random_quantized
from jds41.quant.triton_int8 import rows_matvec_int8
from jds41.quant.triton_matvec import _splits_from, rows_matvec


def _stack_rows(qtype, E=3, n_out=32, n_in=1024, seed=0):
    rng = np.random.default_rng(seed)
    raw = random_quantized(rng, qtype, (E, n_out, n_in))
    return rng, raw, jnp.asarray(to_planar(raw, qtype))


def test_a_kernel_name_carries_its_stages_and_rejects_none_below_one():
    assert loop_stages.staged_name("rows_matvec_q8_0_planar", None) == "rows_matvec_q8_0_planar"
    named = loop_stages.staged_name("rows_matvec_q8_0_planar", 3)
    assert named != "rows_matvec_q8_0_planar" and loop_stages.requested_stages(named) == 3
    assert loop_stages.requested_stages("rows_matvec_q8_0_planar") is None
    with pytest.raises(ValueError, match="at least 1"):
        loop_stages.staged_name("k", 0)


def _triton_modules(monkeypatch, fn, *args) -> list[dict]:
    """What lowering `fn(*args)` for CUDA (on any host) builds, per Triton module after jds41's marking: its kernel
    name, each scf.for's `tt.num_stages` (None where unset) and the shapes of its byte loads, in order."""
    from jax._src.pallas.triton import lowering

    assert loop_stages.install() and loop_stages.active()
    marked = lowering.lower_jaxpr_to_triton_module
    seen = []

    def capture(*a, **k):
        result = marked(*a, **k)
        module = result.module
        found = {"name": str(module.operation.attributes["sym_name"]), "loops": [], "byte_loads": []}
        pending = [module.operation]
        while pending:
            op = pending.pop(0)
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        inner = inner.operation
                        if inner.name == "scf.for":
                            attrs = inner.attributes
                            found["loops"].append(int(str(attrs["tt.num_stages"]).split(":")[0])
                                                  if "tt.num_stages" in attrs else None)
                        elif inner.name == "tt.load" and "!tt.ptr<i8>" in str(inner.operands[0].type):
                            found["byte_loads"].append(re.match(r"tensor<([\dx]+)x", str(inner.operands[0].type))[1])
                        pending.append(inner)
        seen.append(found)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    jax.clear_caches()  # a cached lowering would not call it
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return seen


def test_a_staged_kernel_lowers_with_its_stages_on_the_step_loop_and_one_wide_scale_load(monkeypatch):
    _, raw, rows = _stack_rows(T.Q8_0, n_out=64)
    x, idx = jnp.ones((1, 1024), jnp.float32), jnp.array([2, 0], jnp.int32)
    tile = (8, 8, 4, 1)  # NB = 8 blocks a step: 8 x 32 quant bytes and 16 scale bytes a row
    for stages in (2, 3):
        [found] = _triton_modules(monkeypatch, lambda x, r, i, s=stages: rows_matvec(
            x, r, i, T.Q8_0, "planar", tile=tile, stages=s), x, rows, idx)
        assert found["loops"] == [stages]
        assert sorted(found["byte_loads"]) == ["8x16", "8x8x32"]  # quants, and the scales' 2 * NB contiguous bytes
    [plain] = _triton_modules(monkeypatch, lambda x, r, i: rows_matvec(
        x, r, i, T.Q8_0, "planar", tile=tile, stages=0), x, rows, idx)
    assert plain["loops"] == [None] and sorted(plain["byte_loads"]) == ["8x8", "8x8", "8x8x32"]


def test_every_format_can_ask_for_stages_and_only_the_named_kernel_is_marked(monkeypatch):
    rng = np.random.default_rng(1)
    raw = random_quantized(rng, T.Q2_K, (2, 16, 512))
    rows, x, idx = jnp.asarray(to_planar(raw, T.Q2_K)), jnp.ones((1, 512), jnp.float32), jnp.array([1], jnp.int32)

    def two(x, r, i, q8):  # a staged Q2_K product and an unstaged Q8_0 one in one program
        return (rows_matvec(x, r, i, T.Q2_K, "planar", stages=4),
                rows_matvec(x, q8, i, T.Q8_0, "planar", stages=0))

    _, _, q8 = _stack_rows(T.Q8_0, E=2, n_out=16, n_in=512)
    found = {m["name"]: m["loops"] for m in _triton_modules(monkeypatch, two, x, rows, idx, q8)}
    assert found == {'"rows_matvec_q2_k_planar__ls4"': [4], '"rows_matvec_q8_0_planar"': [None]}


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q2_K])
def test_the_two_bit_staged_kernels_lower_for_cuda_with_their_loops_marked(monkeypatch, qtype):
    _, _, rows = _stack_rows(qtype, E=2, n_out=16, n_in=512)
    x, idx = jnp.ones((1, 512), jnp.float32), jnp.array([1], jnp.int32)

    def both(x, r, i):  # the f32 kernel and the int8 numerics' kernel, each staged
        return (rows_matvec(x, r, i, qtype, "planar", stages=3),
                rows_matvec_int8(*round_int8(x), r, i, qtype, "planar", stages=3))

    found = {m["name"]: m["loops"] for m in _triton_modules(monkeypatch, both, x, rows, idx)}
    name = qtype.name.lower()
    assert found == {f'"rows_matvec_{name}_planar__ls3"': [3], f'"rows_matvec_int8_{name}_planar__ls3"': [3]}


@pytest.mark.parametrize("qtype,unstaged,staged", [
    (T.Q8_0, functools.partial(tm._load_q8_0, n_in=1024), tm._load_q8_0_staged),
    (T.IQ2_XXS, functools.partial(tm._load_iq2_xxs, planar=True, n_in=1024), tm._load_iq2_xxs_staged),
    (T.Q2_K, functools.partial(tm._load_q2_k_planar, n_in=1024), tm._load_q2_k_staged),
    (T.Q2_K, functools.partial(triton_int8._load_q2_k_words, n_in=1024), triton_int8._load_q2_k_words_staged)])
def test_a_staged_load_gives_the_fields_of_the_unstaged_one(qtype, unstaged, staged):
    _, _, rows = _stack_rows(qtype)
    w = rows.reshape(-1, rows.shape[-1])  # the kernel's flat [E * O, R] view
    nb = 2 if qtype == T.Q8_0 else 1
    last = 1024 // tm.BLOCKS[qtype][0] - nb
    for first in sorted({0, nb * (last // (2 * nb)), last}):  # the first step, one in the middle, the last
        picked = jnp.array([0, 5, 33, 95], jnp.int32)
        want = unstaged(w, picked, first + jnp.arange(nb, dtype=jnp.int32))
        got = staged(w, picked, jnp.int32(first), n_in=1024, nb=nb)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.shape == v.shape and g.dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.IQ2_XXS, T.Q2_K])
@pytest.mark.parametrize("tile,x_rows", [((4, 1, 4, 2), 1), ((16, 4, 4, 1), 3)])  # a row split; x per selection
def test_interpreted_staged_kernels_equal_a_float64_reference(qtype, tile, x_rows):
    rng, raw, rows = _stack_rows(qtype)
    values = tm.BLOCKS[qtype][0]
    if tile is not None and (1024 // values) % (tile[1] * tile[3]):
        tile = (tile[0], 1, tile[2], 1)  # the two-bit formats have 4 blocks a row here
    idx = np.array([2, 0, 7], np.int32)  # 7 clamps to the stack
    x = rng.standard_normal((x_rows, 1024)).astype(np.float32)
    got = rows_matvec(jnp.asarray(x), rows, jnp.asarray(idx), qtype, "planar", interpret=True, tile=tile, stages=3)
    assert _rel(got, reference_rows_matvec(x, raw, idx, qtype)) < 1e-6
    if qtype != T.Q8_0:  # the int8 numerics' kernel, staged, against the reference of its rounded x
        q, d = round_int8(jnp.asarray(x))
        rounded = (np.asarray(q, np.float64).reshape(x_rows, -1, 32) * np.asarray(d)[..., None]).reshape(x.shape)
        got = rows_matvec_int8(q, d, rows, jnp.asarray(idx), qtype, "planar", interpret=True, tile=tile, stages=3)
        assert _rel(got, reference_rows_matvec(rounded, raw, idx, qtype)) < 1e-6


def test_the_stages_switch_parses_type_names_and_names_itself_when_wrong():
    assert _splits_from("Q8_0=3,Q2_K=2", "JDS41_LOOP_STAGES") == {T.Q8_0: 3, T.Q2_K: 2}
    for bad, said in (("Q8_0=0", "JDS41_LOOP_STAGES: 'Q8_0=0'"), ("Q4_K=3", "JDS41_LOOP_STAGES: 'Q4_K'")):
        with pytest.raises(ValueError, match=said):
            _splits_from(bad, "JDS41_LOOP_STAGES")


# V4.1's Q8_0 shapes where the step loop is long (the head's 160 blocks a row, q_b's 40) and its two-bit experts
GPU_SHAPES = [(T.Q8_0, 1, 129280, 5120), (T.Q8_0, 2, 32768, 1280), (T.Q8_0, 4, 5120, 8192), (T.Q2_K, 16, 5120, 2304),
              (T.IQ2_XXS, 16, 2304, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,E,n_out,n_in", GPU_SHAPES)
def test_compiled_staged_kernels_agree_with_xla_and_keep_each_vmapped_rows_bits(qtype, E, n_out, n_in):
    """Compiled at 2, 3 and 4 stages: within f32 rounding of XLA's spelling (and the int8 kernels of XLA's int8
    spelling), and a vmapped call (row-batched decode, jds41/block_step.py) gives each row its own call's bits.
    Whether the bits equal the unstaged kernel's is reported by bench_kernels --stages, not required: every path
    of one shape runs the same staged kernel."""
    assert loop_stages.install()
    rng = np.random.default_rng(5)
    one = random_quantized(rng, qtype, (1, min(n_out, 2048), n_in))
    raw = np.tile(one, (E, -(-n_out // one.shape[1]), 1))[:, :n_out]
    rows, ggml = jax.device_put(to_planar(raw, qtype)), jax.device_put(raw)
    K = min(E, 6)
    idx = jnp.asarray(rng.integers(0, E, (3, K)), jnp.int32)
    xs = jnp.asarray(rng.standard_normal((3, 1, n_in)), jnp.float32)
    want = np.asarray(jax.jit(lambda x, i: xla_rows_matvec(x, ggml, i, qtype))(xs[0], idx[0]))
    for stages in (2, 3, 4):
        one_call = jax.jit(lambda x, i, s=stages: rows_matvec(x, rows, i, qtype, "planar", stages=s))
        got = np.asarray(one_call(xs[0], idx[0]))
        assert np.isfinite(got).all() and _rel(got, want.astype(np.float64)) < 1e-5, stages
        batched = np.asarray(jax.jit(jax.vmap(one_call))(xs, idx))
        for r in range(3):
            np.testing.assert_array_equal(batched[r], np.asarray(one_call(xs[r], idx[r])))
        if qtype != T.Q8_0:
            q, d = round_int8(xs[0])
            int8_want = np.asarray(jax.jit(lambda q, d, i: xla_int8_rows_matvec(q, d, ggml, i, qtype))(q, d, idx[0]))
            int8_got = np.asarray(jax.jit(lambda q, d, i, s=stages: rows_matvec_int8(
                q, d, rows, i, qtype, "planar", stages=s))(q, d, idx[0]))
            assert _rel(int8_got, int8_want.astype(np.float64)) < 1e-5, stages
