"""Continuous batching on the device: N decode states stacked on a leading slot axis, one jitted step for all.

The scheduler (scheduler.py) owns which request sits in which slot; this file owns only the arrays. The slot
count N is static, so one compiled `batched_step` serves every mix of requests: a free slot runs a dummy token on
whatever state it holds and its logits are ignored, and a new request's prefilled state is written into its slot
with `write_slot` (the slot index is traced, so that does not recompile either).

Arithmetic: `batched_step` is `jax.vmap` of `jds41.model.step` over (state, token, Engram rows) with the
parameters shared. Batching N tokens turns the per-token matvecs into [N, D] x [D, F] matmuls, which is the point
(the weights are read once per step for all slots) but also means the batched program is not bit-identical to the
one-token `decode_step` (it agrees to ~1e-6 on the tiny models). What serving needs, and what the tests check, is
that a slot's row does not depend on the other slots' contents or on which slot it occupies: each output row of a
matmul reads only its own input row, and every program has the same shapes whatever the occupancy, so a request's
greedy tokens are bit-identical alone or beside other requests. (A `map_rows` form would match `decode_step`
bit for bit, but it runs the slots one after another and reads the weights N times per step.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jds41 import model as M


def init_slots(plan: M.ModelPlan, n_slots: int) -> dict:
    """`init_state(plan)` repeated on a new leading slot axis [N, ...]."""
    one = M.init_state(plan)
    return jax.tree.map(lambda x: jnp.repeat(x[None], n_slots, axis=0), one)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def batched_step(plan: M.ModelPlan, params: dict, states: dict, tokens_N: jax.Array, engram_rows_N=None):
    """One token for each of N slots: (logits [N, V], states). `engram_rows_N` [N, n_engram_layers, buckets, bytes].

    The stacked state is donated: the step updates every slot's caches in place.
    """
    vmappable = dataclasses.replace(plan, ssd_call="always")  # no IO inside a vmapped cond

    def one(state, token, rows):
        return M.step(vmappable, params, state, token, rows)

    return jax.vmap(one)(states, tokens_N, engram_rows_N)


@functools.partial(jax.jit, donate_argnums=0)
def write_slot(states: dict, slot: jax.Array, state: dict) -> dict:
    """Put one sequence's state (e.g. fresh from prefill) into slot `slot` of the stacked state, in place."""
    return jax.tree.map(lambda all_, one: all_.at[slot].set(one), states, state)


@jax.jit
def read_slot(states: dict, slot: jax.Array) -> dict:
    """A copy of slot `slot`'s state (for tests and, later, prefix-cache snapshots)."""
    return jax.tree.map(lambda all_: all_[slot], states)
