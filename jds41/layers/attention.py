"""Attention for one token: shared-latent MQA over the window ring plus compressed rows, with a sink.

Owns the attention sublayer's math and its window ring (MODEL.md §2.2, LLAMACPP_DEEPSEEK4.md §3):
- query: qr = RMSNorm(h @ W_qa) * q_a_norm; q = qr @ W_qb per head; V4 RMS-normalises each head (no weight);
  RoPE on the last rope dims at the token position;
- one K = V latent per token: kv = RMSNorm(h @ W_kv) * kv_norm, RoPE likewise, written into a ring of
  `window + slack` rows (slot = position mod ring size). Attention reads the ring through `window_rows`: the rows
  of positions p-window+1 .. p in position order, masked by the position each slot holds. So the slack never
  changes what (or in which order) attention sums, and speculative verification (jds41/speculative.py) can write
  up to `slack` positions past the accepted prefix without evicting a row a later query still needs;
- keys = the window rows plus compressed rows (all visible ones for HCA, the indexer's top-k for CSA);
  score = q.k / sqrt(head_dim); one softmax per head over all keys plus a learned sink logit that sits in the
  denominator only; output = weighted sum of the same latents;
- inverse RoPE on the output's last rope dims at the query position, then the grouped low-rank output:
  heads split into o_groups, group g's heads times its block of W_oa, the concatenation times W_ob.
Compression and indexing live in compressor.py / indexer.py; model.py decides which rows a layer reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jds41.config import ModelConfig
from jds41.layers import attention_kernel, sink_softmax_kernel
from jds41.layers.norm import rms_norm
from jds41.layers.rope import apply_rope
from jds41.layers.side_stream import on_side_stream
from jds41.quant import qmatvec, qmatvec_experts, qmatvec_made

HIGHEST = jax.lax.Precision.HIGHEST


def init_ring(cfg: ModelConfig, slack: int = 0) -> dict[str, jax.Array]:
    return {"kv": jnp.zeros((cfg.window + slack, cfg.head_dim), jnp.float32),
            "pos": jnp.full((cfg.window + slack,), -1, jnp.int32)}


def window_rows(ring: dict, window: int, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(kv [window, HD], valid [window]): the rows of positions pos-window+1 .. pos, oldest first, whatever the
    ring size; a row is valid when its slot holds exactly that position (not empty, not a stale or later one)."""
    want = pos - window + 1 + jnp.arange(window, dtype=jnp.int32)
    slots = want % ring["kv"].shape[0]
    return ring["kv"][slots], (want >= 0) & (ring["pos"][slots] == want)


def query(cfg: ModelConfig, w: dict, h_D: jax.Array, made: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """(q [H, HD] as W_qb gives it, qr [q_lora_rank]): q is not yet normalised a head nor rotated (`attend` does
    both); qr also feeds the indexer. `made`: products of h_D already computed (`qmatvec_made`)."""
    qr = rms_norm(qmatvec_made(h_D, w, "attn_q_a", made), w["attn_q_a_norm"], cfg.rms_eps)
    return qmatvec(qr, w["attn_q_b"]).reshape(cfg.n_heads, cfg.head_dim), qr


def latent(cfg: ModelConfig, w: dict, h_D: jax.Array, pos: jax.Array, freqs: jax.Array, made: dict | None = None
           ) -> jax.Array:
    """The token's K = V latent [HD], normalised and rotated, from h_D @ W_kv (`made`'s where it holds it). It does
    not depend on the query: with the side stream's site "latent" on (JDS41_SIDE_STREAM) its kernels, the product
    too, run on a second CUDA stream beside the query's (layers/side_stream.py)."""
    def turned(kv_t, norm_w, pos, freqs):
        return apply_rope(rms_norm(kv_t, norm_w, cfg.rms_eps), pos, freqs)

    if made is not None and "attn_kv" in made:
        return turned(made["attn_kv"], w["attn_kv_a_norm"], pos, freqs)
    return on_side_stream("latent", lambda h_D, kv_w, *rest: turned(qmatvec(h_D, kv_w), *rest),
                          h_D, w["attn_kv"], w["attn_kv_a_norm"], pos, freqs)


def push_ring(ring: dict, kv: jax.Array, pos: jax.Array) -> dict:
    slot = pos % ring["kv"].shape[0]
    return {"kv": jax.lax.dynamic_update_index_in_dim(ring["kv"], kv, slot, 0),
            "pos": jax.lax.dynamic_update_index_in_dim(ring["pos"], pos, slot, 0)}


def attend(cfg: ModelConfig, w: dict, q_HK: jax.Array, keys_NK: jax.Array | None, valid_N: jax.Array | None,
           pos: jax.Array, freqs: jax.Array, ring: dict | None = None) -> jax.Array:
    """The attention output [H, HD] of `query`'s q at position `pos`, turned back (inverse RoPE) for W_oa, over the
    window's rows of `ring` (`window_rows`, where a ring is given) and then keys [N, HD] with valid [N] (None:
    none). On CUDA with JDS41_ATTN_KERNEL=1, layers/attention_kernel.py's one launch (which also normalises and
    turns q, turns the output back, and reads the window's rows where they lie in the ring); the XLA spelling
    (`window_rows`, the keys joined after them, `attend_xla`) is the reference."""
    sink_H = w["attn_sinks"]

    def xla(q_HK, ring, keys_NK, valid_N, pos):
        if ring is not None:
            win_kv, win_valid = window_rows(ring, cfg.window, pos)
            keys_NK = win_kv if keys_NK is None else jnp.concatenate([win_kv, keys_NK])
            valid_N = win_valid if valid_N is None else jnp.concatenate([win_valid, valid_N])
        return attend_xla(cfg, sink_H, q_HK, keys_NK, valid_N, pos, freqs)

    if attention_kernel.applies(q_HK.shape[-1]):
        return attention_kernel.attend(q_HK, ring, keys_NK, valid_N, sink_H, pos, freqs, cfg.head_dim ** -0.5,
                                       cfg.rms_eps if cfg.q_head_norm else None,
                                       cfg.window if ring is not None else 0, default=xla)
    return xla(q_HK, ring, keys_NK, valid_N, pos)


def attend_xla(cfg: ModelConfig, sink_H: jax.Array, q_HK: jax.Array, keys_NK: jax.Array, valid_N: jax.Array,
               pos: jax.Array, freqs: jax.Array) -> jax.Array:
    """`attend` as XLA computes it (the reference of the kernels): V4's head norm, RoPE of q, the softmax over the
    valid keys with the sink in the denominator, the weighted sum of the latents, inverse RoPE."""
    if cfg.q_head_norm:
        q_HK = rms_norm(q_HK, None, cfg.rms_eps)
    q_HK = apply_rope(q_HK, pos, freqs)
    # HIGHEST: XLA:GPU runs a DEFAULT-precision f32 dot in TF32 (10-bit mantissa); on the H200 that put the wide
    # prompt pass 7e-4 away from decode on logits of size 4 (tests/test_prompt_width.py), where f32 keeps 2e-6.
    s_HN = jnp.einsum("hk,nk->hn", q_HK, keys_NK, precision=HIGHEST)
    scale = cfg.head_dim ** -0.5
    if sink_softmax_kernel.applies(s_HN.shape[-1]):  # one launch for the four kernels below, where switched on
        p_HN = sink_softmax_kernel.sink_softmax(s_HN, valid_N, sink_H, scale,
                                                default=lambda s, v, k: _sink_softmax(s, v, k, scale))
    else:
        p_HN = _sink_softmax(s_HN, valid_N, sink_H, scale)
    o_HK = jnp.einsum("hn,nk->hk", p_HN, keys_NK, precision=HIGHEST)
    return apply_rope(o_HK, pos, freqs, inverse=True)


def _sink_softmax(s_HN: jax.Array, valid_N: jax.Array, sink_H: jax.Array, scale: float) -> jax.Array:
    """The attention weights of raw scores s [H, N]: softmax over the valid keys with the sink in the denominator
    (the reference of layers/sink_softmax_kernel.py)."""
    logits = jnp.where(valid_N[None, :], s_HN * scale, -jnp.inf)
    top = jnp.maximum(jnp.max(logits, axis=1), sink_H)
    e = jnp.exp(logits - top[:, None])
    denom = jnp.sum(e, axis=1) + jnp.exp(sink_H - top)
    return e / denom[:, None]


def output(cfg: ModelConfig, w: dict, o_HK: jax.Array) -> jax.Array:
    """`attend`'s output (turned back) through the grouped W_oa, then W_ob; returns [D]."""
    G, L = cfg.o_groups, cfg.o_lora_rank
    o_GX = o_HK.reshape(G, -1)  # group g = heads g*H/G .. (g+1)*H/G - 1, concatenated
    # W_oa rows g*L .. (g+1)*L - 1 belong to group g: viewed as a [G, L, X] stack, each group is one "expert".
    wo_a = w["attn_output_a"]
    stack = wo_a.with_rows(jnp.asarray(wo_a.data).reshape(G, L, -1), (G, L, wo_a.shape[-1]))
    o_GL = qmatvec_experts(o_GX, stack, jnp.asarray(np.arange(G, dtype=np.int32)))  # a constant: its clamp folds
    return qmatvec(o_GL.reshape(-1), w["attn_output_b"])
