"""Training loop: a resumed run reproduces the uninterrupted loss curve, the aux-loss-free bias update pushes
routing toward balance, and the schedule / batches are pure functions of the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import tiny_setup

from experiments.train.evaluate import skew
from experiments.train.forward import engram_ids_batch, forward
from experiments.train.train import (
    TrainConfig,
    batch_for_step,
    bias_update,
    init_state,
    load_checkpoint,
    lr_at,
    save_checkpoint,
    train,
)

TC = TrainConfig(batch=2, seq_len=32, warmup=2, moe_block=8, remat=False, dtype="float32", peak_lr=3e-3)


def _quiet(_event):
    pass


@pytest.mark.slow
def test_resume_reproduces_the_loss_curve(tmp_path):
    cfg, params, buffers, hasher, _ = tiny_setup()
    stream = np.tile(np.random.default_rng(0).integers(8, 200, 300), 20).astype(np.uint16)
    _, straight = train(cfg, TC, init_state(TC, params, buffers), stream, hasher, total_steps=4, log=_quiet)
    state, first = train(cfg, TC, init_state(TC, params, buffers), stream, hasher, max_steps=2, total_steps=4,
                         log=_quiet)
    save_checkpoint(str(tmp_path / "ckpt.npz"), state, 2, 4)
    del state
    restored, step, total = load_checkpoint(str(tmp_path / "ckpt.npz"), init_state(TC, params, buffers))
    assert (step, total) == (2, 4)
    _, second = train(cfg, TC, restored, stream, hasher, start_step=step, total_steps=total, log=_quiet)
    assert len(straight["losses"]) == 4 and np.isfinite(straight["losses"]).all()
    np.testing.assert_allclose(first["losses"] + second["losses"], straight["losses"], rtol=1e-6)


def test_bias_update_moves_routing_toward_balance():
    cfg, params, buffers, hasher, _ = tiny_setup(seed=4)
    scored = [i for i in range(cfg.n_layers) if not cfg.is_hash_layer(i)]
    for i in scored:  # expert 0's router row is 6x larger: it wins most tokens before any correction
        buffers["blocks"][i]["exp_probs_b"] = np.zeros(cfg.n_experts, np.float32)
        params["blocks"][i]["ffn_gate_inp"][0] *= 6.0
    tokens = np.random.default_rng(2).integers(8, cfg.vocab_size, (4, 32))
    ids = jnp.asarray(engram_ids_batch(hasher, tokens))
    p = jax.tree.map(jnp.asarray, params)
    counts_of = jax.jit(lambda b: forward(cfg, p, b, jnp.asarray(tokens, jnp.int32), ids, block=8)[1]["counts"])
    b = jax.tree.map(jnp.asarray, buffers)
    before = np.asarray(counts_of(b))
    for _ in range(40):
        b = bias_update(cfg, b, counts_of(b), 0.02)
    after = np.asarray(counts_of(b))
    for i in scored:
        assert skew(after[i], 0.125) < skew(before[i], 0.125) - 0.05, (before[i], after[i])
        assert float(b["blocks"][i]["exp_probs_b"][0]) < 0  # the overloaded expert's bias went down
    for i in range(cfg.n_hash_layers):  # hash layers have no bias and keep their frozen routing
        assert "exp_probs_b" not in b["blocks"][i]
        np.testing.assert_array_equal(after[i], before[i])


def test_schedule_and_batches_are_functions_of_the_step():
    stream = np.arange(10_000, dtype=np.uint16)
    np.testing.assert_array_equal(batch_for_step(stream, 7, TC), batch_for_step(stream, 7, TC))
    assert not np.array_equal(batch_for_step(stream, 7, TC), batch_for_step(stream, 8, TC))
    lrs = [lr_at(TC, s, 50) for s in range(50)]
    assert lrs[0] < lrs[1] == pytest.approx(TC.peak_lr) and lrs[-1] == pytest.approx(TC.peak_lr * 0.1, rel=0.02)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_plan_s_spreads_one_schedule_over_several_calls():
    """With `plan_s`, the step count is planned for that much training in all; a call whose deadline comes first
    stops with the schedule unfinished (run.py then checkpoints and a resumed call continues it)."""
    import time

    stream = np.arange(4000, dtype=np.uint16) % 200 + 8

    metrics = {"ce": np.float32(1.0), "indexer": np.float32(0.0), "grad_norm": np.float32(1.0),
               "counts": np.zeros((1, 4))}

    def fake_step(state, tokens, ids, lr):  # 20 ms a step: the plan is a function of the measured step time
        time.sleep(0.02)
        return state, metrics

    tc = TrainConfig(batch=1, seq_len=16, warmup=1)
    jnp.asarray(np.zeros(17)).block_until_ready()  # the backend starts here, not inside the timed window
    _, s = train(None, tc, {}, stream, None, deadline=time.time() + 0.4, plan_s=1.2, plan_after=3, log=_quiet,
                 step_fn=fake_step, batch_fn=lambda stream, step, tc, hasher: (np.zeros((1, 17)), np.zeros(1)))
    assert 40 <= s["total_steps"] <= 59  # ~1.2 s of 20 ms steps, less the 3% margin (sleep overshoots a little)
    assert s["steps"] < s["total_steps"]  # the deadline came first: unfinished, to be resumed
