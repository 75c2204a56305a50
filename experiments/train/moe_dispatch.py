"""Routed experts for a batch of tokens without dropping any: sort the (token, expert) pairs by expert, pad each
expert's run to whole blocks, and multiply block by block with that block's expert weights.

Why this shape: inference routes every token to exactly its K experts (no capacity), so training must too. A
dense one-hot dispatch would compute all E experts per token (E/K = 16x the work for 64 experts top-4); a grouped
matmul with data-dependent group sizes is what we want, and the static form of it is "blocks": with N*K pairs and
E experts, padding every expert's run up to a multiple of `block` rows needs at most N*K + E*(block-1) rows, a
static bound. Each block belongs to one expert, so the products are one batched matmul
[n_blocks, block, D] x [n_blocks, D, F]: only sort, gather, scatter-add and dot_general, which XLA runs and
differentiates on any backend. The per-block weight gather costs n_blocks*D*F values per matrix; choose `block`
so that is small next to the activations (256 for ~65k tokens of a 64-expert layer).

Per pair the math is `jds41.layers.moe.routed_experts` with act_round None: h = swiglu(gate, up) * weight, then
W_down h, summed over the token's K experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.train.mixed import dot
from jds41.layers.moe import swiglu

F32 = jnp.float32


def dispatch_plan(idx_NK: jax.Array, n_experts: int, block: int):
    """Sorted layout of the N*K (token, expert) pairs: (token of each pair in sorted order, destination row of
    each sorted pair in the padded buffer, expert of each block, buffer rows)."""
    N, K = idx_NK.shape
    M = N * K
    flat = idx_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    padded = (counts + block - 1) // block * block
    start_pad = jnp.cumsum(padded) - padded
    start = jnp.cumsum(counts) - counts
    dest = start_pad[sorted_e] + jnp.arange(M, dtype=jnp.int32) - start[sorted_e]
    n_blocks = -(-(M + n_experts * (block - 1)) // block)
    block_start = jnp.arange(n_blocks, dtype=jnp.int32) * block
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), block_start, side="right"), n_experts - 1)
    return order // K, order, dest, block_expert, n_blocks * block


def routed_experts_dispatch(x_ND, idx_NK, w_NK, gate_EFD, up_EFD, down_EDF, limit, dtype=F32, block: int = 256):
    """Sum over each token's K routed experts -> [N, D] f32 (no capacity, no dropping)."""
    N, D = x_ND.shape
    E = gate_EFD.shape[0]
    tok, order, dest, block_expert, rows = dispatch_plan(idx_NK, E, block)
    nb = rows // block
    xbuf = jnp.zeros((rows, D), dtype).at[dest].set(x_ND.astype(dtype)[tok])
    xb = xbuf.reshape(nb, block, D)
    g = dot("jbd,jfd->jbf", xb, gate_EFD.astype(dtype)[block_expert], dtype)
    u = dot("jbd,jfd->jbf", xb, up_EFD.astype(dtype)[block_expert], dtype)
    wbuf = jnp.zeros((rows,), F32).at[dest].set(w_NK.reshape(-1)[order]).reshape(nb, block, 1)
    h = swiglu(g, u, limit) * wbuf
    y = dot("jbf,jdf->jbd", h, down_EDF.astype(dtype)[block_expert], dtype)
    return jnp.zeros((N, D), F32).at[tok].add(y.reshape(rows, D)[dest])
