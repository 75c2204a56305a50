"""The second CUDA stream for independent branches (jds41/layers/side_stream.py, JDS41_SIDE_STREAM=1 or a list of
its sites).

On every machine: the shared expert and the K = V latent lower for CUDA to calls annotated for stream 1 where their
site is switched on, and to none where it is not; the switch's spellings; and an engine with the switch on gives
the bits of one with it off (prompt logits, greedy tokens, the device loop's tokens, drafted tokens: the two device
loops also fetch their Engram rows in the annotated region, engram_host_call.fetch_step_rows), the switch being
read at import, hence subprocesses.
Other platforms run the annotated call in place, so the engine check holds what the annotation must never change:
the values. Whether the GPU overlaps the branches is measured on the GPU box (experiments/device_next.sh
side-stream), not asserted here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jds41.layers import attention, moe, side_stream
from jds41.quant import QTensor, triton_matvec

ROOT = Path(__file__).resolve().parents[1]
ANNOTATION = "_xla_stream_annotation"


@pytest.mark.parametrize("sites", [frozenset(side_stream.ALL_SITES), frozenset(), frozenset({"latent"}),
                                   frozenset({"shared"})])
def test_the_branches_lower_to_stream_annotated_calls_only_where_switched_on(monkeypatch, sites):
    monkeypatch.setattr(side_stream, "SITES", sites)
    d, f, kv = 256, 128, 64
    x = jax.ShapeDtypeStruct((d,), jnp.float32)
    gate, up = QTensor.abstract(T.Q8_0, (f, d)), QTensor.abstract(T.Q8_0, (f, d))
    down = QTensor.abstract(T.Q8_0, (d, f))
    shared = jax.jit(lambda x, g, u, dn: moe.shared_expert(x, g, u, dn, 7.0)).trace(x, gate, up, down)
    cfg = types.SimpleNamespace(rms_eps=1e-6)
    w = {"attn_kv": QTensor.abstract(T.Q8_0, (kv, d)), "attn_kv_a_norm": jax.ShapeDtypeStruct((kv,), jnp.float32)}
    freqs = jax.ShapeDtypeStruct((8,), jnp.float32)
    latent = jax.jit(lambda h, w, p, fr: attention.latent(cfg, w, h, p, fr)).trace(
        x, w, jax.ShapeDtypeStruct((), jnp.int32), freqs)
    for site, traced in (("shared", shared), ("latent", latent)):
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert (f'{ANNOTATION} = "1"' in text) is (site in sites)


def test_the_switch_names_its_sites():
    assert side_stream.parse_sites("1") == set(side_stream.ALL_SITES)
    assert side_stream.parse_sites("0") == side_stream.parse_sites("") == set()
    assert side_stream.parse_sites("latent,engram") == {"latent", "engram"}
    for bad in ("yes", "latent,router", "latent;shared"):
        with pytest.raises(ValueError, match="JDS41_SIDE_STREAM"):
            side_stream.parse_sites(bad)
    with pytest.raises(ValueError, match="unknown site"):
        side_stream.on_side_stream("router", lambda v: v, jnp.zeros(2))


def test_a_region_holds_no_nested_call_once_lowered_for_cuda(monkeypatch):
    """The K = V latent's product as the engine lowers it on CUDA (planar Q8_0, the Triton kernel behind
    lax.platform_dependent and a nested jax.jit): the region's function holds the kernel and no call, which XLA
    could not place on the stream (side_stream.inline_calls)."""
    monkeypatch.setattr(side_stream, "SITES", frozenset({"latent"}))
    monkeypatch.setattr(triton_matvec, "ENABLED", True)
    monkeypatch.setattr(triton_matvec, "INTERPRET", False)
    d, kv = 5120, 512
    w = {"attn_kv": dataclasses.replace(QTensor.abstract(T.Q8_0, (kv, d)), layout="planar"),
         "attn_kv_a_norm": jax.ShapeDtypeStruct((kv,), jnp.float32)}
    cfg = types.SimpleNamespace(rms_eps=1e-6)

    def lowered():  # a new function each time: jit's trace cache would keep the first switch's graph
        def loop(h, w, p, fr):  # in a while body, as the engine's layers are
            return jax.lax.fori_loop(0, 2, lambda i, v: v + attention.latent(cfg, w, h, p, fr).sum(),
                                     jnp.float32(0))
        shapes = (jax.ShapeDtypeStruct((d,), jnp.float32), w, jax.ShapeDtypeStruct((), jnp.int32),
                  jax.ShapeDtypeStruct((8,), jnp.float32))
        return jax.jit(loop).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered()
    region = text[text.index("func.func private @compute_on"):]
    region = region[:region.index("\n  }")]
    assert "__gpu$xla.gpu.triton" in region and f'{ANNOTATION} = "1"' in region
    assert "call @" not in region.replace("custom_call @", "")
    monkeypatch.setattr(side_stream, "SITES", frozenset())  # the check can fail: without the region, the call is there
    plain = lowered()
    assert "@compute_on" not in plain and "call @rows_matvec" in plain


def test_inlining_the_calls_keeps_the_values():
    """inline_calls against the function itself, eagerly and compiled: nested jits (one inside another), a
    platform_dependent conditional with a jit in its branches, a custom_jvp function, a pytree in and out."""
    inner = jax.jit(lambda v: jnp.clip(v * 3.0, -2.0, 2.0))

    def fn(x, pair):
        a, b = pair
        y = jax.lax.platform_dependent(x, cpu=lambda v: inner(v) + 1.0, default=lambda v: inner(v) - 1.0)
        return {"y": jax.nn.relu(y) * a, "z": jax.jit(lambda u: jnp.sin(u) @ b)(x)}

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(16), jnp.float32)
    pair = (jnp.float32(0.7), jnp.asarray(rng.standard_normal((16, 4)), jnp.float32))
    want = fn(x, pair)
    for got in (side_stream.inline_calls(fn)(x, pair), jax.jit(side_stream.inline_calls(fn))(x, pair)):
        assert sorted(got) == ["y", "z"]
        for k in got:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    jaxpr = str(jax.make_jaxpr(side_stream.inline_calls(fn))(x, pair))
    assert "pjit" not in jaxpr and "jit[" not in jaxpr and "custom_jvp_call" not in jaxpr
    assert "pjit" in str(jax.make_jaxpr(fn)(x, pair)) or "jit[" in str(jax.make_jaxpr(fn)(x, pair))


# argv: model, output .npy; prints one JSON line (the mechanism, the tokens of each path)
_ENGINE_RUN = r"""
import json, sys
import numpy as np
from jds41.decode_loop import greedy_generate
from jds41.engine import Engine
from jds41.layers import side_stream
from jds41.speculative import DSparkDrafter, SpeculativeSession

model, out = sys.argv[1:3]
toks = [int(t) for t in np.random.default_rng(4).integers(8, 400, 24)]
e = Engine.open(model, max_ctx=96, prefill_chunk=16)
np.save(out, e.session().feed(toks, all_logits=True))
s = e.session()
print(json.dumps({"mechanism": side_stream.MECHANISM, "greedy": list(e.session().generate(toks, 6)),
                  "device_loop": greedy_generate(s, int(np.argmax(s.feed(toks))), 6),
                  "drafted": list(SpeculativeSession(e, DSparkDrafter.open(e, "self")).generate(toks, 6))}))
"""


@pytest.mark.slow
def test_an_engine_gives_the_same_bits_with_the_side_stream(synthetic_model, tmp_path):
    model = str(synthetic_model("deepseek41", "tiny", "mxfp4", draft_stages=2))
    runs = {}
    for switch in ("1", "0"):
        out = tmp_path / f"logits{switch}.npy"
        env = {**os.environ, "JDS41_SIDE_STREAM": switch, "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", _ENGINE_RUN, model, str(out)], env=env, capture_output=True,
                              text=True, timeout=900, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[switch] = (json.loads(done.stdout.strip().splitlines()[-1]), np.load(out))
    (on, on_logits), (off, off_logits) = runs["1"], runs["0"]
    assert on["mechanism"].startswith("compute_on") and off["mechanism"] == "off"  # the annotated path really ran
    np.testing.assert_array_equal(on_logits, off_logits)
    assert on["greedy"] == off["greedy"] == on["device_loop"] == on["drafted"]
    assert off["device_loop"] == off["drafted"] == off["greedy"]
