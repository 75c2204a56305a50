"""The paths whose memory kinds are only labels on the CPU, run where they are real (marker `gpu`: skipped on
machines without a GPU, CI included). On the GPU box: `python -m pytest -q -m gpu tests/test_gpu_paths.py`.

- pinned-host experts moved per selected expert inside a `lax.cond` (`host_fetch: selected`) and the plain
  move-all-K path, beside SSD experts through the slot cache: logits bit-identical to the all-resident model;
- one-row tier stacks (the XLA "bitcast across memory spaces" case seen on the H200);
- the device decode loop against the step-per-token reference, with tiered experts;
- with MXFP4 experts, and with V4.1's two-bit ones (IQ2_XXS gate/up, Q2_K down, both planar in every tier), all of
  it through the Triton kernel (jds41/quant/triton_matvec.py);
- the "int8" numerics with the two-bit experts (their products the dp4a kernel, jds41/quant/triton_int8.py): tiered
  logits equal resident ones, and the device loop gives the step loop's tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from two_bit_model import two_bit_model

from jds41.decode_loop import greedy_generate
from jds41.engine import Engine, SamplingParams
from jds41.tiers.profiles import load_profile

pytestmark = pytest.mark.gpu

TOKENS = [5, 17, 3, 99, 42, 7, 64, 12, 200, 31, 8, 77]


def _profile(tmp_path, name: str, **fields) -> str:
    d = {**load_profile("ssd-heavy").to_json(), **fields, "name": name}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


# mxfp4 and ds4-q2: the experts' products are the Triton kernel's
@pytest.mark.parametrize("quant", ["q8", "mxfp4", "ds4-q2"])
@pytest.mark.parametrize("fetch", ["all", "selected"])
def test_tiered_logits_equal_resident_on_the_gpu(synthetic_model, tmp_path, fetch, quant):
    path = two_bit_model(tmp_path) if quant == "ds4-q2" else str(synthetic_model("deepseek41", "tiny", quant))
    want = Engine.open(path, max_ctx=64).session().feed(TOKENS, all_logits=True)
    prof = _profile(tmp_path, f"mixed-{fetch}", tier0_bytes=0.3, tier1_bytes=0.4, host_fetch=fetch)
    got = Engine.open(path, max_ctx=64, profile=prof).session().feed(TOKENS, all_logits=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fetch", ["all", "selected"])
def test_int8_numerics_keeps_the_placement_and_loop_invariances_on_the_gpu(tmp_path, fetch):
    path = two_bit_model(tmp_path)
    # prefill_chunk 0: every position a decode step, so the tiers' decode products (the dp4a kernel) are compared
    resident = Engine.open(path, max_ctx=64, numerics="int8", prefill_chunk=0)
    want = resident.session().feed(TOKENS, all_logits=True)
    prof = _profile(tmp_path, f"mixed-{fetch}", tier0_bytes=0.3, tier1_bytes=0.4, host_fetch=fetch)
    tiered = Engine.open(path, max_ctx=64, profile=prof, numerics="int8", prefill_chunk=0)
    np.testing.assert_array_equal(tiered.session().feed(TOKENS, all_logits=True), want)
    for eng in (resident, tiered):
        ref = list(eng.session().generate(TOKENS, 12, SamplingParams()))
        s = eng.session()
        assert greedy_generate(s, int(np.argmax(s.feed(TOKENS))), 12) == ref


@pytest.mark.parametrize("profile", ["all-hbm", "ssd-heavy"])
def test_shipped_profiles_generate_the_resident_tokens(synthetic_model, profile):
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    want = list(Engine.open(path, max_ctx=64).session().generate(TOKENS, 8, SamplingParams()))
    got = list(Engine.open(path, max_ctx=64, profile=profile).session().generate(TOKENS, 8, SamplingParams()))
    assert got == want


def test_device_loop_equals_step_loop_with_tiers(synthetic_model):
    path = str(synthetic_model("deepseek41", "tiny", "q8"))
    eng = Engine.open(path, max_ctx=96, profile="ssd-heavy")
    ref = list(eng.session().generate(TOKENS, 24, SamplingParams()))
    s = eng.session()
    got = greedy_generate(s, int(np.argmax(s.feed(TOKENS))), 24)
    assert got == ref
