"""Synthetic model files, presets and Engram hash parameters.

A synthetic file stands in for a real checkpoint only if it is one in every checkable respect: the schema's
tensors in order with the right shapes and types, 4096-aligned data, metadata that reads back as the same
ModelConfig, a tokenizer llama.cpp's gpt2 loader can build (every merge's parts and result are tokens), and the
Engram hash parameters of MODEL.md §3 (the full V4.1 row counts are the published ones).
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from reference.numpy_engram import engram_row_ids

from jds41 import engram_hash as eh
from jds41.checkpoints import presets, synth, synth_tokenizer
from jds41.checkpoints.presets import preset, with_engram_rows
from jds41.checkpoints.schema import model_tensors
from jds41.config import ModelConfig

MODELS = [("deepseek4", "tiny"), ("deepseek41", "tiny"), ("deepseek41", "tiny-shared")]


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """GGUF key/values as plain Python values (what ModelConfig.from_metadata takes)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    paths = {}
    for arch, size in MODELS:
        for quant in synth.QUANTS:
            paths[arch, size, quant] = out / f"{arch}-{size}-{quant}.gguf"
            synth.write_synthetic(paths[arch, size, quant], preset(arch, size), quant=quant, seed=0, progress=False)
    return paths


@pytest.mark.parametrize("quant", synth.QUANTS)
@pytest.mark.parametrize(("arch", "size"), MODELS)
def test_file_matches_schema_and_config(files, arch, size, quant):
    cfg = preset(arch, size)
    path = files[arch, size, quant]
    r = gguf.GGUFReader(path)
    specs = model_tensors(cfg)
    assert [t.name for t in r.tensors] == list(specs)  # exactly the schema, in its order
    types, fallback = synth.choose_types(cfg, quant)
    end = 0
    for t in r.tensors:
        spec = specs[t.name]
        assert tuple(int(x) for x in reversed(t.shape)) == spec.shape, t.name  # reader gives ggml ne order
        assert t.tensor_type == types[t.name], t.name
        assert t.tensor_type in spec.allowed_types, t.name
        assert t.data_offset % 4096 == 0, t.name
        assert t.n_bytes == synth.tensor_nbytes(spec.shape, t.tensor_type)
        end = max(end, t.data_offset + t.n_bytes)
    assert path.stat().st_size == gguf.GGUFWriter.ggml_pad(end, 4096)
    meta = read_metadata(r)
    assert meta["general.alignment"] == 4096
    assert ModelConfig.from_metadata(meta, str(path)) == cfg
    assert meta["jds41.synthetic.quant"] == quant
    if quant == "ds4-q2":  # tiny rows (32/64 wide) fit no 256-block type: every routed expert falls back
        assert sorted(fallback) == sorted(n for n, s in specs.items() if s.kind.value == "experts")
        assert meta["jds41.synthetic.fallback_q8_0"] == fallback
    else:
        assert not fallback


def test_layout_types():
    cfg = preset("deepseek4", "full", layers=4)  # real widths: 256-multiples everywhere
    types, fallback = synth.choose_types(cfg, "ds4-q2")
    assert not fallback
    assert types["blk.3.ffn_gate_exps.weight"] == T.IQ2_XXS and types["blk.3.ffn_down_exps.weight"] == T.Q2_K
    assert types["blk.3.attn_q_b.weight"] == T.Q8_0 and types["token_embd.weight"] == T.Q8_0
    assert types["blk.3.ffn_up_shexp.weight"] == T.Q8_0 and types["output.weight"] == T.Q8_0
    assert types["blk.2.indexer.attn_q_b.weight"] == T.F16 and types["blk.3.attn_compressor_kv.weight"] == T.F16
    assert types["blk.3.hc_ffn_fn.weight"] == T.F16 and types["blk.3.attn_compressor_norm.weight"] == T.F32
    assert types["blk.0.ffn_gate_tid2eid.weight"] == T.I32 and types["output_norm.weight"] == T.F32
    types, _ = synth.choose_types(cfg, "mxfp4")
    assert types["blk.3.ffn_down_exps.weight"] == T.MXFP4 and types["blk.3.attn_kv.weight"] == T.Q8_0
    assert types["blk.3.attn_sinks.weight"] == T.F32


def test_two_bit_experts(tmp_path):
    """Rows of 256 give the real ds4-q2 expert types; their decoded values keep the N(0, 1/fan_in) spread."""
    cfg = dataclasses.replace(preset("deepseek4", "tiny"), dim=256, expert_ff=256)
    path = tmp_path / "q2.gguf"
    info = synth.write_synthetic(path, cfg, "ds4-q2", progress=False, tokenizer="none")
    assert not info["fallback_q8_0"]
    r = gguf.GGUFReader(path)
    assert ModelConfig.from_metadata(read_metadata(r)) == cfg
    for t in r.tensors:
        if t.name.endswith("_exps.weight"):
            assert t.tensor_type == (T.Q2_K if "down" in t.name else T.IQ2_XXS)
            x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            assert np.isfinite(x).all() and 0.7 < x.std() * np.sqrt(256) < 1.4, t.name


def test_values_are_sane(files):
    cfg = preset("deepseek41", "tiny")
    r = gguf.GGUFReader(files["deepseek41", "tiny", "f32"])
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    tid = t["blk.0.ffn_gate_tid2eid.weight"]
    assert tid.shape == (cfg.vocab_size, cfg.n_experts_used) and tid.min() >= 0 and tid.max() < cfg.n_experts
    assert all(len(set(row)) == cfg.n_experts_used for row in tid.tolist())  # distinct experts per token
    rows = t["blk.1.engram_embd.weight"].view(np.uint8)
    hd = cfg.engram.head_dim
    assert rows.shape == (cfg.engram.rows[0], cfg.engram.row_bytes)
    assert not np.isin(rows[:, :hd], [0x7F, 0xFF]).any()  # no E4M3 NaN
    assert rows[:, hd:].min() >= 125 and rows[:, hd:].max() <= 128  # E8M0 scales near 2^0
    assert abs(t["blk.0.attn_norm.weight"].mean() - 1) < 0.05
    q_b = t["blk.0.attn_q_b.weight"]
    assert 0.7 < q_b.std() * np.sqrt(q_b.shape[-1]) < 1.3  # N(0, 1/fan_in)
    assert np.abs(t["blk.2.exp_probs_b.bias"]).max() < 0.1


def test_streaming_does_not_change_bytes(tmp_path, monkeypatch):
    cfg = preset("deepseek41", "tiny")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    synth.write_synthetic(a, cfg, "f32", seed=3, progress=False, tokenizer="none")
    monkeypatch.setattr(synth, "CHUNK_BYTES", 1000)  # many chunks per tensor, most rows split across calls
    synth.write_synthetic(b, cfg, "f32", seed=3, progress=False, tokenizer="none")
    assert a.read_bytes() == b.read_bytes()


def test_tokenizer_metadata(files):
    cfg = preset("deepseek4", "tiny")
    meta = read_metadata(gguf.GGUFReader(files["deepseek4", "tiny", "q8"]))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == meta["deepseek4.vocab_size"] == cfg.vocab_size
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "deepseek-v3"
    assert tokens[meta["tokenizer.ggml.bos_token_id"]] == "<｜begin▁of▁sentence｜>"
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<｜end▁of▁sentence｜>"
    assert [tokens[i] for i, ty in enumerate(types) if ty == 3] == list(synth_tokenizer.SPECIAL_TOKENS)
    vocab = set(tokens)
    assert len(vocab) == len(tokens)
    for m in meta["tokenizer.ggml.merges"]:  # a valid BPE: both parts and their concatenation are tokens
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab, m
    for special in ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"):
        assert special in meta["tokenizer.chat_template"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(meta["tokenizer.huggingface.json"])
    text = "The café costs 12345 dollars.\n\tdef f(x): return x"
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.id_to_token(i) for i in range(len(tokens))] == tokens


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_synthetic_tokenizer_counts(size):
    v, c = presets.VOCAB[size], presets.COMPRESSED_VOCAB[size]
    tok = synth_tokenizer.build_tokenizer(v, c)
    tmap, n = eh.tokenizer_token_map(tok)
    assert tok.get_vocab_size(with_added_tokens=True) == v and n == c and tmap.max() == c - 1


def test_token_map(files):
    cfg = preset("deepseek41", "tiny")
    meta = read_metadata(gguf.GGUFReader(files["deepseek41", "tiny", "q8"]))
    tmap = np.asarray(meta["deepseek41.engram.token_map"])
    assert tmap.shape == (cfg.vocab_size,) and tmap.min() == 0
    assert tmap.max() + 1 == meta["deepseek41.engram.compressed_vocab_size"] == presets.compressed_vocab(512)
    tok = synth_tokenizer.build_tokenizer(512, presets.compressed_vocab(512))
    keys = eh.token_keys([tok.decode([i], skip_special_tokens=False) for i in range(512)],
                         [tok.id_to_token(i) for i in range(512)])
    for i in range(512):  # ids share a compressed id exactly when their keys are equal
        assert (tmap == tmap[i]).nonzero()[0].tolist() == [j for j in range(512) if keys[j] == keys[i]]
    vocab = tok.get_vocab()
    spaced = [(vocab[t], vocab["Ġ" + t]) for t in vocab if "Ġ" + t in vocab and t[0] != "Ġ" and len(t) > 1]
    assert spaced and all(tmap[a] == tmap[b] for a, b in spaced)  # the leading space is stripped
    # without a tokenizer the map is id mod compressed vocab
    assert (synth.token_map_for(cfg, None) == np.arange(512) % presets.compressed_vocab(512)).all()


def test_normalization_rules():
    decoded = ["Café", "cafe", " CAFÉ\n", " ", "\t", "a\ufffd", "a\ufffd", "x  y", "x y", ""]
    raw = ["Café", "cafe", "ĠCAFÃĠ", "Ġ", "ĉ", "aÃ", "aÄ", "xĠĠy", "xĠy", "<e>"]
    keys = eh.token_keys(decoded, raw)
    assert keys[0] == keys[1] == keys[2] == "cafe"
    assert keys[3] == keys[4] == " "  # a whitespace-only token keeps one space (sentinel), not ""
    assert keys[5] == "aÃ" and keys[6] == "aÄ"  # U+FFFD: raw token string
    assert keys[7] == keys[8] == "x y" and keys[9] == ""
    tmap, n = eh.compressed_token_map(decoded, raw)
    assert tmap.tolist() == [0, 0, 0, 1, 1, 2, 3, 4, 4, 5] and n == 6


def test_full_v41_engram_rows():
    e = preset("deepseek41", "full").engram
    assert e.layer_ids == (1, 14) and e.rows == (384_006_168, 384_016_682)
    assert e.row_bytes == 264 and e.n_buckets == 24
    bound = eh.INT64_MAX // 99092 // 2
    for li in range(2):
        assert list(e.offsets[li]) == [sum(e.primes[li][:j]) for j in range(24)]
        assert all(m % 2 == 1 and m < 2 * bound for m in e.multipliers[li])
    flat = [p for ps in e.primes for p in ps]
    assert len(set(flat)) == 48 and min(flat) > 15_999_999 and all(eh.is_prime(p) for p in flat)
    assert e.multipliers[0] == tuple(eh.engram_multipliers(1, 4, 99092))
    assert preset("deepseek41", "full", layers=2).engram.rows == (384_006_168,)


def test_miller_rabin():
    sieve = np.ones(20000, bool)
    sieve[:2] = False
    for i in range(2, 142):
        sieve[i * i::i] = False
    assert [n for n in range(20000) if eh.is_prime(n)] == np.nonzero(sieve)[0].tolist()
    assert eh.is_prime((1 << 61) - 1) and eh.is_prime((1 << 64) - 59)
    for n in (561, 1105, 3215031751, 3825123056546413051, (1 << 64) - 1):  # Carmichael / strong pseudoprimes
        assert not eh.is_prime(n)
    assert eh.next_prime(13) == 17 and eh.next_prime(13, {17}) == 19


def test_small_preset_rows_in_buckets():
    """Row ids of the small preset's Engram layers stay inside each (order, head) bucket of the table."""
    e = preset("deepseek41", "small").engram
    token_map = np.random.default_rng(0).integers(0, presets.compressed_vocab(8192), size=8192)
    tokens = np.random.default_rng(1).integers(0, 8192, size=300)
    for li, layer in enumerate(e.layer_ids):
        rows = engram_row_ids(e, layer, tokens, token_map)
        lo, hi = np.asarray(e.offsets[li]), np.asarray(e.offsets[li]) + np.asarray(e.primes[li])
        assert rows.shape == (300, e.n_buckets) and (rows >= lo).all() and (rows < hi).all()


def test_presets_constraints():
    for size in ("tiny", "small", "full"):
        c = preset("deepseek4", size)
        assert set(c.compress_ratios) <= {0, 4, 128} and c.index_head_dim % 64 == 0 and c.hc_mult == 4
        assert c.n_heads % c.o_groups == 0 and c.rope_dim <= min(c.head_dim, c.index_head_dim)
    assert preset("deepseek4", "tiny").index_n_heads >= 16
    for arch in ("deepseek4", "deepseek41"):
        for size in ("tiny", "small"):
            c = preset(arch, size)
            widths = [s.shape[-1] for s in model_tensors(c).values() if s.kind.value in ("matrix", "experts")]
            assert all(w % 32 == 0 for w in widths), (arch, size)  # Q8_0 / MXFP4 everywhere
            assert c.vocab_size == presets.VOCAB[size]
    full = preset("deepseek4", "full")
    assert (full.n_layers, full.vocab_size, full.dim, full.n_hash_layers) == (43, 129280, 4096, 3)
    assert full.compress_ratios[:4] == (0, 0, 4, 128) and full.compress_ratios[-1] == 4
    assert preset("deepseek4", "tiny", nextn=1).compress_ratios == (0, 4, 128, 0, 0)


def test_truncation():
    c = preset("deepseek41", "full", layers=21)
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,)
    assert c.kv_source_layer_ids == (2, 8, 14, 20) and c.index_source_layer_ids == (2, 8, 14, 20)
    assert c.candidate_source_layer_id == 20 and c.engram.layer_ids == (1, 14) and c.dspark.target_layer_ids[-1] == 20
    c = preset("deepseek41", "full", layers=14)
    assert c.candidate_source_layer_id == -1 and c.engram.layer_ids == (1,) and c.kv_source_layer_ids == (2, 8)
    c = preset("deepseek41", "full", layers=1)
    assert c.engram is None and not c.shared_kv
    assert preset("deepseek4", "full", layers=2).n_hash_layers == 2
    shared = preset("deepseek41", "tiny-shared")
    assert shared.shared_kv and shared.candidate_source_layer_id == 6 and shared.kv_source(5) == 3
    with pytest.raises(ValueError):
        preset("deepseek4", "tiny-shared")
    with pytest.raises(ValueError):
        preset("deepseek4", "tiny", layers=9)


def test_engram_rows_option(tmp_path):
    cfg = with_engram_rows(preset("deepseek41", "full", layers=2), 1_000_000)
    assert abs(cfg.engram.rows[0] - 1_000_000) < 10_000
    assert cfg.engram.multipliers == preset("deepseek41", "full").engram.multipliers[:1]
    tiny = with_engram_rows(preset("deepseek41", "tiny"), 1000)
    path = tmp_path / "e.gguf"
    synth.main(["--arch", "deepseek41", "--size", "tiny", "--engram-rows", "1000", "--tokenizer", "none",
                "--quant", "q8", "--quiet", "--out", str(path)])
    r = gguf.GGUFReader(path)
    meta = read_metadata(r)
    assert meta["tokenizer.ggml.model"] == "none" and "tokenizer.ggml.tokens" not in meta
    assert ModelConfig.from_metadata(meta) == tiny
    embd = next(t for t in r.tensors if t.name == "blk.1.engram_embd.weight")
    assert tuple(reversed(embd.shape.tolist())) == (tiny.engram.rows[0], 33)
    assert json.loads(json.dumps(meta["deepseek41.engram.token_map"]))[:3] == [0, 1, 2]


def test_fast_files_keep_the_layout_and_cycle_a_pool_of_experts(tmp_path, monkeypatch):
    """--fast (speed benchmarks): same tensors, types and shapes as a normal file; experts repeat a pool of
    FAST_EXPERT_POOL distinct random experts; Q8_0 matrices dequantize to std ~1/sqrt(fan_in)."""
    from jds41.checkpoints import open_model
    from jds41.quant import dequantize

    monkeypatch.setattr(synth, "FAST_EXPERT_POOL", 3)  # tiny has 8 experts per layer
    cfg = preset("deepseek41", "tiny")
    normal, fast = tmp_path / "normal.gguf", tmp_path / "fast.gguf"
    synth.write_synthetic(normal, cfg, quant="q8", progress=False)
    synth.write_synthetic(fast, cfg, quant="q8", progress=False, fast=True)
    a, b = open_model(normal), open_model(fast)  # open_model validates the whole file
    assert {n: (t.ggml_type, t.shape) for n, t in a.tensors.items()} == \
           {n: (t.ggml_type, t.shape) for n, t in b.tensors.items()}
    pool = synth.FAST_EXPERT_POOL
    n_exp = b.tensors["blk.0.ffn_up_exps.weight"].shape[0]
    experts = np.asarray(b.raw("blk.0.ffn_up_exps.weight")).reshape(n_exp, -1)
    assert n_exp > pool
    for e in range(pool, n_exp):
        np.testing.assert_array_equal(experts[e], experts[e - pool])
    assert len({experts[e].tobytes() for e in range(pool)}) == pool
    w = np.asarray(dequantize(b.raw("blk.0.attn_q_b.weight"), T.Q8_0, b.tensors["blk.0.attn_q_b.weight"].shape))
    assert abs(w.std() * np.sqrt(w.shape[-1]) - 1.0) < 0.1


def test_fast_mxfp4_blocks_are_valid_weights_of_the_asked_spread(tmp_path):
    """--fast MXFP4 (the V4-Flash benchmark files): random codes under one power-of-two scale. gguf-py's own
    dequantizer (an independent reading of the block layout) gives finite values whose std is within a factor of
    sqrt(2) of 1/sqrt(fan_in), for experts and dense matrices alike, and the file keeps a normal file's layout."""
    from jds41.checkpoints import open_model

    cfg = preset("deepseek4", "tiny")
    normal, fast = tmp_path / "normal.gguf", tmp_path / "fast.gguf"
    synth.write_synthetic(normal, cfg, quant="mxfp4", progress=False)
    synth.write_synthetic(fast, cfg, quant="mxfp4", progress=False, fast=True)
    a, b = open_model(normal), open_model(fast)
    assert {n: (t.ggml_type, t.shape) for n, t in a.tensors.items()} == \
           {n: (t.ggml_type, t.shape) for n, t in b.tensors.items()}
    mxfp4 = [n for n, t in b.tensors.items() if t.ggml_type == T.MXFP4]
    assert any("_exps." in n for n in mxfp4)
    for name in mxfp4:
        t = b.tensors[name]
        w = gguf.quants.dequantize(np.asarray(b.raw(name)).reshape(-1), T.MXFP4).reshape(-1, t.shape[-1])
        assert np.isfinite(w).all(), name
        spread = w.std() * np.sqrt(t.shape[-1])
        assert 2 ** -0.5 <= spread <= 2 ** 0.5, (name, spread)
