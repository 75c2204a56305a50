"""llama.cpp (llama-cpp-python 0.3.36) accepts jds41's synthetic `deepseek4` files and runs them sensibly.

The synthetic writer is only useful as a stand-in for real checkpoints if the outside implementation reads its
files as the same model: every tiny `deepseek4` preset file, in each quantization the writer offers, must load
in llama.cpp and give finite logits of shape [T, V], for a 5-token prompt and for a 140-token one (past 128
tokens, so the ratio-128 HCA layer has a compressed row and the ratio-4 indexer selects a sparse top-k).

Beyond "it runs", each file's logits must behave like one causal model: the 5-token rows equal the first 5 rows of
the 140-token run, one-token-at-a-time decoding equals the batched prompt (F32: LLAMACPP_DEEPSEEK4.md §3 measured
<= 5e-6), and greedy decode equals the argmax of a full forward over the grown prefix. The oracle's error path is
checked on a truncated file (load error) and on one that makes llama.cpp abort.
"""

from __future__ import annotations

import signal

import llamacpp_oracle as oracle  # tests/ is on sys.path under pytest (rootdir-less test dir, prepend mode)
import numpy as np
import pytest
from gguf_surgery import key_field, patch, write_bytes

from jds41.checkpoints import read_header
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]

QUANTS = ("f32", "q8", "mxfp4", "ds4-q2")
# Largest difference between two evaluation orders of one file in llama.cpp, relative to max |logit|. Measured on
# these files (140 tokens): F32 decode vs batch ~1e-6 (summation order); Q8_0 bit-identical (activations are
# rounded to Q8_0 and the dots are exact); a shorter prompt equals the prefix of a longer one bit for bit. MXFP4
# experts: decode vs batch differ by up to 0.2 of max |logit| (ggml's MXFP4 kernels differ by batch shape), so
# that pair is not compared. Past ~290 tokens an indexer near-tie flips even for F32: keep these at 140.
TOL = 1e-4


@pytest.fixture(scope="module")
def cfg():
    return preset("deepseek4", "tiny")


@pytest.fixture(scope="module")
def tiny_files(synthetic_model):
    """The tiny deepseek4 preset in every quant layout, seed 0 (written once per session, see conftest.py)."""
    return {quant: synthetic_model("deepseek4", "tiny", quant) for quant in QUANTS}


def _tokens(cfg, n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(8, cfg.vocab_size, size=n).tolist()  # past the special ids


def _assert_sane(x: np.ndarray, shape: tuple[int, int], what: str) -> None:
    assert x.shape == shape and x.dtype == np.float32, f"{what}: {x.dtype}{x.shape}, expected float32{shape}"
    assert np.isfinite(x).all(), f"{what}: {np.count_nonzero(~np.isfinite(x))} non-finite logits"
    assert x.std(axis=1).min() > 1e-3, f"{what}: a row of constant logits (std {x.std(axis=1).min():.2e})"
    assert not np.allclose(x[0], x[-1]), f"{what}: first and last position give the same logits"


@pytest.mark.parametrize("quant", QUANTS)
def test_llamacpp_loads_and_evaluates(tiny_files, cfg, quant):
    toks = _tokens(cfg, 140)
    short = oracle.logits(tiny_files[quant], toks[:5])
    _assert_sane(short, (5, cfg.vocab_size), f"{quant}, 5 tokens")
    full = oracle.logits(tiny_files[quant], toks)
    _assert_sane(full, (140, cfg.vocab_size), f"{quant}, 140 tokens")
    # Causality: later tokens never change earlier rows.
    np.testing.assert_allclose(full[:5], short, atol=TOL * float(np.abs(short).max()), rtol=0)


@pytest.mark.parametrize("quant", ["f32", "q8"])
def test_token_by_token_equals_batch(tiny_files, cfg, quant):
    toks = _tokens(cfg, 140, seed=2)
    batch = oracle.logits(tiny_files[quant], toks)
    step = oracle.logits(tiny_files[quant], toks, chunk=1)
    scale = float(np.abs(batch).max())
    err = float(np.abs(step - batch).max()) / scale
    assert err <= TOL, f"{quant}: decode vs batch max error {err:.2e} of max |logit| {scale:.2f}"


def test_greedy_equals_argmax_of_full_forward(tiny_files, cfg):
    prompt = _tokens(cfg, 12, seed=3)
    res = oracle.greedy(tiny_files["f32"], prompt, 6)
    assert len(res.tokens) == 6 and all(0 <= t < cfg.vocab_size for t in res.tokens)
    seq = prompt + res.tokens
    full = oracle.logits(tiny_files["f32"], seq)
    assert full[len(prompt) - 1:-1].argmax(axis=1).tolist() == res.tokens
    np.testing.assert_allclose(res.logits, full, atol=TOL * float(np.abs(full).max()), rtol=0)


def test_mtp_block_loads_and_changes_nothing(tmp_path, tiny_files, cfg):
    """An MTP block rides in the file (nextn_predict_layers=1) and is skipped by the normal graph (§6)."""
    mtp = tmp_path / "tiny-deepseek4-mtp.gguf"
    write_synthetic(mtp, preset("deepseek4", "tiny", nextn=1), quant="f32", seed=0, progress=False)
    toks = _tokens(cfg, 140, seed=4)
    got = oracle.logits(mtp, toks)
    _assert_sane(got, (140, cfg.vocab_size), "f32 + MTP block")
    np.testing.assert_array_equal(got, oracle.logits(tiny_files["f32"], toks))


def test_oracle_reports_a_rejected_file(tiny_files, tmp_path, cfg):
    """A load error (truncated file) comes back as exit status 3 with llama.cpp's own reason."""
    data = tiny_files["f32"].read_bytes()
    cut = write_bytes(tmp_path / "truncated.gguf", data[: len(data) // 2])
    with pytest.raises(oracle.LlamaCppError) as err:
        oracle.logits(cut, _tokens(cfg, 3))
    assert err.value.returncode == 3 and "model load failed" in str(err.value)
    assert any("not within the file bounds" in r for r in err.value.reasons), str(err.value)


def test_oracle_survives_an_abort(tiny_files, tmp_path, cfg):
    """head_count_kv 4 makes llama.cpp abort at graph build (LLAMACPP_DEEPSEEK4.md §5): SIGABRT, assert named."""
    data = tiny_files["f32"].read_bytes()
    pos = key_field(read_header(tiny_files["f32"]), "deepseek4.attention.head_count_kv", "value")
    bad = write_bytes(tmp_path / "kv4.gguf", patch(data, pos, "<I", 4))
    with pytest.raises(oracle.LlamaCppError) as err:
        oracle.logits(bad, _tokens(cfg, 3))
    assert err.value.returncode == -signal.SIGABRT, str(err.value)
    assert any("GGML_ASSERT" in r for r in err.value.reasons), str(err.value)
