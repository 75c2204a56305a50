"""The planar row layout (jds41/quant/planar.py): Q8_0 / MXFP4 / IQ2_XXS / Q2_K rows regrouped quants-first on the
device.

Checks: the regrouping is a permutation of each row's bytes with the documented order (Q2_K: its codes reordered
into value order, checked against a loop over the file's bit positions), and its inverse; planar rows
decode to gguf-py's values bit for bit (MXFP4 with subnormal scales included); every XLA product over planar rows
equals the same product over GGML rows bit for bit; `planar_params` regroups every Q8_0 / MXFP4 matrix and expert
stack and leaves other leaves alone; an engine with planar weights gives the logits of the GGML engine bit for bit on
the CPU (XLA reads both layouts), resident and with its experts over HBM, pinned host memory and the SSD.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.quant import QTensor, qmatmul, qmatvec, qmatvec_experts
from jds41.quant.planar import dequantize_planar, from_planar, planar_params, quant_bytes, to_planar
from jds41.quant.random_blocks import random_quantized

FORMATS = [T.Q8_0, T.MXFP4, T.IQ2_XXS, T.Q2_K]
# a three-tier placement (HBM, pinned host, SSD through a 2-slot cache) for the engine tests
SPLIT3 = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
          "slot_cache_slots": 2, "lookahead": 1, "router_lean": {"enabled": False}}


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4, T.IQ2_XXS])
def test_planar_rows_hold_every_blocks_quants_then_every_scale(qtype):
    rng = np.random.default_rng(0)
    # a GGML block: h scale bytes, then p quant bytes, for n values
    h, p, n = {T.Q8_0: (2, 32, 32), T.MXFP4: (1, 16, 32), T.IQ2_XXS: (2, 64, 256)}[qtype]
    raw = random_quantized(rng, qtype, (3, 5, 8 * n))  # 8 blocks per row
    planar = to_planar(raw, qtype)
    assert planar.shape == raw.shape and planar.dtype == np.uint8
    blocks = raw.reshape(3, 5, 8, h + p)
    for b in range(8):  # block b's quants at b*p from the row's start, its scale bytes after all the quants
        np.testing.assert_array_equal(planar[..., b * p:(b + 1) * p], blocks[..., b, h:])
        np.testing.assert_array_equal(planar[..., 8 * p + b * h:8 * p + (b + 1) * h], blocks[..., b, :h])
    assert quant_bytes(qtype, 8 * n) == 8 * p
    np.testing.assert_array_equal(from_planar(planar, qtype), raw)
    np.testing.assert_array_equal(np.asarray(to_planar(jnp.asarray(raw), qtype)), planar)  # jax spelling too


def test_planar_q2_k_rows_hold_codes_in_value_order_then_the_other_fields():
    rng = np.random.default_rng(6)
    raw = random_quantized(rng, T.Q2_K, (2, 3, 4 * 256))  # 4 blocks per row
    planar = to_planar(raw, T.Q2_K)
    assert planar.shape == raw.shape and planar.dtype == np.uint8
    blocks = raw.reshape(2, 3, 4, 84)
    for b in range(4):
        want = np.zeros((2, 3, 64), np.uint8)
        for c in range(2):  # the file's byte c*32 + l holds value c*128 + s*32 + l at bits 2s
            for s in range(4):
                for lane in range(32):
                    value = c * 128 + s * 32 + lane
                    code = (blocks[..., b, 16 + c * 32 + lane] >> (2 * s)) & 3
                    want[..., value // 4] |= (code << (2 * (value % 4))).astype(np.uint8)  # value 4t + u: bits 2u
        np.testing.assert_array_equal(planar[..., b * 64:(b + 1) * 64], want)
        fields = planar[..., 4 * 64 + b * 20:4 * 64 + (b + 1) * 20]  # 16 scale|min bytes, d, dmin, after every code
        np.testing.assert_array_equal(fields, np.concatenate([blocks[..., b, :16], blocks[..., b, 80:]], axis=-1))
    assert quant_bytes(T.Q2_K, 4 * 256) == 4 * 64
    np.testing.assert_array_equal(from_planar(planar, T.Q2_K), raw)
    np.testing.assert_array_equal(np.asarray(to_planar(jnp.asarray(raw), T.Q2_K)), planar)
    np.testing.assert_array_equal(np.asarray(from_planar(jnp.asarray(planar), T.Q2_K)), raw)


@pytest.mark.parametrize("qtype", FORMATS)
def test_planar_rows_decode_to_gguf_values_bit_for_bit(qtype):
    rng = np.random.default_rng(1)
    raw = random_quantized(rng, qtype, (7, 512))
    if qtype == T.MXFP4:  # subnormal scales (e8m0 0 and 1) and the largest ones, which XLA:CPU must not flush
        raw.reshape(7, 16, 17)[:3, :4, 0] = [[0, 1, 2, 200]] * 3
    want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    got = np.asarray(jax.jit(dequantize_planar, static_argnums=1)(to_planar(raw, qtype), qtype))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", FORMATS)
def test_xla_products_over_planar_rows_equal_those_over_ggml_rows(qtype):
    rng = np.random.default_rng(2)
    raw = random_quantized(rng, qtype, (6, 48, 1024))
    ggml = QTensor.from_raw(raw, qtype, (6, 48, 1024))
    planar = ggml.with_layout(jnp.asarray(to_planar(raw, qtype)), "planar")
    x = jnp.asarray(rng.standard_normal(1024), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((5, 1024)), jnp.float32)
    idx = jnp.asarray([3, 0, 5, 5], jnp.int32)
    for fn in (lambda w: qmatvec_experts(x, w, idx), lambda w: qmatvec_experts(xs[:4], w, idx),
               lambda w: qmatvec(x, w.with_rows(w.data[1], (48, 1024))),
               lambda w: qmatmul(xs, w.with_rows(w.data[2], (48, 1024)))):
        np.testing.assert_array_equal(np.asarray(jax.jit(fn)(planar)), np.asarray(jax.jit(fn)(ggml)))


def test_planar_params_regroup_every_matrix_and_stack_that_has_the_layout():
    rng = np.random.default_rng(3)

    def q(qtype, shape):
        return QTensor.from_raw(random_quantized(rng, qtype, shape), qtype, shape)

    params = {"output": q(T.Q8_0, (64, 256)), "output_norm": jnp.ones(256),
              "blocks": [{"attn_q_a": q(T.MXFP4, (32, 256)), "ffn_gate_exps": q(T.MXFP4, (4, 32, 256)),
                          "ffn_up_exps": q(T.Q8_0, (4, 32, 256)), "ffn_down_exps": q(T.Q2_K, (4, 256, 256)),
                          "attn_kv": q(T.Q4_K, (32, 256)), "ffn_gate_inp": q(T.F32, (4, 256))}]}
    out = planar_params(params)
    layouts = {k: v.layout for k, v in out["blocks"][0].items()}
    assert layouts == {"attn_q_a": "planar", "ffn_gate_exps": "planar", "ffn_up_exps": "planar",
                       "ffn_down_exps": "planar", "attn_kv": "ggml",
                       "ffn_gate_inp": "ggml"}  # Q4_K and F32 have no planar layout
    assert out["output"].layout == "planar" and out["output_norm"] is params["output_norm"]
    for name in ("attn_q_a", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        before, after = params["blocks"][0][name], out["blocks"][0][name]
        np.testing.assert_array_equal(np.asarray(after.data), to_planar(np.asarray(before.data), before.qtype))
    with pytest.raises(ValueError, match="layout"):
        QTensor.from_raw(np.zeros((4, 4), np.float32), T.F32, (4, 4)).with_layout(None, "planar")


@pytest.mark.parametrize("quant", ["q8", "mxfp4"])
def test_an_engine_with_planar_weights_gives_the_ggml_logits(synthetic_model, quant):
    from jds41.engine import Engine

    engine = Engine.open(str(synthetic_model("deepseek4", "tiny", quant)), max_ctx=64)
    toks = [5, 9, 13, 2, 77, 31]
    want = engine.session().feed(toks, all_logits=True)
    planar = engine.with_params(planar_params(engine.params))
    assert planar.params["output"].layout == "planar"
    np.testing.assert_array_equal(planar.session().feed(toks, all_logits=True), want)


@pytest.mark.slow
def test_planar_tier_stores_keep_every_placement_on_the_resident_bits(synthetic_model, tmp_path, monkeypatch):
    """With planar weights, HBM and host stacks are regrouped when placed and SSD answers in the graph: a split over
    all three tiers still gives the resident logits bit for bit (XLA reads the rows here; on CUDA the kernel does,
    tests/test_triton_engine.py and the GPU tests)."""
    import json

    import jds41.engine as engine_module
    from jds41.engine import Engine

    model = str(synthetic_model("deepseek41", "tiny", "mxfp4"))
    profile = tmp_path / "split3.json"
    profile.write_text(json.dumps(SPLIT3))
    toks = [int(t) for t in np.random.default_rng(4).integers(8, 400, 24)]
    want = Engine.open(model, max_ctx=64, prefill_chunk=8).session().feed(toks, all_logits=True)
    monkeypatch.setattr(engine_module, "planar_weights", lambda *_: True)
    resident = Engine.open(model, max_ctx=64, prefill_chunk=8)
    tiered = Engine.open(model, max_ctx=64, prefill_chunk=8, profile=str(profile))
    routed = tiered.params["blocks"][3]["routed"]
    assert resident.params["blocks"][3]["ffn_gate_exps"].layout == "planar"
    assert routed.hbm["gate"].layout == routed.host["gate"].layout == "planar" and routed.source is not None
    np.testing.assert_array_equal(resident.session().feed(toks, all_logits=True), want)
    np.testing.assert_array_equal(tiered.session().feed(toks, all_logits=True), want)
    tiered.tiers.close()


@pytest.mark.slow
def test_two_bit_expert_stacks_go_planar_and_keep_the_resident_bits_in_every_tier(tmp_path, monkeypatch):
    """IQ2_XXS gate/up stacks and Q2_K down stacks (V4.1's two-bit experts, rows of 256) take the planar layout
    with the others. Planar weights give the GGML engine's logits bit for bit, resident and over HBM, pinned host
    memory and the SSD (whose answers the graph regroups)."""
    import dataclasses
    import json

    import jds41.engine as engine_module
    from jds41.checkpoints import synth
    from jds41.checkpoints.presets import preset
    from jds41.engine import Engine

    model = tmp_path / "q2.gguf"
    cfg = dataclasses.replace(preset("deepseek4", "tiny"), dim=256, expert_ff=256)
    assert not synth.write_synthetic(model, cfg, "ds4-q2", progress=False)["fallback_q8_0"]
    profile = tmp_path / "split3.json"
    profile.write_text(json.dumps(SPLIT3))
    toks = [int(t) for t in np.random.default_rng(5).integers(8, 400, 16)]
    want = Engine.open(str(model), max_ctx=64, prefill_chunk=8).session().feed(toks, all_logits=True)
    monkeypatch.setattr(engine_module, "planar_weights", lambda *_: True)
    resident = Engine.open(str(model), max_ctx=64, prefill_chunk=8)
    block = resident.params["blocks"][cfg.n_layers - 1]
    assert block["ffn_gate_exps"].qtype == T.IQ2_XXS and block["ffn_gate_exps"].layout == "planar"
    assert block["ffn_down_exps"].qtype == T.Q2_K and block["ffn_down_exps"].layout == "planar"
    np.testing.assert_array_equal(resident.session().feed(toks, all_logits=True), want)
    tiered = Engine.open(str(model), max_ctx=64, prefill_chunk=8, profile=str(profile))
    routed = tiered.params["blocks"][cfg.n_layers - 1]["routed"]
    assert routed.hbm["gate"].layout == routed.host["gate"].layout == "planar" and routed.source is not None
    assert routed.hbm["down"].layout == routed.host["down"].layout == "planar"
    np.testing.assert_array_equal(tiered.session().feed(toks, all_logits=True), want)
    tiered.tiers.close()
