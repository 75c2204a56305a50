"""Placement never changes results: every split of the routed experts across HBM, pinned host and SSD, and every
slot-cache size, gives bit-identical logits and greedy tokens to the plain all-resident model (DESIGN.md §3).

The SSD tier here is the real one: O_DIRECT reader threads on the GGUF file and the slot cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from jds41.checkpoints import open_model
from jds41.engine import Engine
from jds41.tiers.experts import place_experts
from jds41.tiers.ssd import ExpertReader
from jds41.tiers.stores import ExpertLayout, build_stores
from jds41.weights import load_params


def _placement(cfg, kind: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    E = cfg.n_experts
    tiers = {
        "all-hbm": lambda: np.zeros(E, int), "all-host": lambda: np.ones(E, int), "all-ssd": lambda: np.full(E, 2),
        "mixed": lambda: rng.integers(0, 3, E),
        "ssd-heavy": lambda: np.where(rng.random(E) < 0.8, 2, rng.integers(0, 2, E)),
    }[kind]
    out = {}
    for layer in range(cfg.n_layers):
        t = tiers()
        count = {0: 0, 1: 0, 2: 0}
        for e in range(E):
            out[(layer, e)] = (int(t[e]), count[int(t[e])])
            count[int(t[e])] += 1
    return out


# Each placement compiles its own program (tier stacks have their own shapes): the matrix stays small but
# exercises every tier kind in both architectures, and slot caches from "barely fits one step" to "holds all".
CASES = [("deepseek41", ("all-hbm", 0), ("mixed", 4), ("mixed-selected", 4), ("ssd-heavy", 2), ("ssd-heavy", 64)),
         ("deepseek4", ("all-host", 0), ("all-ssd", 3))]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_placement_and_cache_size_gives_identical_logits(synthetic_model, case):
    arch, *placements = case
    path = synthetic_model(arch, "tiny", "q8")
    engine = Engine.open(str(path), max_ctx=64)
    model = open_model(path)
    layout = ExpertLayout.from_model(model)
    tokens = np.random.default_rng(1).integers(8, engine.vocab_size, 16).tolist()
    want = engine.session().feed(tokens, all_logits=True)
    for kind, slots in placements:
        host_fetch = "selected" if kind.endswith("-selected") else "all"  # move only the selected host rows
        with ExpertReader(layout) as reader:
            stores = build_stores(layout, _placement(engine.cfg, kind.removesuffix("-selected")), reader,
                                  n_slots=max(slots, 1))
            params = place_experts(load_params(engine.cfg, model), stores, layout, host_fetch)
            got = engine.with_params(params).session().feed(tokens, all_logits=True)
            np.testing.assert_array_equal(got, want, err_msg=f"placement {kind}, {slots} slots")
            if stores.ssd is not None:
                s = stores.ssd.stats.to_dict()
                assert s["lookups"] > 0, s  # the SSD tier was really read through the slot cache
                assert 0 < s["host_calls"] <= s["answer_rows"] and s["host_call_s"] > 0, s


@pytest.mark.slow
def test_placement_gives_identical_logits_at_a_row_width(synthetic_model):
    """The same at decode width 4: 32 prompt tokens in eight 4-row blocks (prefill_rows when resident, the
    layer-major rows pass when tiered) and 8 width-4 decode steps. An all-HBM layer indexes its tier-0 stack
    directly and a mixed one gathers the union (prefill.routed_stacks): both give the resident bits."""
    path = synthetic_model("deepseek41", "tiny", "q8")
    engine = Engine.open(str(path), max_ctx=96, decode_width=4)
    model = open_model(path)
    layout = ExpertLayout.from_model(model)
    tokens = np.random.default_rng(2).integers(8, engine.vocab_size, 40).tolist()
    want = engine.session().feed(tokens, all_logits=True)
    for kind in ("all-hbm", "mixed", "mixed-selected"):
        host_fetch = "selected" if kind.endswith("-selected") else "all"  # the union's host rows in compact moves
        with ExpertReader(layout) as reader:
            stores = build_stores(layout, _placement(engine.cfg, kind.removesuffix("-selected")), reader, n_slots=4)
            params = place_experts(load_params(engine.cfg, model), stores, layout, host_fetch)
            got = engine.with_params(params).session().feed(tokens, all_logits=True)
            np.testing.assert_array_equal(got, want, err_msg=f"placement {kind} at width 4")


@pytest.mark.slow
def test_ssd_read_error_fails_the_request_cleanly(synthetic_model):
    """EIO from the SSD tier mid-step: the request fails with an error naming the file, layer and expert; no
    wrong token is returned, nothing hangs, and the engine still serves requests that avoid the bad tier."""
    import errno
    import os

    from jds41.errors import Jds41Error

    path = synthetic_model("deepseek41", "tiny", "q8")
    engine = Engine.open(str(path), max_ctx=64)
    model = open_model(path)
    layout = ExpertLayout.from_model(model)
    armed = {"on": False}

    def failing_read(fd, buf, offset):
        if armed["on"]:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return os.preadv(fd, [buf], offset)

    with ExpertReader(layout, read_fn=failing_read, timeout_s=5) as reader:
        stores = build_stores(layout, _placement(engine.cfg, "all-ssd"), reader, n_slots=4)
        tiered = engine.with_params(place_experts(load_params(engine.cfg, model), stores, layout))
        armed["on"] = True
        with pytest.raises(Jds41Error, match=r"expert|EIO|Input/output"):
            tiered.session().feed([10, 11, 12])
    # the plain engine is untouched
    assert engine.session().feed([10, 11, 12]).shape == (engine.vocab_size,)


def test_a_piece_of_the_k_experts_gives_the_bits_of_the_whole_product_on_the_cpu():
    """A tier computes its share of a layer's K experts as a product over fewer rows; on XLA:CPU that product must
    sum each row in the order of the whole (the plain sum of a row's block partials did not: its order followed the
    product's shape from 8 blocks a row on)."""
    import jax
    import jax.numpy as jnp
    from gguf import GGMLQuantizationType as T

    from jds41.quant import QTensor, qmatvec_experts
    from jds41.quant.random_blocks import random_quantized

    rng = np.random.default_rng(7)
    for n_out, n_in in ((256, 256), (64, 96 * 32), (128, 5120)):  # 8, 96 and 160 blocks a row (96: odd halves)
        stack = QTensor.from_raw(random_quantized(rng, T.Q8_0, (8, n_out, n_in)), T.Q8_0, (8, n_out, n_in))
        x = jnp.asarray(rng.standard_normal(n_in), jnp.float32)
        xs = jnp.asarray(rng.standard_normal((6, n_in)), jnp.float32)
        idx = jnp.asarray([3, 1, 7, 0, 5, 2], jnp.int32)
        product = jax.jit(lambda x, i, w=stack: qmatvec_experts(x, w, i))
        whole, whole_rows = np.asarray(product(x, idx)), np.asarray(product(xs, idx))
        for start, size in ((0, 1), (3, 1), (1, 2), (2, 4)):
            piece = slice(start, start + size)
            np.testing.assert_array_equal(np.asarray(product(x, idx[piece])), whole[piece])
            np.testing.assert_array_equal(np.asarray(product(xs[piece], idx[piece])), whole_rows[piece])


@pytest.mark.slow
def test_decode_steps_under_int8_keep_the_resident_bits_with_host_and_ssd_experts(synthetic_model, tmp_path):
    """Token by token (prefill_chunk 0: every position is a decode step) under the int8 numerics with MXFP4
    experts, whose routing weight follows W_down: host and SSD placements give the resident logits bit for bit.
    Before the tiers weighed those outputs after their branches, as the resident layer does, XLA:CPU contracted
    the resident layer's multiply and sum into fused multiply-adds and not the tiers', and the logits moved by an
    ulp (experiments/README.md, forty-first session)."""
    import json

    path = str(synthetic_model("deepseek41", "tiny", "mxfp4"))
    tokens = np.random.default_rng(3).integers(8, 400, 10).tolist()
    want = Engine.open(path, max_ctx=32, prefill_chunk=0, numerics="int8").session().feed(tokens, all_logits=True)
    for name, hbm, host in (("host", 0.0, 1.0), ("ssd", 0.0, 0.0)):
        prof = tmp_path / f"{name}.json"
        prof.write_text(json.dumps({"name": name, "tier0_bytes": hbm, "tier1_bytes": host, "placement_source":
                                    "uniform", "slot_cache_slots": 2, "lookahead": 1,
                                    "router_lean": {"enabled": False}}))
        got = Engine.open(path, max_ctx=32, prefill_chunk=0, numerics="int8", profile=str(prof)).session().feed(
            tokens, all_logits=True)
        np.testing.assert_array_equal(got, want, err_msg=name)
