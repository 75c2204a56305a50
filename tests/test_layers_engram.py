"""Engram: host row ids (jds41/layers/engram_rows.py) and the in-graph combine (jds41/layers/engram.py).

References written here: the hash re-derived position by position with exact Python integers (reduced mod 2^64
after every product, the unsigned reading), row decoding straight from ml_dtypes, and the combine in float64 numpy.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from reference.numpy_engram import engram_row_ids

from jds41.checkpoints.presets import preset
from jds41.config import EngramConfig
from jds41.engram_hash import make_engram_config
from jds41.layers.engram import dequant_rows, engram_combine, engram_combine_T, head_dim_of
from jds41.layers.engram_rows import BLOCKED, EngramHasher, MmapRowSource, dequant_rows_np, read_step_rows
from jds41.quant import QTensor

M64 = (1 << 64) - 1


def hand_config(max_ngram=4, heads=3, layers=2, big_multipliers=True, seed=0) -> EngramConfig:
    """Small primes, and multipliers up to 2^63 so products wrap mod 2^64 (exercises the unsigned reading)."""
    rng = np.random.default_rng(seed)
    nb = (max_ngram - 1) * heads
    pool = [p for p in range(101, 2000) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
    chosen = rng.choice(pool, size=layers * nb, replace=False).tolist()
    primes = tuple(tuple(int(p) for p in chosen[i * nb:(i + 1) * nb]) for i in range(layers))
    offsets = tuple(tuple(int(sum(ps[:j])) for j in range(nb)) for ps in primes)
    hi = 1 << 63 if big_multipliers else 1 << 40
    mults = tuple(tuple(int(rng.integers(0, hi, dtype=np.uint64)) | 1 for _ in range(max_ngram))
                  for _ in range(layers))
    return EngramConfig(layer_ids=tuple(range(1, 1 + 3 * layers, 3)), n_heads=heads, head_dim=32,
                        max_ngram=max_ngram, pad_id=2, encoding="e4m3_e8m0_32", multipliers=mults, primes=primes,
                        offsets=offsets, rows=tuple(sum(p) for p in primes))


def brute_rows(e: EngramConfig, token_map, seq, p) -> list[list[int]]:
    """Rows of position p of `seq` (full sequence from its start; negative = blocked) with Python ints."""
    pad = int(token_map[e.pad_id])
    t = []
    blocked = False
    for k in range(e.max_ngram):
        i = p - k
        if i < 0 or seq[i] < 0:
            blocked = True
        t.append(pad if blocked else int(token_map[seq[i]]))
    out = []
    for li in range(len(e.layer_ids)):
        m = e.multipliers[li]
        h = (t[0] * m[0]) & M64
        rows = []
        for n in range(2, e.max_ngram + 1):
            h ^= (t[n - 1] * m[n - 1]) & M64
            for k in range(e.n_heads):
                b = (n - 2) * e.n_heads + k
                rows.append(h % e.primes[li][b] + e.offsets[li][b])
        out.append(rows)
    return out


@pytest.mark.parametrize("max_ngram,heads,big", [(4, 3, True), (3, 2, False), (2, 1, True)])
def test_row_ids_match_brute_force(max_ngram, heads, big):
    e = hand_config(max_ngram, heads, big_multipliers=big, seed=max_ngram)
    rng = np.random.default_rng(10 + max_ngram)
    vocab = 50
    token_map = rng.integers(0, 1 << 20, size=vocab)
    hasher = EngramHasher(e, token_map)
    seq = rng.integers(0, vocab, size=300)
    seq[[37, 38, 120, 299]] = BLOCKED  # dead tokens, including two in a row and the last one
    seq[[5, 6, 7]] = e.pad_id  # a real pad token is an ordinary token
    want = np.array([brute_rows(e, token_map, seq, p) for p in range(len(seq))], dtype=np.int64)
    got = hasher.row_ids_seq(seq)
    assert got.dtype == np.int64 and got.shape == (len(seq), len(e.layer_ids), e.n_buckets)
    np.testing.assert_array_equal(got, want)
    # newest-position form, with full and with minimal history
    for p in (0, 1, 2, 3, 36, 37, 39, 40, 121, 200, 299):
        np.testing.assert_array_equal(hasher.row_ids(seq[:p + 1]), want[p])
        np.testing.assert_array_equal(hasher.row_ids(seq[max(0, p - max_ngram + 1):p + 1]), want[p])
    # chunked: any split with the preceding tokens as history gives the same rows
    for a in (1, 2, 38, 150):
        np.testing.assert_array_equal(hasher.row_ids_seq(seq[a:], start_history=seq[:a]), want[a:])


def test_sequence_start_uses_pad():
    e = hand_config(4, 2)
    token_map = np.arange(100) * 7 + 3
    hasher = EngramHasher(e, token_map)
    pad = token_map[e.pad_id]
    np.testing.assert_array_equal(hasher.context(np.array([10, 11])),
                                  np.array([[73, pad, pad, pad], [80, 73, pad, pad]], dtype=np.uint64))
    # a blocked slot blocks everything older, even live tokens behind it
    np.testing.assert_array_equal(hasher.context(np.array([10, BLOCKED, 12, 13]))[3], [94, 87, pad, pad])
    # starting fresh equals a history of blocked tokens
    np.testing.assert_array_equal(hasher.row_ids_seq([10, 11]), hasher.row_ids_seq([10, 11], [BLOCKED] * 3))


def test_in_bound_parameters_agree_with_signed_reading():
    """Multipliers below (2^63-1)//vocab: uint64 hashing == the reference's signed int64 reading (floor mod)."""
    e = make_engram_config([1, 4], n_heads=4, head_dim=32, max_ngram=4, engram_vocab=20000, compressed_vocab=400)
    rng = np.random.default_rng(5)
    token_map = rng.integers(0, 400, size=512)
    seq = rng.integers(0, 512, size=400)
    got = EngramHasher(e, token_map).row_ids_seq(seq)
    for li, layer in enumerate(e.layer_ids):
        np.testing.assert_array_equal(got[:, li], engram_row_ids(e, layer, seq, token_map))


def test_full_v41_rows_in_bucket_ranges():
    e = preset("deepseek41", "full").engram
    assert e.layer_ids == (1, 14) and e.rows == (384006168, 384016682) and e.n_buckets == 24
    rng = np.random.default_rng(6)
    token_map = rng.integers(0, 99092, size=129280)
    token_map[:200] = 99091 - np.arange(200) * 495  # the largest compressed ids too
    seq = np.concatenate([rng.integers(0, 129280, size=3000), np.arange(200)])
    ids = EngramHasher(e, token_map).row_ids_seq(seq)
    for li in range(2):
        off = np.asarray(e.offsets[li])
        P = np.asarray(e.primes[li])
        assert np.all(ids[:, li] >= off) and np.all(ids[:, li] < off + P)
        assert ids[:, li].max() < e.rows[li]
    np.testing.assert_array_equal(ids[:, 1], engram_row_ids(e, 14, seq, token_map))


def test_hasher_rejects_bad_tokens():
    hasher = EngramHasher(hand_config(), np.arange(10))
    with pytest.raises(ValueError):
        hasher.row_ids_seq([3, 10])
    with pytest.raises(ValueError):
        hasher.row_ids([])


# ---- row bytes ----------------------------------------------------------------------------------------------------


def random_rows(rng, n, head_dim, scale_lo=110, scale_hi=140) -> np.ndarray:
    codes = rng.integers(0, 256, size=(n, head_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scales = rng.integers(scale_lo, scale_hi, size=(n, head_dim // 32), dtype=np.uint8)
    return np.concatenate([codes, scales], axis=1)


def test_dequant_matches_ml_dtypes():
    rng = np.random.default_rng(7)
    rows = random_rows(rng, 50, 64)
    rows[0, 64] = 127  # scale 2^0
    rows[1, :64] = np.arange(64)  # zero and every subnormal / small code
    want = np.empty((50, 64), np.float64)
    for r in range(50):
        for j in range(64):
            v = float(np.array([rows[r, j]], np.uint8).view(ml_dtypes.float8_e4m3fn)[0])
            want[r, j] = v * 2.0 ** (int(rows[r, 64 + j // 32]) - 127)
    np.testing.assert_array_equal(dequant_rows_np(rows, 64), want.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(dequant_rows(jnp.asarray(rows))), want.astype(np.float32))
    # int8 bytes (the GGUF I8 view) decode the same
    np.testing.assert_array_equal(np.asarray(dequant_rows(jnp.asarray(rows.view(np.int8)))), want)
    assert head_dim_of(264) == 256 and head_dim_of(33) == 32
    nan_row = rows[:1].copy()
    nan_row[0, 64] = 255
    assert np.isnan(np.asarray(dequant_rows(jnp.asarray(nan_row)))[0, :32]).all()
    assert np.isnan(dequant_rows_np(nan_row, 64)[0, :32]).all()


# ---- combine --------------------------------------------------------------------------------------------------


def ref_combine(x, rows, wkv, q_w, k_w, eps, active=True):
    H, D = x.shape
    E = dequant_rows_np(rows, head_dim_of(rows.shape[-1])).astype(np.float64).reshape(-1)
    kv = wkv.astype(np.float64) @ E
    k, v = kv[:H * D].reshape(H, D), kv[H * D:]
    x = x.astype(np.float64)
    out = x.copy()
    for c in range(H):
        dot = np.sum(x[c] * q_w[c] * k_w[c] * k[c])
        dot *= 1 / np.sqrt(np.mean(x[c] ** 2) + eps) / np.sqrt(np.mean(k[c] ** 2) + eps) / np.sqrt(D)
        g = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(max(abs(dot), 1e-6)))) if active else 0.0
        out[c] = x[c] + g * v
    return out


def combine_case(seed, H=4, D=64, nb=6, hd=32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, D)).astype(np.float32) * 3
    rows = random_rows(rng, nb, hd, 118, 126)
    wkv = (rng.standard_normal(((H + 1) * D, nb * hd)) / np.sqrt(nb * hd)).astype(np.float32)
    q_w = rng.standard_normal((H, D)).astype(np.float32)
    k_w = rng.standard_normal((H, D)).astype(np.float32)
    return x, rows, wkv, q_w, k_w


@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_combine_matches_float64(eps):
    x, rows, wkv, q_w, k_w = combine_case(8)
    q_w[1] = 0.0  # dot exactly 0 -> g = sigmoid(0)
    k_w[2] *= 1e-5  # |dot| below the 1e-6 floor
    got = np.asarray(jax.jit(engram_combine, static_argnums=5)(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(wkv),
                                                                jnp.asarray(q_w), jnp.asarray(k_w), eps))
    want = ref_combine(x, rows, wkv, q_w, k_w, eps)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not np.allclose(got, x)
    # inactive token: unchanged
    same = engram_combine(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(wkv), jnp.asarray(q_w), jnp.asarray(k_w),
                          eps, active=False)
    np.testing.assert_array_equal(np.asarray(same), x)


def test_combine_with_quantized_wkv():
    x, rows, wkv, q_w, k_w = combine_case(9)
    raw = gguf_quants.quantize(wkv, GGMLQuantizationType.Q8_0)
    w = QTensor.from_raw(raw, GGMLQuantizationType.Q8_0, wkv.shape)
    deq = gguf_quants.dequantize(raw, GGMLQuantizationType.Q8_0)
    got = np.asarray(engram_combine(jnp.asarray(x), jnp.asarray(rows), w, jnp.asarray(q_w), jnp.asarray(k_w), 1e-6))
    np.testing.assert_allclose(got, ref_combine(x, rows, deq, q_w, k_w, 1e-6), rtol=2e-5, atol=2e-5)
    w32 = QTensor.from_raw(wkv, GGMLQuantizationType.F32, wkv.shape)
    got32 = engram_combine(jnp.asarray(x), jnp.asarray(rows), w32, jnp.asarray(q_w), jnp.asarray(k_w), 1e-6)
    np.testing.assert_allclose(np.asarray(got32), ref_combine(x, rows, wkv, q_w, k_w, 1e-6), rtol=2e-5, atol=2e-5)


def test_combine_T_rows_equal_single_rows():
    T = 5
    cases = [combine_case(20 + t) for t in range(T)]
    _, _, wkv, q_w, k_w = cases[0]
    x = np.stack([c[0] for c in cases])
    rows = np.stack([c[1] for c in cases])
    active = np.array([True, True, False, True, True])
    fn_T = jax.jit(engram_combine_T, static_argnums=5)
    fn_1 = jax.jit(engram_combine, static_argnums=5)
    got = np.asarray(fn_T(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(wkv), jnp.asarray(q_w), jnp.asarray(k_w),
                          1e-6, jnp.asarray(active)))
    for t in range(T):
        one = np.asarray(fn_1(jnp.asarray(x[t]), jnp.asarray(rows[t]), jnp.asarray(wkv), jnp.asarray(q_w),
                              jnp.asarray(k_w), 1e-6, jnp.asarray(active[t])))
        # same per-row arithmetic: bit-identical on XLA:CPU (the verify-equals-decode requirement)
        np.testing.assert_array_equal(got[t], one)
        np.testing.assert_allclose(got[t], ref_combine(x[t], rows[t], wkv, q_w, k_w, 1e-6, active[t]),
                                   rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[2], x[2])


# ---- row source -----------------------------------------------------------------------------------------------


def test_mmap_row_source(tmp_path):
    e = hand_config(3, 2, layers=2)
    rng = np.random.default_rng(11)
    path = tmp_path / "tables.bin"
    header = 96  # tables at arbitrary offsets inside a file, as in a GGUF
    tables = [rng.integers(0, 256, size=(r, e.row_bytes), dtype=np.uint8) for r in e.rows]
    with open(path, "wb") as f:
        f.write(b"\0" * header)
        offs = []
        for t in tables:
            offs.append(f.tell())
            f.write(t.tobytes())
    src = MmapRowSource.from_file(str(path), offs, e)
    assert src.row_bytes == e.row_bytes == 33
    ids = np.array([5, 3, 5, 5, e.rows[1] - 1, 0, 3])
    got = src.read_rows(1, ids)
    np.testing.assert_array_equal(got, tables[1][ids])
    assert got.dtype == np.uint8 and (src.rows_requested, src.rows_read) == (7, 4)
    with pytest.raises(IndexError):
        src.read_rows(0, np.array([e.rows[0]]))
    with pytest.raises(IndexError):
        src.read_rows(0, np.array([-1]))

    # a whole step: [T, layers, buckets] through the hasher, one deduplicating read per layer
    hasher = EngramHasher(e, rng.integers(0, 1000, size=64))
    seq = np.array([1, 2, 1, 2, 1, 2, 9])
    ids = hasher.row_ids_seq(seq)
    step = read_step_rows(src, ids)
    assert step.shape == (7, 2, e.n_buckets, e.row_bytes)
    for li in range(2):
        np.testing.assert_array_equal(step[:, li], tables[li][ids[:, li]])

    # int8 views (the GGUF I8 tensor) and a model-like object with raw()
    class Model:
        def raw(self, name):
            layer = int(name.split(".")[1])
            return tables[e.layer_ids.index(layer)].view(np.int8)

    src2 = MmapRowSource.from_model(Model(), e)
    np.testing.assert_array_equal(src2.read_rows(0, np.array([[1, 2], [2, 1]])), tables[0][[[1, 2], [2, 1]]])
    with pytest.raises(ValueError):
        MmapRowSource([np.zeros((4, 33), np.uint8), np.zeros((4, 34), np.uint8)])
    with pytest.raises(ValueError):
        MmapRowSource([np.zeros((4, 33), np.float32)])


def test_host_side_does_not_import_jax():
    code = "import sys, jds41.layers.engram_rows; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rows_from_synthetic_gguf(tmp_path):
    """End to end on a written file: its token map and hash parameters, rows read through the GGUF reader."""
    from jds41.checkpoints import synth
    from jds41.checkpoints.reader import open_model

    cfg = preset("deepseek41", "tiny")
    path = tmp_path / "tiny41.gguf"
    synth.write_synthetic(path, cfg, "f32", seed=0, progress=False, tokenizer="none")
    with open_model(path) as model:
        e = model.config.engram
        assert e == cfg.engram
        token_map = np.asarray(model.metadata[f"{cfg.arch}.engram.token_map"])
        hasher = EngramHasher(e, token_map)
        seq = np.random.default_rng(12).integers(0, cfg.vocab_size, size=40)
        ids = hasher.row_ids_seq(seq)
        src = MmapRowSource.from_model(model, e)
        rows = read_step_rows(src, ids)
        for li, layer in enumerate(e.layer_ids):
            table = model.raw(f"blk.{layer}.engram_embd.weight")
            assert table.shape == (e.rows[li], e.row_bytes)
            np.testing.assert_array_equal(rows[:, li], table[ids[:, li]])
        vals = np.asarray(dequant_rows(jnp.asarray(rows)))
        np.testing.assert_array_equal(vals, dequant_rows_np(rows, e.head_dim))
        assert np.isfinite(vals).all()
