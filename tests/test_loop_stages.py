"""Triton's pipelining of the step loops (jds41/quant/loop_stages.py): the loop attribute in the lowered Triton
module (CUDA lowering runs on the CPU), a staged kernel's products bit for bit the unstaged ones' (in Pallas'
interpreter here; compiled, under the `gpu` marker), and the switch's parsing. Speed is measured in
experiments/bench_kernels.py --stages, never here."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from kernel_reference import reference_rows_matvec
from kernel_reference import rel_error as _rel

from jds41.quant import loop_stages
from jds41.quant.planar import to_planar
from jds41.quant.qtensor import xla_rows_matvec
from jds41.quant.random_blocks import random_quantized
from jds41.quant.triton_matvec import _splits_from, rows_matvec


def _q8_case(E=3, n_out=32, n_in=1024, seed=0):
    rng = np.random.default_rng(seed)
    raw = random_quantized(rng, T.Q8_0, (E, n_out, n_in))
    return rng, raw, jnp.asarray(to_planar(raw, T.Q8_0))


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
    _, raw, rows = _q8_case(n_out=64)
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

    _, _, q8 = _q8_case(E=2, n_out=16, n_in=512)
    found = {m["name"]: m["loops"] for m in _triton_modules(monkeypatch, two, x, rows, idx, q8)}
    assert found == {'"rows_matvec_q2_k_planar__ls4"': [4], '"rows_matvec_q8_0_planar"': [None]}


@pytest.mark.parametrize("tile,x_rows", [((8, 8, 4, 1), 1), ((4, 4, 4, 2), 1), ((16, 32, 4, 1), 3), (None, 3)])
def test_the_interpreted_staged_kernel_has_the_unstaged_bits(tile, x_rows):
    rng, raw, rows = _q8_case(n_out=32)
    idx = np.array([2, 0, 7], np.int32)  # 7 clamps to the stack
    x = rng.standard_normal((x_rows, 1024)).astype(np.float32)
    args = (jnp.asarray(x), rows, jnp.asarray(idx), T.Q8_0, "planar")
    plain = np.asarray(rows_matvec(*args, interpret=True, tile=tile, stages=0))
    staged = np.asarray(rows_matvec(*args, interpret=True, tile=tile, stages=3))
    np.testing.assert_array_equal(staged, plain)
    assert _rel(staged, reference_rows_matvec(x, raw, idx, T.Q8_0)) < 1e-6


def test_the_stages_switch_parses_type_names_and_names_itself_when_wrong():
    assert _splits_from("Q8_0=3,Q2_K=2", "JDS41_LOOP_STAGES") == {T.Q8_0: 3, T.Q2_K: 2}
    for bad, said in (("Q8_0=0", "JDS41_LOOP_STAGES: 'Q8_0=0'"), ("Q4_K=3", "JDS41_LOOP_STAGES: 'Q4_K'")):
        with pytest.raises(ValueError, match=said):
            _splits_from(bad, "JDS41_LOOP_STAGES")


# V4.1's Q8_0 shapes where the step loop is long (the head's 160 blocks a row, q_b's 40) and a two-bit one
GPU_SHAPES = [(T.Q8_0, 1, 129280, 5120), (T.Q8_0, 2, 32768, 1280), (T.Q8_0, 4, 5120, 8192), (T.Q2_K, 16, 5120, 2304),
              (T.IQ2_XXS, 16, 2304, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,E,n_out,n_in", GPU_SHAPES)
def test_compiled_staged_kernels_have_the_unstaged_bits_on_the_gpu(qtype, E, n_out, n_in):
    assert loop_stages.install()
    rng = np.random.default_rng(5)
    one = random_quantized(rng, qtype, (1, min(n_out, 2048), n_in))
    raw = np.tile(one, (E, -(-n_out // one.shape[1]), 1))[:, :n_out]
    rows = jax.device_put(to_planar(raw, qtype))
    K = min(E, 6)
    idx = jnp.asarray(rng.integers(0, E, K), jnp.int32)
    x = jnp.asarray(rng.standard_normal((1, n_in)), jnp.float32)
    run = lambda s: np.asarray(jax.jit(lambda x, r, i: rows_matvec(x, r, i, qtype, "planar", stages=s))(x, rows, idx))  # noqa: E731
    plain = run(0)
    want = np.asarray(jax.jit(lambda x, r, i: xla_rows_matvec(x, r, i, qtype))(x, jax.device_put(raw), idx))
    assert np.isfinite(plain).all() and _rel(plain, want.astype(np.float64)) < 1e-5
    for stages in (2, 3, 4):
        np.testing.assert_array_equal(run(stages), plain)
