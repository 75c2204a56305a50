"""Export of trained float weights to a deepseek41 GGUF split set, read back by jds41 and gguf-py.

The exported file must open through `jds41.checkpoints.open_model` from any shard, validate, hold the planned
storage types and byte count, carry a tokenizer that `jds41.tokenizer` and gguf-py read as llama.cpp does, and
make `jds41.engine.Engine` give the training forward's logits for the decoded (shipped) weights.
"""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from experiments.train.export import plan_bytes, quantized_tensors, split_limit, storage_types, write_gguf
from experiments.train.forward import engram_ids_batch, forward
from experiments.train.model_config import build_config, fit_engram
from experiments.train.params import init_params
from experiments.train.tokenizer import train_tokenizer
from jds41.checkpoints import open_model, synth_tokenizer
from jds41.checkpoints.reader import SHARD_NAME
from jds41.checkpoints.schema import model_tensors
from jds41.checkpoints.synth import tensor_nbytes
from jds41.engine import Engine
from jds41.engram_hash import tokenizer_token_map
from jds41.layers.engram_rows import EngramHasher
from jds41.tokenizer import Tokenizer

CODE = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i, i * 2)\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    texts = synth_tokenizer.corpus(150_000) + CODE * 50
    tok = train_tokenizer(texts, 512)
    token_map, n_classes = tokenizer_token_map(tok)
    cfg = build_config("tiny", 512, n_classes, 64)
    params, buffers = init_params(cfg, seed=1)
    rng = np.random.default_rng(2)
    for blk in params["blocks"]:
        blk["attn_sinks"] = rng.standard_normal(blk["attn_sinks"].shape).astype(np.float32)
    stored, types, dec_p, dec_b = quantized_tensors(cfg, params, buffers, "mxfp4")
    out = tmp_path_factory.mktemp("export")
    paths = write_gguf(out / "m.gguf", cfg, stored, types, tok, token_map,
                       {"jds41.train.seq_len": (64, "u32")}, split_max_bytes=150_000)
    return {"cfg": cfg, "tok": tok, "token_map": token_map, "params": params, "buffers": buffers,
            "dec_p": dec_p, "dec_b": dec_b, "types": types, "paths": paths}


def test_split_set_opens_from_any_shard_with_planned_types_and_bytes(exported):
    paths, cfg = exported["paths"], exported["cfg"]
    assert len(paths) >= 3 and all(SHARD_NAME.match(os.path.basename(p)) and os.path.isfile(p) for p in paths)
    with open_model(paths[-1]) as m:
        assert m.config == cfg
        assert sum(t.n_bytes for t in m.tensors.values()) == plan_bytes(cfg, "mxfp4")["total"]
        types = {n: t.ggml_type for n, t in m.tensors.items()}
    assert types == exported["types"]
    assert types["blk.0.ffn_gate_exps.weight"] == T.MXFP4 and types["blk.0.attn_q_a.weight"] == T.Q8_0
    assert types["blk.0.hc_attn_fn.weight"] == T.F16 and types["blk.1.attn_compressor_kv.weight"] == T.F16
    assert types["blk.0.attn_norm.weight"] == T.F32 and types["blk.1.engram_embd.weight"] == T.I8


@pytest.mark.slow
def test_engine_on_the_file_gives_the_training_forward_logits(exported):
    cfg = exported["cfg"]
    tokens = np.random.default_rng(7).integers(8, cfg.vocab_size, 64)
    engine = Engine.open(exported["paths"][0], max_ctx=64)
    got = engine.session().feed(tokens.tolist(), all_logits=True)
    hasher = EngramHasher(cfg.engram, exported["token_map"])
    ids = jnp.asarray(engram_ids_batch(hasher, tokens[None]))
    fwd = jax.jit(lambda p, b: forward(cfg, p, b, jnp.asarray(tokens[None], jnp.int32), ids, block=4)[0][0])
    shipped = np.asarray(fwd(jax.tree.map(jnp.asarray, exported["dec_p"]), jax.tree.map(jnp.asarray,
                                                                                           exported["dec_b"])))
    scale = np.abs(shipped).max()
    np.testing.assert_allclose(got, shipped, atol=1e-4 * scale, rtol=0)
    # against the float master weights the only gap is quantization: small, and mostly the same argmax
    master = np.asarray(fwd(jax.tree.map(jnp.asarray, exported["params"]), jax.tree.map(jnp.asarray,
                                                                                          exported["buffers"])))
    gap = np.abs(master - got).mean() / np.abs(master).mean()
    assert 0 < gap < 0.15
    assert (master.argmax(-1) == got.argmax(-1)).mean() > 0.6


def test_tokenizer_in_the_file_reads_like_the_trained_one(exported):
    tok, paths = exported["tok"], exported["paths"]
    with open_model(paths[0]) as m:
        jt = Tokenizer.from_metadata(m.metadata, paths[0])
    for text in CODE + ["Mixed text: naïve café, 12345 tokens\n\tend"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert jt.encode(text, add_bos=False, parse_special=False) == ids
        assert jt.decode(ids) == text
    reader = gguf.GGUFReader(paths[0])
    field = reader.fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == exported["cfg"].vocab_size
    types = reader.fields["tokenizer.ggml.token_type"]
    assert [int(types.parts[i][0]) for i in types.data[:8]] == [3] * 8  # special tokens are CONTROL
    assert len(reader.fields["tokenizer.ggml.merges"].data) == exported["cfg"].vocab_size - 256 - 8


def test_fit_engram_fills_the_budget_and_refuses_what_cannot_fit():
    small = fit_engram("small", 8192, 6000, 54 * 2**20, expert_ff=64)
    total = plan_bytes(small)["total"]
    assert total <= 54 * 2**20 and small.engram.rows[0] > 100_000
    bigger = build_config("small", 8192, 6000, small.engram.primes[0][-1] + 50, expert_ff=64)
    assert plan_bytes(bigger)["total"] > 54 * 2**20  # the next larger tables would not fit
    with pytest.raises(ValueError, match="budget"):
        fit_engram("small", 8192, 6000, 40 * 2**20)  # I = 96 experts alone are 38 MiB


def test_split_limit_gives_the_fewest_even_shards_under_the_cap():
    cfg = fit_engram("small", 8192, 6000, 54 * 2**20, expert_ff=64)
    types = storage_types(cfg)
    sizes = [tensor_nbytes(s.shape, types[n]) for n, s in model_tensors(cfg).items()]
    cap = int(14.5 * 2**20)

    def shards(limit):  # gguf-py's rule: a new shard when the next tensor would pass the limit
        out = [0]
        for x in sizes:
            if out[-1] and out[-1] + x > limit:
                out.append(0)
            out[-1] += x
        return out

    got = shards(split_limit(cfg, types, cap))
    assert len(got) == -(-sum(sizes) // cap) == 4 and max(got) <= cap


def test_evaluate_cli_backends_agree_on_bits_per_byte(exported, tmp_path, capsys):
    """The batched training-forward evaluation (how the whole held-out set is reproduced on a CPU) and the
    engine's token-by-token evaluation score the same file alike (they differ in float summation order only)."""
    import json

    from experiments.train import evaluate

    docs = [{"kind": "code", "source": f"c{i}.py", "text": CODE[i % 3] * 6} for i in range(3)]
    docs.append({"kind": "prose", "source": "p.txt", "text": "Plain English words about the weather today. " * 5})
    heldout = str(tmp_path / "heldout.jsonl.xz")
    evaluate.write_heldout(heldout, docs)
    got = {}
    for backend in ("engine", "forward"):
        assert evaluate.main([exported["paths"][0], heldout, "--max-bytes", "0", "--backend", backend,
                              "--batch", "2"]) == 0
        got[backend] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval"]
    for kind in ("code", "prose"):
        e, f = got["engine"][kind], got["forward"][kind]
        assert e["tokens"] == f["tokens"] > 0 and e["bytes"] == f["bytes"]
        np.testing.assert_allclose(f["bits_per_byte"], e["bits_per_byte"], rtol=1e-4)
    assert len(got["forward"]["code"]["expert_skew_top10pct"]) == exported["cfg"].n_layers
