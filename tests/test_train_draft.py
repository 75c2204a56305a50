"""The DSpark drafter's training pieces compute what the engine computes (experiments/train/draft_*.py).

References are the engine's own inference path, never stored values:
- the parallel draft forward against `jds41.speculative.DSparkDrafter.observe` + `jds41.layers.dspark.propose` on the
  same float weights (F32 QTensors) and features, for anchors before, at and past a full window (window 8);
- the training forward's target features against what `jds41.model.prefill` reports for `feature_layers`;
- an exported draft file opened by `DSparkDrafter.open` against the float drafter (quantization tolerance);
- the tiny end-to-end run_draft: its speculative output must equal plain greedy decode (checked inside the run
  against `Session.generate`, and again here from the written file).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from train_helpers import engine_params, tiny_setup

from experiments.train.draft_forward import draft_forward
from experiments.train.draft_train import init_draft_params, short_name, target_fn
from experiments.train.forward import engram_ids_batch, forward
from experiments.train.frozen import draft_config
from jds41 import model as M
from jds41.checkpoints.schema import Kind, draft_tensors
from jds41.layers import dspark
from jds41.layers.engram_rows import read_step_rows
from jds41.quant import QTensor
from jds41.speculative import DSparkDrafter

TINY_MODEL = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-deepseek41-q8.gguf")


def _q(a) -> QTensor:
    a = np.asarray(a, np.float32)
    return QTensor.from_raw(a, T.F32, a.shape)


def engine_draft_params(dcfg, params, buffers) -> dict:
    """dspark.load_draft_params' tree from float draft weights (matrices as F32 QTensors)."""
    out: dict = {"stages": [{} for _ in params["stages"]]}
    for name, spec in draft_tensors(dcfg).items():
        s, short = short_name(dcfg, name)
        value = (buffers if short == "exp_probs_b" else params)["stages"][s][short]
        out["stages"][s][short] = _q(value) if spec.kind in (Kind.MATRIX, Kind.EXPERTS) else \
            jnp.asarray(value, jnp.float32)
    return out


def random_drafter(cfg, seed: int):
    """(dcfg, params, buffers, shared float) with the zero-initialised heads and biases made non-trivial."""
    dcfg = draft_config(cfg, 2, 4, 2)
    params, buffers = init_draft_params(dcfg, seed)
    rng = np.random.default_rng(seed + 1)
    last = params["stages"][-1]
    last["markov_head"] = rng.standard_normal(last["markov_head"].shape).astype(np.float32)
    last["conf_proj"] = (0.1 * rng.standard_normal(last["conf_proj"].shape)).astype(np.float32)
    for st, buf in zip(params["stages"], buffers["stages"], strict=True):
        st["attn_sinks"] = rng.standard_normal(st["attn_sinks"].shape).astype(np.float32)
        buf["exp_probs_b"] = (0.1 * rng.standard_normal(buf["exp_probs_b"].shape)).astype(np.float32)
    D, V = cfg.dim, cfg.vocab_size
    shared = {"token_embd": rng.standard_normal((V, D)).astype(np.float32),
              "output": (rng.standard_normal((V, D)) / np.sqrt(D)).astype(np.float32)}
    return dcfg, params, buffers, shared


def engine_proposals(dcfg, eparams, shared, feats_TND, tokens, anchors):
    """{p: (tokens [K], confidence [K], logits [K, V])} from the engine's drafter after observing 0 .. p-1."""
    plan = dspark.make_draft_plan(dcfg)
    eshared = {k: _q(v) for k, v in shared.items()}
    out = {}
    for p in anchors:
        drafter = DSparkDrafter(plan, eparams, eshared, "test")
        if p:
            drafter.observe(jnp.asarray(feats_TND[:p]), 0, p)
        toks, conf, logits = dspark.propose(plan, eparams, eshared, drafter.state, jnp.int32(tokens[p]), jnp.int32(p))
        out[p] = (np.asarray(toks), np.asarray(conf), np.asarray(logits))
    return out


def test_parallel_draft_forward_equals_engine_propose():
    cfg, *_ = tiny_setup(seed=1)
    dcfg, params, buffers, shared = random_drafter(cfg, seed=2)
    K, W = dcfg.dspark.block_size, dcfg.window
    assert W == 8 and K == 3
    Tn = 32
    rng = np.random.default_rng(3)
    tokens = rng.integers(8, cfg.vocab_size, Tn)
    feats = rng.standard_normal((Tn, len(dcfg.dspark.target_layer_ids), cfg.dim)).astype(np.float32)
    anchors = (0, 1, 5, 7, 8, 9, 17, 31)  # empty ring, partial windows, exactly full, sliding
    eng = engine_proposals(dcfg, engine_draft_params(dcfg, params, buffers), shared, feats, tokens, anchors)
    # the Markov rows take the engine's own tokens: tok_0 = x_p, tok_i = its draft i-1
    markov = np.zeros((Tn, K), np.int32)
    for p, (toks, _, _) in eng.items():
        markov[p] = [tokens[p], *toks[:-1]]
    fwd = jax.jit(lambda: draft_forward(dcfg, jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, buffers),
                                        jax.tree.map(jnp.asarray, shared), jnp.asarray(tokens[None]),
                                        jnp.asarray(feats[None]), jnp.asarray(markov[None]), block=4))
    logits, conf, _ = (np.asarray(x) for x in fwd())
    for p, (toks, e_conf, e_logits) in eng.items():
        scale = np.abs(e_logits).max()
        assert scale > 1.0
        np.testing.assert_allclose(logits[0, p], e_logits, atol=1e-4 * scale, rtol=0, err_msg=f"anchor {p}")
        np.testing.assert_array_equal(logits[0, p].argmax(-1), toks)
        np.testing.assert_allclose(jax.nn.sigmoid(conf[0, p]), e_conf, atol=1e-5)


def test_target_features_equal_engine_step_features():
    cfg, params, buffers, hasher, _ = tiny_setup(seed=4)
    layers = cfg.dspark.target_layer_ids
    tokens = np.random.default_rng(5).integers(8, cfg.vocab_size, 24)
    eparams, source = engine_params(cfg, params, buffers)
    plan = M.make_plan(cfg, max_ctx=len(tokens))
    rows = jnp.asarray(read_step_rows(source, hasher.row_ids_seq(tokens)))
    logits, _, feats = M.prefill(plan, eparams, M.init_state(plan), jnp.asarray(tokens, jnp.int32), rows, False,
                                 layers)
    ids = jnp.asarray(engram_ids_batch(hasher, tokens[None]))
    # the drafter's frozen-target program itself (looped Sinkhorn), and forward.py's default path
    got_feats, got_logits = target_fn(cfg, layers, "float32", jax.tree.map(jnp.asarray, params),
                                      jax.tree.map(jnp.asarray, buffers), jnp.asarray(tokens[None], jnp.int32), ids)
    _, aux = jax.jit(lambda p, b: forward(cfg, p, b, jnp.asarray(tokens[None], jnp.int32), ids, block=4,
                                          feature_layers=layers))(jax.tree.map(jnp.asarray, params),
                                                                  jax.tree.map(jnp.asarray, buffers))
    ref = np.asarray(feats)
    assert ref.shape == (len(tokens), len(layers), cfg.dim)
    for got in (got_feats, aux["features"]):
        np.testing.assert_allclose(np.asarray(got)[0], ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    # and the logits stay the engine's (the feature output changes nothing else)
    np.testing.assert_allclose(np.asarray(got_logits)[0], np.asarray(logits), atol=1e-4 * np.abs(logits).max(), rtol=0)


def test_exported_draft_file_opens_and_proposes_like_the_float_drafter(tmp_path):
    from experiments.train.draft_export import plan_bytes, quantized_draft, write_draft_gguf
    from experiments.train.frozen import decoded_trees
    from jds41.checkpoints import open_model
    from jds41.engine import Engine

    engine = Engine.open(TINY_MODEL, max_ctx=64)
    dcfg, params, buffers, _ = random_drafter(engine.cfg, seed=7)
    tparams, _ = decoded_trees(engine.gguf)
    shared = {"token_embd": tparams["token_embd"], "output": tparams["output"]}
    stored, types, dec_p, dec_b = quantized_draft(dcfg, params, buffers, "mxfp4")
    path = write_draft_gguf(tmp_path / "d.gguf", dcfg, stored, types, TINY_MODEL, {"general.name": ("d", "str")})
    with open_model(path) as m:
        assert m.config == dcfg
        assert sum(t.n_bytes for t in m.tensors.values()) == plan_bytes(dcfg, "mxfp4")
        assert m.tensors["mtp.0.ffn_gate_exps.weight"].ggml_type == T.MXFP4
        assert m.tensors["mtp.0.attn_q_a.weight"].ggml_type == T.Q8_0
    drafter = DSparkDrafter.open(engine, path)  # runs check_compatible against the target

    Tn, K = 24, dcfg.dspark.block_size
    rng = np.random.default_rng(8)
    tokens = rng.integers(8, dcfg.vocab_size, Tn)
    feats = rng.standard_normal((Tn, len(dcfg.dspark.target_layer_ids), dcfg.dim)).astype(np.float32)
    anchors = (3, 12, 23)
    got = {}
    for p in anchors:
        drafter.reset()
        drafter.observe(jnp.asarray(feats[:p]), 0, p)
        toks, conf, logits = dspark.propose(drafter.plan, drafter.params, drafter.shared, drafter.state,
                                            jnp.int32(tokens[p]), jnp.int32(p))
        got[p] = (np.asarray(toks), np.asarray(logits))
    markov = np.zeros((Tn, K), np.int32)
    for p, (toks, _) in got.items():
        markov[p] = [tokens[p], *toks[:-1]]

    def fwd(p, b):
        return np.asarray(jax.jit(lambda: draft_forward(
            dcfg, jax.tree.map(jnp.asarray, p), jax.tree.map(jnp.asarray, b), jax.tree.map(jnp.asarray, shared),
            jnp.asarray(tokens[None]), jnp.asarray(feats[None]), jnp.asarray(markov[None]), block=4))()[0])[0]

    shipped, master = fwd(dec_p, dec_b), fwd(params, buffers)
    for p, (_, logits) in got.items():
        scale = np.abs(logits).max()
        # the file holds exactly the decoded values: the engine on it is the float forward on them
        np.testing.assert_allclose(shipped[p], logits, atol=1e-4 * scale, rtol=0)
        # and the float master copy differs by quantization only (MXFP4 experts, Q8_0 matrices)
        err = np.abs(master[p] - logits).mean() / np.abs(logits).mean()
        assert err < 0.1, err
    agree = np.mean([(master[p].argmax(-1) == got[p][0]).mean() for p in anchors])
    assert agree >= 0.6, agree


@pytest.mark.slow
def test_tiny_run_draft_end_to_end(tmp_path):
    """The whole pipeline on the tiny checkpoint: trains, exports, and its speculative output is plain decode's."""
    from experiments.train import run_draft
    from jds41.decode_loop import greedy_generate
    from jds41.engine import Engine
    from jds41.speculative import SpeculativeSession

    out = tmp_path / "out"
    rc = run_draft.main(["--size", "tiny", "--out", str(out), "--time-budget-s", "140", "--max-steps", "30",
                         "--max-train-mb", "0.5", "--prompts", "2", "--identical", "2", "--new-tokens", "24"])
    assert rc == 0
    manifest = json.loads((out / "tiny-deepseek41-q8-dspark-manifest.json").read_text())
    assert manifest["stage"] == "done" and manifest["training"]["steps"] == 30
    acc = manifest["acceptance"]
    assert acc["all_identical"] is True and acc["identical_checked"] >= 1
    assert acc["drafted"] > 0 and 1.0 <= acc["tokens_per_step"] <= 1 + manifest["config"]["block_size"]
    draft = out / manifest["draft"]
    assert manifest["files"][manifest["draft"]]["bytes"] == draft.stat().st_size
    lines = [json.loads(x) for x in (out / "draft_log.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "done"
    # independently of the run's own check: the written file drafts, and the tokens are plain greedy decode's
    engine = Engine.open(TINY_MODEL, max_ctx=96)
    prompt = [1] + list(range(40, 60))
    spec = SpeculativeSession(engine, DSparkDrafter.open(engine, str(draft)))
    got = list(spec.generate(prompt, 24))
    plain = engine.session()
    assert got == greedy_generate(plain, int(np.argmax(plain.feed(prompt))), 24)
