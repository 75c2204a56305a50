"""MoE experts: the K routed SwiGLU experts of a token and the always-on shared expert (MODEL.md §2.5,
LLAMACPP_DEEPSEEK4.md §3 FFN paragraph).

Owns `routed_experts` / `shared_expert` (one token) and their `*_rows` forms (T tokens). One expert:
  gate_F = W_gate x, up_F = W_up x                                    (f32)
  if limit > 1e-6: gate = min(gate, limit), up = clip(up, -limit, limit)   (asymmetric SwiGLU clamp)
  h_F = silu(gate) * up * weight                                      (routing weight applied BEFORE down)
  y_D = W_down h               (llama.cpp numerics, act_round set: y_D = weight * W_down(silu(gate) * up))
The token's output is y_0 + y_1 + ... + y_{K-1} in routing order (fixed left-to-right adds); the shared expert is
the same computation with weight 1 and its own clamp (`swiglu_limit_shexp`), added by the caller.

Weights are QTensors: routed stacks gate/up [E, F, D] and down [E, D, F], shared [F*S, D] / [D, F*S]. Routed
products go through `qmatvec_experts`, which gathers only the K selected experts' bytes: no other expert is read,
so a layer never needs (or touches) unselected experts, whatever tier they live in. A layer receives its expert
stacks as arguments and does not know where they came from.

Row invariance (rowwise.py): the one-token functions are fusion islands and the `*_rows` forms map them over
tokens (each token its own idx/weights), so row t is bit-identical to decode of token t for any T; no capacity,
no dropping, no batch-dependent grouping (MODEL.md §4 "token-independent MoE").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jds41.layers.rowwise import island, map_rows
from jds41.layers.side_stream import on_side_stream
from jds41.quant import co_launch, qmatvec, qmatvec_experts, qmatvec_experts_parts, qmatvec_parts
from jds41.quant.qtensor import PreRounded
from jds41.quant.swiglu_kernel import SwiGLU, swiglu  # swiglu: XLA's spelling, the reference (grouped experts too)


def expert_outputs(x_D: jax.Array, gate_exps, up_exps, down_exps, idx_K: jax.Array, weight_K: jax.Array, limit,
                   tile_k: int | None = None, weigh_after_down: bool = True) -> jax.Array:
    """Each of the K routed experts' weighted output of one token, [K, D] f32 (not summed). `tile_k`: the K whose
    kernel tile every product uses (tiers compute a layer's K experts in pieces, owner by owner, and each piece
    must sum in the order of the whole: quant/triton_matvec.default_tile); None = this call's K.
    `weigh_after_down` False leaves a weight that follows W_down to the caller (the tiers, below)."""
    # gate and up: one kernel launch on CUDA (JDS41_SHARED_LAUNCH=0 for two: quant/qtensor.py), the same bits either way
    g_KF, u_KF = qmatvec_experts_parts(x_D, (gate_exps, up_exps), idx_K, tile_k=tile_k)
    # llama.cpp (build_moe_ffn) scales by the routing weight AFTER W_down. Exact algebra makes the order moot, but
    # where W_down rounds its activation (Q8_0 rounds h, not weight*h) it is not: follow llama.cpp there.
    if not down_exps.rounds_activation:
        return qmatvec_experts(swiglu(g_KF, u_KF, limit) * weight_K[:, None], down_exps, idx_K, tile_k=tile_k)
    # the hidden values and their rounding are one launch on CUDA (quant/swiglu_kernel.py), as in every FFN path
    y_KD = qmatvec_experts(SwiGLU.of(g_KF, u_KF, limit), down_exps, idx_K, tile_k=tile_k)
    return y_KD * weight_K[:, None] if weigh_after_down else y_KD


def sum_experts(y_KD: jax.Array) -> jax.Array:
    """y_0 + y_1 + ... + y_{K-1}, in routing order (fixed left-to-right adds)."""
    y_D = y_KD[0]
    for k in range(1, y_KD.shape[0]):
        y_D = y_D + y_KD[k]
    return y_D


def routed_experts(x_D: jax.Array, gate_exps, up_exps, down_exps, idx_K: jax.Array, weight_K: jax.Array,
                   limit) -> jax.Array:
    """Sum of the K routed experts of one token -> [D]. gate/up_exps [E, F, D], down_exps [E, D, F] QTensors."""
    x_D, idx_K, weight_K = island((jnp.asarray(x_D, jnp.float32), jnp.asarray(idx_K, jnp.int32),
                                   jnp.asarray(weight_K, jnp.float32)))
    return island(sum_experts(expert_outputs(x_D, gate_exps, up_exps, down_exps, idx_K, weight_K, limit)))


def shared_expert(x_D: jax.Array, gate, up, down, limit) -> jax.Array:
    """The shared expert of one token (weight 1) -> [D]. gate/up [F*S, D], down [D, F*S] QTensors. It does not
    depend on the routed experts: with the side stream's site "shared" on (JDS41_SIDE_STREAM) its kernels run on a
    second CUDA stream beside theirs (layers/side_stream.py), the same values."""
    def body(x_D, gate, up, down):
        h_F = SwiGLU.of(*qmatvec_parts(x_D, (gate, up)), limit)  # one launch where switched on, as above
        return qmatvec(h_F, down)  # h computed in its CUDA branch (quant/swiglu_kernel.py), as in routed_and_shared

    return island(on_side_stream("shared", body, island(jnp.asarray(x_D, jnp.float32)), gate, up, down))


def routed_and_shared(x_D: jax.Array, routed: tuple, idx_K: jax.Array, weight_K: jax.Array, limit,
                      shared: tuple | None, limit_shexp, x_blocks: tuple | None = None) -> jax.Array:
    """`routed_experts(x_D, *routed, idx_K, weight_K, limit) + shared_expert(x_D, *shared, limit_shexp)` (the shared
    term left out where `shared` is None), the same bits. Where quant/co_launch.py is on (the default on CUDA;
    JDS41_CO_LAUNCH=0 turns it off) and every product is a kernel's, the routed and shared gate/up products are
    one launch and the two down products another: the shared expert's bandwidth-bound Q8_0 programs then run
    beside the routed experts' instruction-bound two-bit ones instead of after them. The values around the
    launches are the separate functions' own ops in their own islands. `x_blocks`: x's int8 blocks (q, d) as
    int8_act.round_int8 gives them, computed with x (model.rounds_ffn_input): the gate/up launch reads them rather
    than rounding x again (the same bits)."""
    if shared is None or not co_launch.ENABLED:
        y = routed_experts(x_D, *routed, idx_K, weight_K, limit)
        return y if shared is None else y + shared_expert(x_D, *shared, limit_shexp)
    gate_exps, up_exps, down_exps = routed
    gate, up, down = shared
    x_r, idx_K, weight_K = island((jnp.asarray(x_D, jnp.float32), jnp.asarray(idx_K, jnp.int32),
                                   jnp.asarray(weight_K, jnp.float32)))
    x_s = island(jnp.asarray(x_D, jnp.float32))
    if x_blocks is not None:  # (the shared gate/up reads them too where its Q8_0 rounds, JDS41_INT8_Q8_0=1)
        x_r = PreRounded(x_r, *island(tuple(x_blocks)))
        x_s = PreRounded(x_s, *island(tuple(x_blocks)))
    # each gate/up pair's values side by side ([.., 2F], `joint`), as SwiGLU holds them
    gu_K2F, gu_2F = co_launch.products((co_launch.Experts(x_r, (gate_exps, up_exps), idx_K),
                                        co_launch.Dense(x_s, (gate, up))), joint=True)
    # both hidden activations, and the routed one's int8 rounding, in one launch on CUDA (quant/swiglu_kernel.py)
    h_KF, h_F = SwiGLU(gu_K2F, limit), SwiGLU(gu_2F, limit_shexp)
    if not down_exps.rounds_activation:  # the routing weight before or after W_down, as `expert_outputs`
        h_KF = h_KF.value() * weight_K[:, None]
    (y_KD,), (y_s,) = co_launch.products((co_launch.Experts(h_KF, (down_exps,), idx_K),
                                          co_launch.Dense(h_F, (down,))))
    if down_exps.rounds_activation:
        y_KD = y_KD * weight_K[:, None]
    return island(sum_experts(y_KD)) + island(y_s)


def routed_experts_rows(x_TD: jax.Array, gate_exps, up_exps, down_exps, idx_TK: jax.Array, weight_TK: jax.Array,
                        limit) -> jax.Array:
    """`routed_experts` for T tokens, each with its own experts -> [T, D]; row t equals decode of token t."""
    return map_rows(lambda x_D, idx_K, w_K: routed_experts(x_D, gate_exps, up_exps, down_exps, idx_K, w_K, limit),
                    jnp.asarray(x_TD, jnp.float32), jnp.asarray(idx_TK, jnp.int32), jnp.asarray(weight_TK, jnp.float32))


def shared_expert_rows(x_TD: jax.Array, gate, up, down, limit) -> jax.Array:
    """`shared_expert` for T tokens -> [T, D]; row t equals decode of token t."""
    return map_rows(lambda x_D: shared_expert(x_D, gate, up, down, limit), jnp.asarray(x_TD, jnp.float32))
