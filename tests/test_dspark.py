"""DSpark draft tensors and files (schema, synth writer, validator) and the draft block's structural properties.

- schema: the `mtp.{s}.*` stages replace the trailing blocks; shapes follow the config (the draft's own expert
  pool, n_targets*D main projection, rank-wide Markov heads); files without draft stages keep their directory;
- synth + reader: a model with in-file stages and a separate draft file both validate; the draft file holds
  exactly the stages, byte-identical to the in-file ones of the same seed; broken draft files fail by name;
- a draft file made for another target is refused, naming what differs;
- the draft block: non-causal within the block (row 0 depends on the later noise rows), uses the injected target
  features, and its Markov term is markov_head @ markov_embd[previous token] (checked against numpy).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from gguf_surgery import DROP, copy_model

from jds41.checkpoints import open_model
from jds41.checkpoints.presets import preset
from jds41.checkpoints.schema import draft_expert_counts, draft_stages, draft_tensors, model_tensors
from jds41.checkpoints.synth import write_synthetic
from jds41.config import ModelConfig
from jds41.errors import ConfigError, Jds41Error, ModelFileError
from jds41.layers import dspark

ARCHS = ("deepseek4", "deepseek41")


@pytest.mark.parametrize("arch", ARCHS)
def test_schema_draft_stages(arch):
    plain = preset(arch, "tiny")
    cfg = preset(arch, "tiny", draft_stages=2)
    assert draft_stages(plain) == 0 and not draft_tensors(plain)
    assert not any(n.startswith("mtp.") for n in model_tensors(plain))
    specs = model_tensors(cfg)
    main = {n: s for n, s in specs.items() if not n.startswith("mtp.")}
    assert main == model_tensors(plain)  # the target part is unchanged; no blk.N for the stages
    draft = draft_tensors(cfg)
    assert set(specs) - set(main) == set(draft)
    E, K = draft_expert_counts(cfg)
    assert (E, K) == (cfg.dspark.n_experts, cfg.dspark.n_experts_used) and E != cfg.n_experts
    D, V, r = cfg.dim, cfg.vocab_size, cfg.dspark.markov_rank
    assert draft["mtp.0.main_proj.weight"].shape == (D, len(cfg.dspark.target_layer_ids) * D)
    for s in range(2):
        assert draft[f"mtp.{s}.ffn_gate_exps.weight"].shape == (E, cfg.expert_ff, D)
        assert draft[f"mtp.{s}.exp_probs_b.bias"].shape == (E,)
        assert f"mtp.{s}.ffn_gate_tid2eid.weight" not in draft  # never hash-routed
        assert not any(f"mtp.{s}.{x}" in n for x in ("compressor", "indexer", "engram") for n in draft)
    assert draft["mtp.1.markov_embd.weight"].shape == (V, r) and draft["mtp.1.conf_proj.weight"].shape == (1, D + r)
    assert "mtp.0.markov_head.weight" not in draft and "mtp.1.main_proj.weight" not in draft


def test_config_round_trip_and_default_draft_experts():
    cfg = preset("deepseek41", "tiny", draft_stages=2)
    meta = dict((k, v) for k, v, _ in cfg.to_metadata())
    assert ModelConfig.from_metadata(meta) == cfg
    del meta["deepseek41.dspark.expert_count"], meta["deepseek41.dspark.expert_used_count"]
    old = ModelConfig.from_metadata(meta)
    assert draft_expert_counts(old) == (cfg.n_experts, cfg.n_experts_used)
    # The shipped presets' keys are unchanged (no expert keys without draft stages).
    assert preset("deepseek41", "tiny").dspark.n_experts is None and preset("deepseek4", "tiny").dspark is None
    bad = {**dict((k, v) for k, v, _ in cfg.to_metadata()), "deepseek41.dspark.expert_used_count": 9}
    with pytest.raises(ConfigError, match="dspark.expert_used_count"):
        ModelConfig.from_metadata(bad)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    out = {}
    for arch in ARCHS:
        cfg = preset(arch, "tiny", draft_stages=2)
        model, draft = root / f"{arch}.gguf", root / f"{arch}-draft.gguf"
        write_synthetic(model, cfg, quant="q8", progress=False)
        write_synthetic(draft, cfg, quant="q8", progress=False, draft_only=True)
        out[arch] = (model, draft)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_synth_draft_files_validate_and_match(files, arch):
    model_path, draft_path = files[arch]
    with open_model(model_path) as m, open_model(draft_path) as d:
        assert draft_stages(m.config) == 2 and d.config == m.config
        assert d.metadata[f"{arch}.dspark.standalone"] is True
        assert set(d.tensors) == set(draft_tensors(m.config))
        for name in d.tensors:
            assert np.array_equal(d.raw(name), m.raw(name)), name


def test_broken_draft_files_fail_by_name(files, tmp_path):
    _, draft_path = files["deepseek41"]
    out = tmp_path / "missing.gguf"
    copy_model(draft_path, out, tensors={"mtp.1.markov_head.weight": DROP})
    with pytest.raises(ModelFileError, match="mtp.1.markov_head.weight"):
        open_model(out)
    out = tmp_path / "extra.gguf"
    copy_model(draft_path, out, tensors={"blk.0.attn_norm.weight": (np.ones(64, np.float32), GGMLQuantizationType.F32)})
    with pytest.raises(ModelFileError, match="unknown tensor"):
        open_model(out)
    out = tmp_path / "nostages.gguf"
    copy_model(draft_path, out, keys={"deepseek41.nextn_predict_layers": (0, GGUFValueType.UINT32),
                                      "deepseek41.block_count": (4, GGUFValueType.UINT32)})
    with pytest.raises(ConfigError, match="dspark.standalone"):
        open_model(out)


def test_draft_for_another_target_is_refused(files, tmp_path):
    from jds41.speculative import check_compatible

    target = open_model(files["deepseek41"][0]).config
    other = dataclasses.replace(target, window=target.window * 2)
    with pytest.raises(Jds41Error, match="window"):
        check_compatible(other, target, "draft.gguf")
    check_compatible(dataclasses.replace(target, n_nextn=0, dspark=None,
                                         compress_ratios=target.compress_ratios[:target.n_layers]), target, "d.gguf")


@pytest.fixture(scope="module")
def drafter(files):
    with open_model(files["deepseek41"][1]) as d:
        cfg = d.config
        plan = dspark.make_draft_plan(cfg)
        params = dspark.load_draft_params(cfg, d)
    with open_model(files["deepseek41"][0]) as m:
        from jds41.quant import QTensor

        shared = {n: QTensor.from_raw(np.array(m.raw(f"{n}.weight")), m.tensors[f"{n}.weight"].ggml_type,
                                      m.tensors[f"{n}.weight"].shape) for n in ("token_embd", "output")}
    return plan, params, shared


def _propose(d, plan, state, last=11, pos=9):
    return dspark.propose(plan, d[1], d[2], state, jnp.int32(last), jnp.int32(pos))


def _injected(d, seed=0, n=8):
    plan, params, _ = d
    state = dspark.init_draft_state(plan)
    feats = np.random.default_rng(seed).standard_normal((n, len(plan.target_layer_ids), plan.cfg.dim), np.float32)
    return dspark.inject(plan, params, state, jnp.asarray(feats), jnp.int32(0), jnp.int32(n))


@pytest.mark.slow
def test_draft_block_is_non_causal_and_uses_features(drafter):
    plan = drafter[0]
    tokens, conf, logits = _propose(drafter, plan, _injected(drafter))
    B = plan.block_size
    assert tokens.shape == (B,) and logits.shape == (B, plan.cfg.vocab_size)
    assert np.all((np.asarray(conf) > 0) & (np.asarray(conf) < 1))
    assert [int(t) for t in tokens] == [int(t) for t in np.argmax(np.asarray(logits), axis=1)]
    # Non-causal: row 0 (the last token) sees the noise rows after it, so another noise id changes its logits.
    other = dataclasses.replace(plan, cfg=dataclasses.replace(
        plan.cfg, dspark=dataclasses.replace(plan.cfg.dspark, noise_token_id=plan.cfg.dspark.noise_token_id + 1)))
    _, _, logits2 = _propose(drafter, other, _injected(drafter))
    assert not np.array_equal(np.asarray(logits)[0], np.asarray(logits2)[0])
    # The injected features are read: other features, other logits; only `count` rows are injected.
    _, _, logits3 = _propose(drafter, plan, _injected(drafter, seed=1))
    assert not np.array_equal(np.asarray(logits), np.asarray(logits3))
    state = _injected(drafter, n=8)
    assert all(int((np.asarray(r["pos"]) >= 0).sum()) == min(8, plan.cfg.window) for r in state["rings"])
    part = dspark.inject(plan, drafter[1], dspark.init_draft_state(plan), jnp.zeros((4, 2, plan.cfg.dim)),
                         jnp.int32(5), jnp.int32(3))
    assert sorted(int(p) for p in np.asarray(part["rings"][0]["pos"]) if p >= 0) == [5, 6, 7]


def test_markov_term_matches_numpy(drafter):
    """logits_i - logits_i(with a zero Markov head) = markov_head @ markov_embd[tok_i], tok_0 = last."""
    plan, params, shared = drafter
    state = _injected(drafter)
    tokens, _, logits = _propose(drafter, plan, state, last=11)
    last = params["stages"][-1]
    zeroed = {"stages": params["stages"][:-1] + [{**last, "markov_head": jnp.zeros_like(last["markov_head"])}]}
    _, _, base = dspark.propose(plan, zeroed, shared, state, jnp.int32(11), jnp.int32(9))
    head, emb = np.asarray(last["markov_head"], np.float64), np.asarray(last["markov_embd"], np.float64)
    prev = [11] + [int(t) for t in tokens[:-1]]
    for i, t in enumerate(prev):
        np.testing.assert_allclose(np.asarray(logits[i]) - np.asarray(base[i]), head @ emb[t], rtol=1e-4, atol=1e-4)


def test_synth_cli_writes_a_matching_draft_file(tmp_path):
    from jds41.checkpoints import synth
    from jds41.speculative import check_compatible

    model, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    assert synth.main(["--arch", "deepseek4", "--size", "tiny", "--quant", "q8", "--out", str(model),
                       "--draft-out", str(draft), "--quiet"]) == 0
    with open_model(model) as m, open_model(draft) as d:
        assert draft_stages(m.config) == 0 and draft_stages(d.config) == 2
        check_compatible(m.config, d.config, str(draft))
