"""`jax.eval_shape` of the full-size models: the whole decode step traces at real V4.1-Flash / V4-Flash shapes
(40 / 43 layers, 384 / 256 experts, 129280 vocab) without allocating their hundreds of GB."""

from __future__ import annotations

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41 import model as M
from jds41.checkpoints.presets import preset
from jds41.checkpoints.synth import choose_types
from jds41.weights import abstract_params


@pytest.mark.slow
@pytest.mark.parametrize("arch,quant", [("deepseek41", "ds4-q2"), ("deepseek4", "mxfp4")])
def test_full_decode_step_eval_shape(arch, quant):
    cfg = preset(arch, "full")
    types, _ = choose_types(cfg, quant)
    plan = M.make_plan(cfg, 65536)
    tracemalloc.start()
    params = abstract_params(cfg, types)
    state = jax.eval_shape(lambda: M.init_state(plan))
    rows = None
    if cfg.engram is not None:
        e = cfg.engram
        rows = jax.ShapeDtypeStruct((len(e.layer_ids), e.n_buckets, e.row_bytes), jnp.uint8)
    logits, new_state = jax.eval_shape(lambda p, s, t, r: M.step(plan, p, s, t, r), params, state,
                                       jax.ShapeDtypeStruct((), jnp.int32), rows)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert logits.shape == (cfg.vocab_size,) and logits.dtype == jnp.float32
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)))
    n_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert n_bytes > 100e9  # the real thing: V4.1 ~ 300+ GB of weights (Engram aside), V4 ~ 150 GB
    assert peak < 1e9  # ... and tracing it allocated well under 1 GB of Python memory
