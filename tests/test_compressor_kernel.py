"""A compressor's sequential part as one Triton launch (jds41/layers/compressor_kernel.py, JDS41_COMPRESSOR_KERNEL).

On every machine: token after token through the kernel in Pallas' interpreter and through compressor.absorb's XLA
spelling (the reference), the ring buffers equal bit for bit (they are copies and one add) and the emitted rows
and latents to f32 rounding, for the V4 layouts (ratio 4 overlapped with ape, the indexer's width, ratio 128), a
plain pool (ratio 2), a ratio that is not a power of two and V4.1's ratio 1 without a gate; the rows against a
float64 numpy re-derivation (tests/reference/numpy_attention.py's pooling, norm and RoPE); rows of blocks not yet
complete stay as they were (the state is updated in place); switched on, compressor.absorb lowers to one Triton
call for CUDA whose outputs alias the state, and to none for the CPU. On a GPU (marker `gpu`): the compiled kernel
against the XLA spelling at V4-Flash's shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import numpy_attention as ref

from jds41.layers import compressor, compressor_kernel
from jds41.layers.compressor import CompressorSpec, _absorb_xla, init_state

EPS = 1e-6
TRITON_CALL = "__gpu$xla.gpu.triton"
# (ratio, width, overlap, gate, ape, rope dims, tokens): V4-Flash's CSA compressor and its indexer's (narrower),
# its HCA (ratio 128, width 512), a plain pool, a ratio not a power of two, V4.1's ratio 1
SHAPES = {"csa": (4, 64, True, True, True, 16, 21), "indexer": (4, 32, True, True, True, 8, 13),
          "hca128": (128, 512, False, True, True, 64, 130), "plain2": (2, 64, False, True, False, 16, 9),
          "ratio3": (3, 48, False, True, True, 16, 10), "ratio1": (1, 64, False, False, False, 16, 5)}


def _case(name: str, seed: int = 0, widths: dict | None = None):
    """A compressor of SHAPES[name] (its width and RoPE dims replaced where `widths` names them: (width, rope)) and
    its tokens' projections, norm weight, ape and frequencies."""
    ratio, width, overlap, gate, ape, rope, tokens = SHAPES[name]
    width, rope = (widths or {}).get(name, (width, rope))
    spec = CompressorSpec(ratio=ratio, width=width, overlap=overlap, has_gate=gate, has_ape=ape,
                          n_rows=tokens // ratio + 2)
    rng = np.random.default_rng(seed)
    proj = spec.proj_width
    kv = (rng.standard_normal((tokens, proj)) * 2).astype(np.float32)
    sc = (rng.standard_normal((tokens, proj)) * 3).astype(np.float32) if gate else None
    w = {"c_norm": rng.uniform(0.5, 1.5, width).astype(np.float32)}
    if ape:
        w["c_ape"] = rng.standard_normal((ratio, proj)).astype(np.float32)
    freqs = (10000.0 ** (-np.arange(rope // 2) / (rope // 2))).astype(np.float32)
    return spec, kv, sc, w, freqs


def _run(spec, kv, sc, w, freqs, kernel: bool, interpret: bool = True):
    """The state after each token, by the kernel (interpreted or compiled) or the XLA spelling (each step jitted)."""
    ape = w.get("c_ape")

    def xla(st, k, s, p):
        return _absorb_xla(spec, st, k, s, ape, w["c_norm"], freqs, p, EPS)

    def kern(st, k, s, p):
        keys = ("kv_buf", "score_buf", "rows", "latent")
        new = compressor_kernel.absorb_state(*(st[n] for n in keys), k, s, ape, w["c_norm"], jnp.asarray(freqs), p,
                                             ratio=spec.ratio, overlap=spec.overlap, has_gate=spec.has_gate, eps=EPS,
                                             interpret=interpret)
        return dict(zip(keys, new))

    step = jax.jit(kern if kernel else xla)
    st, states = init_state(spec), []
    for t in range(kv.shape[0]):
        st = step(st, jnp.asarray(kv[t]), None if sc is None else jnp.asarray(sc[t]), jnp.int32(t))
        states.append({k: np.asarray(v) for k, v in st.items()})
    return states


def _numpy_rows(spec, kv, sc, w, freqs):
    """The complete blocks' rows in float64: softmax pooling, RMS norm with the weight, RoPE at each block's first
    position (the latent: the last row before RoPE)."""
    r = spec.ratio
    if not spec.has_gate:
        pooled = kv.astype(np.float64)
    else:
        score = sc.astype(np.float64)
        if spec.has_ape:
            score = score + w["c_ape"][np.arange(kv.shape[0]) % r]
        pooled = ref.pool_blocks(kv.astype(np.float64), score, r, spec.overlap)
    normed = pooled / np.sqrt((pooled ** 2).mean(-1, keepdims=True) + EPS) * w["c_norm"]
    return ref.apply_rope(normed, np.arange(normed.shape[0]) * r, freqs.astype(np.float64)), normed


def _assert_states_agree(got, want):
    """Token by token: the rings bit for bit (copies and one add), rows and latents to 2e-6 of the rows' scale."""
    scale = np.abs(want[-1]["rows"]).max()
    for t, (g, x) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g["kv_buf"], x["kv_buf"], err_msg=f"kv ring after token {t}")
        np.testing.assert_array_equal(g["score_buf"], x["score_buf"], err_msg=f"score ring after token {t}")
        for leaf in ("rows", "latent"):
            np.testing.assert_allclose(g[leaf], x[leaf], rtol=0, atol=2e-6 * scale, err_msg=f"{leaf} after {t}")


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_interpreted_kernel_equals_the_xla_spelling_and_a_float64_rederivation(name):
    spec, kv, sc, w, freqs = _case(name)
    got, want = _run(spec, kv, sc, w, freqs, kernel=True), _run(spec, kv, sc, w, freqs, kernel=False)
    _assert_states_agree(got, want)
    rows, normed = _numpy_rows(spec, kv, sc, w, freqs)
    n = rows.shape[0]
    assert n >= 1
    np.testing.assert_allclose(got[-1]["rows"][:n], rows, rtol=0, atol=5e-6 * np.abs(rows).max())
    np.testing.assert_allclose(got[-1]["latent"], normed[-1], rtol=0, atol=5e-6 * np.abs(normed).max())
    assert not got[-1]["rows"][n:].any()  # blocks not yet complete: never written


def test_a_step_that_completes_no_block_writes_the_ring_alone():
    """The state comes in aliased: rows and latent a step does not emit keep whatever they held."""
    spec, kv, sc, w, freqs = _case("csa")
    held = {k: np.asarray(v) for k, v in init_state(spec).items()}
    held["rows"] = np.full(held["rows"].shape, 7.0, np.float32)
    held["latent"] = np.full(held["latent"].shape, -3.0, np.float32)
    keys = ("kv_buf", "score_buf", "rows", "latent")
    for pos, emits in ((5, False), (7, True)):
        new = compressor_kernel.absorb_state(*(jnp.asarray(held[k]) for k in keys), jnp.asarray(kv[0]),
                                             jnp.asarray(sc[0]), jnp.asarray(w["c_ape"]), w["c_norm"],
                                             jnp.asarray(freqs), jnp.int32(pos), ratio=4, overlap=True,
                                             has_gate=True, eps=EPS, interpret=True)
        new = dict(zip(keys, (np.asarray(a) for a in new)))
        np.testing.assert_array_equal(new["kv_buf"][pos % 8], kv[0])
        np.testing.assert_array_equal(np.delete(new["kv_buf"], pos % 8, 0), np.delete(held["kv_buf"], pos % 8, 0))
        changed = np.flatnonzero((new["rows"] != held["rows"]).any(-1))
        assert changed.tolist() == ([pos // 4] if emits else []), changed
        assert (new["latent"] != held["latent"]).all() if emits else (new["latent"] == held["latent"]).all()


def test_a_layout_the_kernel_cannot_take_is_refused():
    assert compressor_kernel.layout(4, 64, True) == (8, 64)
    assert compressor_kernel.layout(128, 512, False) == (128, 32)
    assert compressor_kernel.layout(3, 48, False) == (4, 16)
    assert compressor_kernel.layout(4, 63, True) is None  # an odd width has no even chunk


@pytest.mark.parametrize("enabled", [True, False])
def test_absorb_lowers_to_one_aliased_kernel_on_cuda_only_when_switched_on(monkeypatch, enabled):
    monkeypatch.setattr(compressor_kernel, "ENABLED", enabled)
    spec, kv, sc, w, freqs = _case("csa")
    ws = {"attn_compressor_norm": w["c_norm"], "attn_compressor_ape": w["c_ape"]}

    def run(st, k, s, p):
        return compressor.absorb(spec, st, ws, k, s, p, freqs, EPS)[0]

    st = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_state(spec))
    vec = jax.ShapeDtypeStruct((spec.proj_width,), jnp.float32)
    for platform in ("cuda", "cpu"):
        text = jax.jit(run).trace(st, vec, vec, jax.ShapeDtypeStruct((), jnp.int32)).lower(
            lowering_platforms=(platform,)).as_text()
        on = enabled and platform == "cuda"
        assert (TRITON_CALL in text) is on and ('"compressor_absorb"' in text) is on
        if on:
            assert text.count(TRITON_CALL) == 1 and "output_operand_aliases" in text


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["csa", "indexer", "hca128", "ratio1"])
def test_the_compiled_kernel_agrees_with_the_xla_spelling_on_the_gpu(name):
    """At V4-Flash's widths (512 for the attention compressors, 128 for the indexer's; RoPE on the last 64)."""
    case = _case(name, seed=1, widths={"csa": (512, 64), "indexer": (128, 64), "ratio1": (512, 64)})
    got, want = _run(*case, kernel=True, interpret=False), _run(*case, kernel=False)
    _assert_states_agree(got, want)
