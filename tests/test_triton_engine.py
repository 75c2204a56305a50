"""The engine's invariances with the Triton MXFP4 kernel doing the one-token products, run on the CPU through Pallas'
interpreter (JDS41_TRITON=interpret, read at import, so the engine runs in a subprocess): on the GPU the kernel
replaces XLA's products, and these are the promises that must survive the swap. In one engine with the kernel (V4.1
tiny, MXFP4 experts and two DSpark stages): a three-tier placement (HBM, pinned host, SSD through a 2-slot cache)
gives the resident logits bit for bit and the same greedy tokens; the device loop gives the step loop's tokens;
drafting gives plain greedy decode's tokens, at decode width 1 and at width 4 (the vmapped kernel); the wide prompt
pass keeps its bits for any cut. Against the XLA engine in this process (the reference path): the same logits to f32
rounding, and not the same bits (the kernel really ran). The "attention" case runs the attention kernels too
(layers/attention_kernel.py, JDS41_ATTN_KERNEL=1) under the same promises, and the "mhc" case the sublayer inputs'
kernels (layers/mhc_input_kernel.py, the default on CUDA; the other cases set JDS41_MHC_KERNEL=0), the "mhc_v4"
case V4's unlagged form of them in a V4 engine (the default on CUDA too), and the "co_launch" case the routed and
shared experts' products in shared launches, and an attention sublayer's products of its input in one
(quant/co_launch.py, the default on CUDA, off in the other cases: decode's step co-launches, the tiered, prompt and
layer-major paths do not, so their equalities check the co-launch's bits), and the "v4_state" case a V4 engine
whose compressors' sequential part is one launch each (layers/compressor_kernel.py, JDS41_COMPRESSOR_KERNEL=1) and
whose attention softmax is one (layers/sink_softmax_kernel.py, JDS41_SOFTMAX_KERNEL=1), and whose router's
selection is one (layers/topk_kernel.py's `route`, JDS41_ROUTE_KERNEL=1): every path takes them. The "int8"
case opens every engine with the int8 numerics (quant/int8_act.py): the MXFP4 experts' products are then the dp4a
kernel's (quant/triton_int8.py), co-launched beside the shared expert's f32 Q8_0 product, and the reference is the
XLA engine with that numerics, and its sublayer inputs' kernels run too, so decode's FFN input comes with its
int8 blocks from the launch that writes it (model.rounds_ffn_input). Every case computes its FFNs' hidden
activations by quant/swiglu_kernel.py (the default on CUDA): with the int8 numerics rounded in the same launch,
with the co-launch both experts' in one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jds41.engine import Engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
SPLIT = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
         "slot_cache_slots": 2, "lookahead": 1, "router_lean": {"enabled": False}}

# Runs with JDS41_TRITON=interpret; argv: model, profile, output .npy; prints one JSON line of checks.
ENGINE_RUN = r"""
import json, sys
import numpy as np
from jds41.decode_loop import greedy_generate
from jds41.engine import Engine
from jds41.quant import triton_matvec
from jds41.speculative import DSparkDrafter, SpeculativeSession

model, profile, out, numerics = sys.argv[1:5]
toks = [int(t) for t in np.random.default_rng(3).integers(8, 400, 40)]
from jds41.layers import attention_kernel, compressor_kernel, mhc_input_kernel, sink_softmax_kernel, topk_kernel
from jds41.quant import co_launch, swiglu_kernel
res = {"interpret": triton_matvec.INTERPRET, "swiglu_kernel": swiglu_kernel.ENABLED,
       "attention_kernel": attention_kernel.applies(32),
       "mhc_kernel": mhc_input_kernel.applies(4, 64, 24),
       "mhc_v4_kernel": mhc_input_kernel.applies(4, 64, 24, lagged=False), "co_launch": co_launch.ENABLED,
       "compressor_kernel": compressor_kernel.applies(4, 64, True), "softmax_kernel": sink_softmax_kernel.applies(8),
       "route_kernel": topk_kernel.route_applies(16, 4)}
e = Engine.open(model, max_ctx=128, prefill_chunk=16, numerics=numerics)
from jds41 import model as M
res["ffn_input_rounded"] = any(M.rounds_ffn_input(e.plan, b) for b in e.params["blocks"])
want = e.session().feed(toks, all_logits=True)
np.save(out, want)
gen = list(e.session().generate(toks, 8))
tiered = Engine.open(model, max_ctx=128, prefill_chunk=16, profile=profile, numerics=numerics)
res["tiered_logits_equal"] = bool(np.array_equal(tiered.session().feed(toks, all_logits=True), want))
res["tiered_tokens_equal"] = list(tiered.session().generate(toks, 8)) == gen
s = e.session()
res["device_loop_equal"] = greedy_generate(s, int(np.argmax(s.feed(toks))), 8) == gen
res["draft_equal"] = list(SpeculativeSession(e, DSparkDrafter.open(e, "self")).generate(toks, 8)) == gen
w4 = Engine.open(model, max_ctx=128, prefill_chunk=16, decode_width=4, numerics=numerics)
plain4 = list(w4.session().generate(toks, 8))
res["width4_draft_equal"] = list(SpeculativeSession(w4, DSparkDrafter.open(w4, "self")).generate(toks, 8)) == plain4
wide = Engine.open(model, max_ctx=128, prefill_chunk=16, prompt_width=8, numerics=numerics)
whole = wide.session().feed(toks, all_logits=True)
cut = wide.session()
parts = [cut.feed(toks[:13], all_logits=True), cut.feed(toks[13:], all_logits=True)]
res["wide_cut_equal"] = bool(np.array_equal(np.concatenate(parts), whole))
print(json.dumps(res))
"""


# "attention": the attention kernels too (layers/attention_kernel.py, JDS41_ATTN_KERNEL=1), vmapped at width 4;
# "mhc": the sublayer inputs' kernels too (layers/mhc_input_kernel.py; the default on CUDA, off in the others);
# "co_launch": the routed and shared experts' products in shared launches (quant/co_launch.py, the default on CUDA;
# the other cases set JDS41_CO_LAUNCH=0); "int8": the int8 numerics, its MXFP4 products co-launched, its sublayer
# inputs' kernels on (decode's FFN input then comes with its int8 blocks, model.rounds_ffn_input); "mhc_v4": a
# V4 (deepseek4) engine with its unlagged sublayer inputs' three launches (JDS41_MHC_KERNEL_V4, the default on CUDA)
# and the co-launches (its compressors' and indexer's products of the attention input among them); "v4_state": a V4
# engine whose compressors' sequential part is one launch each (layers/compressor_kernel.py) and its attention softmax
# one (layers/sink_softmax_kernel.py), its router's selection one (topk_kernel.route), all three the defaults on CUDA
# (the other cases switch them off)
@pytest.mark.parametrize("kernels", ["products", "attention", "mhc", "co_launch", "int8", "mhc_v4", "v4_state"])
def test_the_engine_keeps_its_invariances_with_the_kernel(synthetic_model, tmp_path, kernels):
    arch = "deepseek4" if kernels in ("mhc_v4", "v4_state") else "deepseek41"
    model = str(synthetic_model(arch, "tiny", "mxfp4", draft_stages=2))
    profile = tmp_path / "split3.json"
    profile.write_text(json.dumps(SPLIT))
    out = tmp_path / "kernel_logits.npy"
    env = {**os.environ, "JDS41_TRITON": "interpret", "JAX_PLATFORMS": "cpu",
           "JDS41_ATTN_KERNEL": "1" if kernels == "attention" else "0",
           "JDS41_MHC_KERNEL": "1" if kernels in ("mhc", "mhc_v4", "int8") else "0",
           "JDS41_MHC_KERNEL_V4": "1" if kernels == "mhc_v4" else "0",
           "JDS41_CO_LAUNCH": "1" if kernels in ("co_launch", "int8", "mhc_v4") else "0",
           "JDS41_COMPRESSOR_KERNEL": "1" if kernels == "v4_state" else "0",
           "JDS41_SOFTMAX_KERNEL": "1" if kernels == "v4_state" else "0",
           "JDS41_ROUTE_KERNEL": "1" if kernels == "v4_state" else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    numerics = "int8" if kernels == "int8" else "jds41"
    res = subprocess.run([sys.executable, "-c", ENGINE_RUN, model, str(profile), str(out), numerics],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1100)
    assert res.returncode == 0, res.stderr[-4000:]
    checks = json.loads(res.stdout.strip().splitlines()[-1])
    assert checks == {"interpret": True, "swiglu_kernel": True, "attention_kernel": kernels == "attention",
                      "mhc_kernel": kernels in ("mhc", "mhc_v4", "int8"), "mhc_v4_kernel": kernels == "mhc_v4",
                      "ffn_input_rounded": kernels == "int8",
                      "co_launch": kernels in ("co_launch", "int8", "mhc_v4"),
                      "compressor_kernel": kernels == "v4_state", "softmax_kernel": kernels == "v4_state",
                      "route_kernel": kernels == "v4_state",
                      "tiered_logits_equal": True,
                      "tiered_tokens_equal": True, "device_loop_equal": True, "draft_equal": True,
                      "width4_draft_equal": True, "wide_cut_equal": True}, checks
    kernel = np.load(out)
    toks = [int(t) for t in np.random.default_rng(3).integers(8, 400, 40)]
    xla = Engine.open(model, max_ctx=128, prefill_chunk=16, numerics=numerics).session().feed(toks, all_logits=True)
    np.testing.assert_allclose(kernel, xla, rtol=0, atol=1e-5 * np.abs(xla).max())
    assert not np.array_equal(kernel, xla)  # the products (and attention) were the kernels', not XLA's
