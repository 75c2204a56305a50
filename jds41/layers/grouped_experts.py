"""Routed experts for a whole prompt group at once, grouped by expert: the wide prompt pass (ModelPlan.prompt_width).

Decode computes a token's K experts as K multiply-and-sum matvecs over the experts' quantized bytes (moe.py), and
a layer-major group at the decode width repeats that per row: each of a 4,096-token group's 24,576 (token, expert)
pairs reads its expert's bytes again, through the sub-byte decode that XLA runs at 4-30% of HBM bandwidth
(experiments/README.md, "Where the step's time goes"). Here the pairs are sorted by expert and cut into tiles of
`tile` rows; each tile dequantizes its expert once and runs two [tile, D] x [D, F] products and one [tile, F] x
[F, D] product (quant.qmatmul_expert), so an expert's bytes are read once per tile instead of once per pair.

Bits. The tile shape is static, so every tile of every group, whatever its length, runs the same three `dot`
kernels; a row of a `dot` depends on its own input row only (checked on XLA:CPU and on the H200,
tests/test_grouped_experts.py and tests/test_gpu_paths.py), so a pair's result does not depend on which other pairs
share its tile, how many tiles the group has, or where in the tile it lands. The prompt logits of the wide pass
are therefore the same however a prompt is cut into pieces (tests/test_prompt_width.py). They are NOT the bits of
decode's matvecs (another summation order; they agree to f32 rounding, checked against a numpy re-derivation and
against `moe.routed_experts`): the prompt width is a numerics setting of its own, like the decode width.

A token's output is its K pair results added left to right in routing order, as in `moe.routed_experts`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jds41.quant import qmatmul_expert
from jds41.quant.swiglu_kernel import swiglu


def tile_plan(idx_P: jax.Array, n_experts: int, tile: int):
    """How P (token, expert) pairs with expert ids idx_P are cut into tiles of one expert each.

    Returns (order [P]: pair indices sorted by expert, stable; n_tiles (traced); tile_expert [S], tile_start [S]
    (offset of the tile's first row in `order`), tile_rows [S] (its live rows)) with S = P // tile + min(E, P),
    the static bound: expert e with c pairs takes ceil(c / tile) <= c / tile + 1 tiles."""
    P = idx_P.shape[0]
    S = P // tile + min(n_experts, P)
    order = jnp.argsort(idx_P, stable=True)
    count_E = jnp.zeros((n_experts,), jnp.int32).at[idx_P].add(1, mode="drop")
    first_E = jnp.cumsum(count_E) - count_E  # where expert e's pairs start in `order`
    tiles_E = (count_E + tile - 1) // tile
    tiles_end_E = jnp.cumsum(tiles_E)
    j = jnp.arange(S, dtype=jnp.int32)
    tile_expert = jnp.minimum(jnp.searchsorted(tiles_end_E, j, side="right"), n_experts - 1).astype(jnp.int32)
    local = j - (tiles_end_E[tile_expert] - tiles_E[tile_expert])  # the tile's index within its expert
    tile_start = first_E[tile_expert] + local * tile
    tile_rows = jnp.clip(count_E[tile_expert] - local * tile, 0, tile)
    return order, tiles_end_E[-1], tile_expert, tile_start, tile_rows


def grouped_routed_experts(x_TD: jax.Array, gate_exps, up_exps, down_exps, idx_TK: jax.Array, weight_TK: jax.Array,
                           limit, tile: int, n_valid=None) -> jax.Array:
    """Sum of each token's K routed experts -> [T, D] f32, computed expert by expert in `tile`-row tiles.
    gate/up_exps [E, F, D], down_exps [E, D, F] QTensors; idx_TK indexes them (any id in [0, E)). `n_valid`
    (traced): only the first n_valid tokens are computed; the pairs of the others get expert id E, which tile_plan
    counts for no expert (sorted after every real pair, in no tile), so they cost no tile and their rows stay zero.
    A valid pair's result is the same (a row of a `dot` depends on its own input row only)."""
    if tile < 2:
        raise ValueError(f"a grouped tile needs at least 2 rows (XLA:CPU runs one row as another kernel), got {tile}")
    T, K = idx_TK.shape
    P, D = T * K, x_TD.shape[-1]
    E = gate_exps.data.shape[0]
    x_TD = jnp.asarray(x_TD, jnp.float32)
    idx_P = jnp.asarray(idx_TK, jnp.int32).reshape(P)
    if n_valid is not None:
        idx_P = jnp.where(jnp.arange(P) < n_valid * K, idx_P, E)
    weight_P = jnp.asarray(weight_TK, jnp.float32).reshape(P)
    order, n_tiles, tile_expert, tile_start, tile_rows = tile_plan(idx_P, E, tile)
    row = jnp.arange(tile, dtype=jnp.int32)

    def one_tile(j, out_PD):
        e = tile_expert[j]
        pair = order[jnp.minimum(tile_start[j] + row, P - 1)]  # rows past the tile's live ones: dropped below
        x = x_TD[pair // K]
        weight = weight_P[pair][:, None]
        h = swiglu(qmatmul_expert(x, gate_exps, e), qmatmul_expert(x, up_exps, e), limit)
        # the routing weight before or after W_down, as moe.expert_outputs (llama.cpp's order where W_down rounds)
        if not down_exps.rounds_activation:
            y = qmatmul_expert(h * weight, down_exps, e)
        else:
            y = qmatmul_expert(h, down_exps, e) * weight
        return out_PD.at[jnp.where(row < tile_rows[j], pair, P)].set(y, mode="drop")

    out_PD = lax.fori_loop(0, n_tiles, one_tile, jnp.zeros((P, D), jnp.float32))
    y_TKD = out_PD.reshape(T, K, D)
    y_TD = y_TKD[:, 0]
    for k in range(1, K):
        y_TD = y_TD + y_TKD[:, k]
    return y_TD
