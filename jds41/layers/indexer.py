"""The lightning indexer: which compressed rows a sparse-attention (CSA) query reads.

Owns the indexer scoring and top-k selection (MODEL.md §2.3, LLAMACPP_DEEPSEEK4.md §3):
  q_h = (qr @ W_iq_b)[h] with RoPE at the query position; w = (h @ W_proj) / sqrt(ID * IH);
  score(b) = sum_h w_h * relu(q_h . k_b) over visible rows b < (p+1)//ratio; keep the top_k (all if fewer).
Index keys come from the V4 indexer's own ratio-4 compressor (jds41.layers.compressor, width ID) or, in the
V4.1 shared layout, from the shared compressed latent: k_b = k_norm(row_b @ W_k) (`index_keys_from_latent`).
llama.cpp and the reference rotate q and k by a Hadamard matrix first; it leaves dot products unchanged, so it
is omitted. V4.1's candidate blocks (top blocks of `candidate_block_size` rows by block-max score, picked at the
candidate source layer) arrive as a row mask that later index sources intersect with visibility.

Selections are fixed-size (static k) with a validity mask, so the graph never changes shape between steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jds41.layers.norm import rms_norm
from jds41.layers.rope import apply_rope
from jds41.quant import qmatvec, qmatvec_made

HIGHEST = jax.lax.Precision.HIGHEST


def index_scores(w: dict, qr: jax.Array, h_D: jax.Array, keys_RK: jax.Array, pos: jax.Array, freqs: jax.Array,
                 n_heads: int, head_dim: int, made: dict | None = None) -> jax.Array:
    """Raw indexer scores of every stored key row, [n_rows] (visibility not applied); `made`: products of h_D
    already computed (`qmatvec_made`)."""
    q_HK = qmatvec(qr, w["indexer.attn_q_b"]).reshape(n_heads, head_dim)
    q_HK = apply_rope(q_HK, pos, freqs)
    weights_H = qmatvec_made(h_D, w, "indexer.proj", made) * (head_dim * n_heads) ** -0.5
    dots_HR = jnp.einsum("hk,rk->hr", q_HK, keys_RK, precision=HIGHEST)  # f32, not TF32 (attention.attend)
    return jnp.einsum("h,hr->r", weights_H, jax.nn.relu(dots_HR), precision=HIGHEST)


def select_top_k(scores_R: jax.Array, allowed_R: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k allowed rows: (row ids [k], valid [k]); ties go to the lower row id (lax.top_k order)."""
    k = min(k, scores_R.shape[0])
    masked = jnp.where(allowed_R, scores_R, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    return idx, allowed_R[idx]


def candidate_block_mask(scores_R: jax.Array, allowed_R: jax.Array, block_size: int, n_blocks: int) -> jax.Array:
    """V4.1: rows inside the `n_blocks` best blocks of `block_size` rows by block-max score, as a row mask."""
    n_rows = scores_R.shape[0]
    pad = (-n_rows) % block_size
    masked = jnp.pad(jnp.where(allowed_R, scores_R, -jnp.inf), (0, pad), constant_values=-jnp.inf)
    block_max = masked.reshape(-1, block_size).max(axis=1)
    k = min(n_blocks, block_max.shape[0])
    _, best = jax.lax.top_k(block_max, k)
    keep = jnp.zeros(block_max.shape[0], bool).at[best].set(jnp.isfinite(block_max[best]))
    return jnp.repeat(keep, block_size)[:n_rows] & allowed_R


def index_key_from_latent(w: dict, row_W: jax.Array, pos: jax.Array, freqs: jax.Array, eps: float) -> jax.Array:
    """V4.1: one index key from a shared compressed latent row (512 -> 128, k_norm, RoPE at the row's start)."""
    k = rms_norm(qmatvec(row_W, w["indexer.attn_k"]), w["indexer.k_norm"], eps)
    return apply_rope(k, pos, freqs)
