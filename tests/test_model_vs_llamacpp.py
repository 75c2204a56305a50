"""jds41's model (Engine) against llama.cpp, the outside oracle, on tiny synthetic `deepseek4` files (issue #3).

Three files of the same tiny preset (seed 1): `f32` (every tensor F32), `q8` (every matrix and expert Q8_0) and
`mxfp4` (experts MXFP4, other matrices Q8_0). For each, every position's logits of random prompts of 1, 17, 64 and
300 tokens (300 reaches the ratio-128 layer's compressed rows and makes the indexer choose 4 of up to 75 rows) are
compared with llama.cpp's (one batch, F32 KV cache: tests/llamacpp_oracle.py), and 32 greedy tokens after 20-token
prompts. Separately, the emulated activation rounding is checked bit for bit against the ggml-cpu functions llama.cpp
runs here (x86 `quantize_row_q8_0`, F16 conversion; called through ctypes): ggml's portable reference (1/d, roundf)
differs from that kernel (127/amax, round half to even) on exact ties, and the test tells the two apart.

F32, default numerics: max |ours - llama.cpp| <= 2e-4 at every position (measured 1.4e-6 .. 3.2e-6, logit std ~1.5);
greedy 32/32 for both prompts.

Q8_0 / MXFP4, `Engine.open(..., numerics="llamacpp")`: ggml-cpu rounds each activation row to Q8_0 blocks before
these dot products (jds41.quant.qtensor) and scales routed experts after W_down (jds41.layers.moe); both emulated.
A position then agrees to f32 accuracy: max 7.2e-7 over all such positions measured, so "clean" = within
CLEAN_TOL = 1e-5. It cannot hold everywhere: the rounding is discontinuous and our f32 values before it differ from
ggml's by a few ulps (summation order: 2-14 ulps mean on the Q8_0 products), so about once per 30-60 tokens a value
sits so near a rounding boundary that one side rounds up and the other down (a near-tie flip); that position then
differs by 1e-2..2, and if the flip reaches a compressed KV row every later position carries it. llama.cpp flips
against itself the same way: its batch and one-token decode paths of the q8 file part from position 119 of a
300-token prompt (up to 1.35). Measured onsets (positions where the error rises above CLEAN_TOL): q8: T=17 at 6
(one position), T=300 at 66 (then on); mxfp4: T=64 at 10, T=300 at 5 and 29; none in the other prompts. Asserted,
the strongest property that survives flips: position 0 of every prompt is clean (missing or wrong emulation breaks
it: default numerics miss by ~0.05, routing weight before W_down by 0.04), at most MAX_ONSETS = 2 onsets per
prompt (isolated events, not drift), nothing beyond NOISE_BOUND = 5 (measured max 2.3).

Greedy on quantized files: prompt seed 0 agrees 32/32 (asserted; seeds 1-3 too, measured). Prompt seed 20 shows a
flip deciding a token: q8 flips at positions 11 and 21 (teacher-forced on llama.cpp's sequence), then at step 9
(position 28) our logits differ by 1.01 where llama.cpp's top-2 margin is 0.069; mxfp4 flips at 40 and parts at
step 23 (position 42: difference 0.053, margin 0.018). For that prompt the test asserts the explained form: same ids
at every step chosen before the first onset, and the teacher-forced logits have the flip shape above.

Reported (`-rP`), not asserted: default numerics on the quantized files, 288 positions of the T=300 prompt: q8 max
2.13, median 0.083, no clean position, argmax agrees at 92%; mxfp4 max 1.76, median 0.071, 93%; default greedy
parts at step 20 / 5 (q8, seeds 0 / 20) and 3 / 18 (mxfp4).
"""

from __future__ import annotations

import ctypes
import importlib.util
import platform
from pathlib import Path

import jax
import numpy as np
import pytest
from llamacpp_oracle import greedy as llamacpp_greedy
from llamacpp_oracle import logits as llamacpp_logits

from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import write_synthetic
from jds41.engine import Engine
from jds41.quant.qtensor import _ggml_cpu_q8_0

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]

LENGTHS = (1, 17, 64, 300)
F32_TOLERANCE = 2e-4
CLEAN_TOL = 1e-5
MAX_ONSETS = 2
NOISE_BOUND = 5.0
PROMPT, N_NEW = 20, 32
GREEDY_SEEDS = (0, 20)  # prompt seeds: 0 agrees 32/32 on every file, 20 shows flip-caused divergence
REPORT_T = 288  # default-numerics report: a multiple of the prefill chunk (32), so only prefill is compiled


def _tokens(vocab: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.fixture(scope="module", params=["f32", "q8", "mxfp4"])
def run(request, tmp_path_factory):
    """One file's comparisons, computed once: `logits[length] = (tokens, ours, llama.cpp's)` and, per greedy prompt
    seed, `greedy[seed] = (our ids, llama.cpp's ids, per-position error teacher-forced on llama.cpp's sequence)`."""
    quant = request.param
    cfg = preset("deepseek4", "tiny")
    path = tmp_path_factory.mktemp("model_vs_llamacpp") / f"tiny-deepseek4-{quant}.gguf"
    write_synthetic(path, cfg, quant=quant, seed=1, progress=False, tokenizer="none")
    engine = Engine.open(str(path), max_ctx=512, numerics="jds41" if quant == "f32" else "llamacpp")
    logits = {}
    for n in LENGTHS:
        tokens = _tokens(cfg.vocab_size, n, 100 + n)
        logits[n] = (tokens, engine.session().feed(tokens, all_logits=True), llamacpp_logits(path, tokens))
    greedy = {}
    for seed in GREEDY_SEEDS:
        prompt = _tokens(cfg.vocab_size, PROMPT, seed)
        want = llamacpp_greedy(path, prompt, N_NEW)
        forced = engine.session().feed(prompt + want.tokens, all_logits=True)  # row i: after position i
        greedy[seed] = (list(engine.session().generate(prompt, N_NEW)), want.tokens,
                        np.max(np.abs(forced - want.logits), axis=1))
    return quant, path, logits, greedy


def _onsets(err: np.ndarray) -> np.ndarray:
    """Positions where the error rises above CLEAN_TOL (position 0 included when it starts there)."""
    bad = err > CLEAN_TOL
    return np.flatnonzero(bad & ~np.r_[False, bad[:-1]])


def _check_flip_shape(err: np.ndarray, what: str) -> None:
    """The quantized-file property: clean at position 0, at most MAX_ONSETS onsets, nothing beyond NOISE_BOUND."""
    onsets, clean = _onsets(err), err <= CLEAN_TOL
    detail = (f"{what}: worst position {int(np.argmax(err))} differs by {err.max():.3g}; onsets {onsets.tolist()}, "
              f"clean {clean.sum()}/{len(err)}, max clean error {err[clean].max() if clean.any() else np.nan:.3g}")
    assert clean[0], f"position 0 is not clean: {detail}"
    assert len(onsets) <= MAX_ONSETS, f"too many divergence onsets: {detail}"
    assert err.max() <= NOISE_BOUND, detail


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_llamacpp(run, length):
    quant, _, logits, _ = run
    _, ours, want = logits[length]
    assert ours.shape == want.shape == (length, want.shape[1])
    err = np.max(np.abs(ours - want), axis=1)
    if quant == "f32":
        worst = int(np.argmax(err))
        assert err[worst] <= F32_TOLERANCE, (f"T={length}: position {worst} differs by {err[worst]:.3g} (logit std "
                                             f"{want.std():.3g}); over: {np.flatnonzero(err > F32_TOLERANCE)}")
    else:
        _check_flip_shape(err, f"{quant} T={length}")


@pytest.mark.parametrize("seed", GREEDY_SEEDS)
def test_greedy_matches_llamacpp(run, seed):
    quant, _, _, greedy = run
    ours, want, forced_err = greedy[seed]
    first = next((i for i, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b), None)
    detail = (f"{quant}, prompt seed {seed}: greedy ids differ from step {first}; error teacher-forced on llama.cpp's "
              f"sequence: onsets {_onsets(forced_err).tolist()}, at the steps {np.round(forced_err[PROMPT - 1:], 4)}")
    if quant == "f32" or seed == 0:
        assert ours == want, detail
        return
    # A flip-affected prompt (docstring): ids must agree at every step chosen before the first flip onset on llama.cpp's
    # own sequence, and the logits along that sequence must have the shape of isolated flips.
    _check_flip_shape(forced_err, f"{quant} greedy prompt seed {seed}, teacher-forced")
    onset = int(_onsets(forced_err)[0]) if (forced_err > CLEAN_TOL).any() else len(forced_err)
    assert first is None or PROMPT - 1 + first >= onset, detail


def test_default_numerics_gap(run, record_property):
    """How far the default (jds41) numerics are from llama.cpp, reported with -rP. F32: within F32_TOLERANCE.
    Quantized files: NOT clean even at position 0 (measured ~0.05), which is what makes the clean position 0 of
    the llamacpp-numerics test a real check of the emulation rather than a property any numerics would have."""
    quant, path, logits, _ = run
    tokens, _, want = logits[300]
    ours = Engine.open(str(path), max_ctx=512).session().feed(tokens[:REPORT_T], all_logits=True)
    err = np.max(np.abs(ours - want[:REPORT_T]), axis=1)
    line = (f"{quant}, numerics='jds41', {REPORT_T} positions: max {err.max():.3g}, median {np.median(err):.3g}, "
            f"clean (<= {CLEAN_TOL:g}) {np.mean(err <= CLEAN_TOL):.2f}, argmax agrees "
            f"{np.mean(ours.argmax(1) == want[:REPORT_T].argmax(1)):.2f}")
    record_property("default_numerics_gap", line)
    print(line)
    assert np.isfinite(err).all()
    if quant == "f32":
        assert err.max() <= F32_TOLERANCE, line
    else:
        assert err[0] > CLEAN_TOL, line


def _ggml(lib: str) -> ctypes.CDLL:
    """A library of the llama_cpp package's ggml build (no llama.cpp model or context: plain C functions)."""
    return ctypes.CDLL(str(Path(importlib.util.find_spec("llama_cpp").submodule_search_locations[0]) / "lib" / lib))


def _ggml_q8_0_values(fn, x: np.ndarray) -> np.ndarray:
    """Quantize f32 rows with a ggml `quantize_row_q8_0*` function and read the blocks back as q * fp16(d)."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.zeros((x.size // 32, 34), np.uint8)
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return (out[:, 2:].view(np.int8) * out[:, :2].copy().view(np.float16).astype(np.float32)).reshape(-1)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="emulates ggml-cpu's x86 kernels")
def test_activation_rounding_is_ggml_cpus():
    """`act_round="ggml-cpu"` rounds exactly as the ggml-cpu x86 build does (bit for bit), including exact half-ties,
    where ggml's portable reference (1/d and roundf, half away from zero) would round differently."""
    rng = np.random.default_rng(0)
    n_blocks = 20000
    wide = rng.standard_normal((n_blocks, 32)) * np.exp(rng.uniform(-14, 4, (n_blocks, 1)))  # fp16-subnormal d too
    ties = rng.integers(-126, 126, (n_blocks, 32)) + 0.5  # x * 127/amax lands on k + 0.5
    ties[:, 0] = 127.0
    ties *= 2.0 ** rng.integers(-12, 6, (n_blocks, 1))
    x = np.concatenate([wide, ties, np.zeros((2, 32))]).astype(np.float32).reshape(-1)
    ours = np.asarray(jax.jit(_ggml_cpu_q8_0)(x))
    x86 = _ggml_q8_0_values(_ggml("libggml-cpu.so").quantize_row_q8_0, x)
    np.testing.assert_array_equal(ours, x86)  # equal values (ours gives -0.0 where ggml's int8 0 gives +0.0)
    portable = _ggml_q8_0_values(_ggml("libggml-base.so").quantize_row_q8_0_ref, x)
    assert np.sum(portable != x86) > 100_000  # the ties tell the two roundings apart
    half = np.zeros(x.size, np.uint16)
    _ggml("libggml-cpu.so").ggml_cpu_fp32_to_fp16(x.ctypes.data_as(ctypes.c_void_p),
                                                  half.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v.astype(np.float16))(x)).view(np.uint16), half)
