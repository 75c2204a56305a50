"""The KV compressor: learned, gated pooling of `ratio` consecutive tokens into one compressed row.

Owns the compressor's decode state and its one-token update (MODEL.md §2.3, LLAMACPP_DEEPSEEK4.md §3):
- per token: kv_t = h @ W_kv, score_t = h @ W_gate (+ ape[t mod r] in the V4 layout);
- block b covers tokens r*b .. r*b+r-1 and is emitted when token r*b+r-1 arrives ((p+1) % r == 0);
- pooling is a softmax over the block's tokens, independently per feature, of the scores, weighting kv;
- ratio 4 in the V4 layout overlaps: 2r = 8 candidates, the previous block's tokens through columns [0:W] and
  the current block's through [W:2W]; for block 0 the previous half is kv 0 / score -inf;
- V4.1's ratio 1 is projection + norm only (one row per token, no pooling);
- the pooled row is RMS-normalised and rotated (RoPE on the last rope dims) at position r*b, the block's first
  token.

The same code serves the attention compressor (width head_dim) and the V4 indexer's own compressor (width
index_head_dim). State is a dict so the prefix cache can snapshot it as plain arrays:
  kv_buf, score_buf [S, c*W]: the last S = c*r tokens' projections, slot = position mod S (ring);
  rows [n_rows, W]: every compressed row emitted so far, row b at index b (normalised and rotated);
  latent [W]: the newest row before RoPE (V4.1 derives index keys from it in the step that emits it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jds41.layers import compressor_kernel
from jds41.layers.norm import rms_norm
from jds41.layers.rope import apply_rope
from jds41.quant import qmatvec_made, triton_matvec


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
    """Static shape of one compressor (hashable: part of the jitted step's static structure)."""

    ratio: int
    width: int  # W: width of one emitted row
    overlap: bool  # V4 ratio-4 overlapped pooling (projections 2W wide)
    has_gate: bool  # False for V4.1 ratio 1 (projection + norm)
    has_ape: bool
    n_rows: int  # capacity: ceil(max_ctx / ratio)

    @property
    def proj_width(self) -> int:
        return 2 * self.width if self.overlap else self.width

    @property
    def buf_len(self) -> int:
        return 2 * self.ratio if self.overlap else self.ratio


def init_state(spec: CompressorSpec) -> dict[str, jax.Array]:
    return {
        "kv_buf": jnp.zeros((spec.buf_len, spec.proj_width), jnp.float32),
        "score_buf": jnp.zeros((spec.buf_len, spec.proj_width), jnp.float32),
        "rows": jnp.zeros((spec.n_rows, spec.width), jnp.float32),
        "latent": jnp.zeros((spec.width,), jnp.float32),
    }


def _pool(spec: CompressorSpec, kv_buf: jax.Array, score_buf: jax.Array, block: jax.Array) -> jax.Array:
    """Softmax-pool the tokens of `block` (per feature) from the ring buffers; returns [W]."""
    r, W = spec.ratio, spec.width
    cur = (block * r + jnp.arange(r)) % spec.buf_len
    if not spec.overlap:
        kv, sc = kv_buf[cur], score_buf[cur]
    else:
        prev = (block * r - r + jnp.arange(r)) % spec.buf_len
        first = block == 0  # block 0 has no previous block: kv 0, score -inf
        kv_prev = jnp.where(first, 0.0, kv_buf[prev, :W])
        sc_prev = jnp.where(first, -jnp.inf, score_buf[prev, :W])
        kv = jnp.concatenate([kv_prev, kv_buf[cur, W:]], axis=0)  # [2r, W]
        sc = jnp.concatenate([sc_prev, score_buf[cur, W:]], axis=0)
    weights = jax.nn.softmax(sc, axis=0)
    return jnp.sum(weights * kv, axis=0)


def project(spec: CompressorSpec, w: dict, h_D: jax.Array, prefix: str = "attn_compressor",
            made: dict | None = None) -> tuple[jax.Array, jax.Array | None]:
    """One token's projections (kv_t, score_t; score_t None without a gate; ape not yet added: `absorb` adds it):
    the part of `update` that depends on the token alone, so a row-batched step (jds41/block_step.py) can compute
    it for all rows at once. `made`: products of h_D already computed (`qmatvec_made`)."""
    kv_t = qmatvec_made(h_D, w, f"{prefix}_kv", made)
    if not spec.has_gate:
        return kv_t, None
    return kv_t, qmatvec_made(h_D, w, f"{prefix}_gate", made)


def absorb(spec: CompressorSpec, state: dict, w: dict, kv_t: jax.Array, sc_t: jax.Array | None, pos: jax.Array,
           freqs: jax.Array, eps: float, prefix: str = "attn_compressor") -> tuple[dict, jax.Array, jax.Array]:
    """Take one token's projections into the state (ape added to the score, ring buffers, pooling, the emitted
    row): the sequential part. On CUDA with layers/compressor_kernel.py switched on, one launch that updates the
    state in place (the same values to f32 rounding); elsewhere the XLA spelling below, the reference."""
    r = spec.ratio
    block = pos // r
    emitted = (pos + 1) % r == 0
    ape = w[f"{prefix}_ape"] if spec.has_gate and spec.has_ape else None
    if compressor_kernel.applies(r, spec.width, spec.overlap):
        run = functools.partial(compressor_kernel.absorb_state, ratio=r, overlap=spec.overlap, has_gate=spec.has_gate,
                                eps=eps)
        keys = ("kv_buf", "score_buf", "rows", "latent")
        args = (*(state[k] for k in keys), kv_t, sc_t, ape, w[f"{prefix}_norm"], jnp.asarray(freqs, jnp.float32),
                pos)

        def xla(*a):
            return tuple(_absorb_xla(spec, dict(zip(keys, a[:4])), *a[4:], eps)[k] for k in keys)

        if triton_matvec.INTERPRET:
            new = run(*args, interpret=True)
        else:
            new = jax.lax.platform_dependent(*args, cuda=run, default=xla)
        return dict(zip(keys, new)), emitted, block
    return _absorb_xla(spec, state, kv_t, sc_t, ape, w[f"{prefix}_norm"], freqs, pos, eps), emitted, block


def _absorb_xla(spec: CompressorSpec, state: dict, kv_t, sc_t, ape, norm, freqs, pos, eps: float) -> dict:
    """`absorb`'s state update in XLA's ops (the reference)."""
    r = spec.ratio
    if ape is not None:
        sc_t = sc_t + jnp.asarray(ape)[pos % r]
    slot = pos % spec.buf_len
    kv_buf = jax.lax.dynamic_update_index_in_dim(state["kv_buf"], kv_t, slot, 0)
    score_buf = state["score_buf"]
    if spec.has_gate:
        score_buf = jax.lax.dynamic_update_index_in_dim(score_buf, sc_t, slot, 0)
    block = pos // r
    emitted = (pos + 1) % r == 0
    pooled = _pool(spec, kv_buf, score_buf, block) if spec.has_gate else kv_t
    latent = rms_norm(pooled, norm, eps)
    row = apply_rope(latent, block * r, freqs)
    old = jax.lax.dynamic_index_in_dim(state["rows"], block, 0, keepdims=False)
    rows = jax.lax.dynamic_update_index_in_dim(state["rows"], jnp.where(emitted, row, old), block, 0)
    latent = jnp.where(emitted, latent, state["latent"])
    return {"kv_buf": kv_buf, "score_buf": score_buf, "rows": rows, "latent": latent}


def update(spec: CompressorSpec, state: dict, w: dict, h_D: jax.Array, pos: jax.Array, freqs: jax.Array,
           eps: float, prefix: str = "attn_compressor", made: dict | None = None) -> tuple[dict, jax.Array, jax.Array]:
    """Feed one token; returns (state, emitted, block): `emitted` says whether row `block` was written now.

    `w` holds the layer's tensors by short GGUF name (`{prefix}_kv`, `_gate`, `_ape`, `_norm`); `made` as `project`.
    """
    kv_t, sc_t = project(spec, w, h_D, prefix, made)
    return absorb(spec, state, w, kv_t, sc_t, pos, freqs, eps, prefix)


def visible_mask(n_rows: int, ratio: int, pos: jax.Array) -> jax.Array:
    """Compressed row j is visible to the query at position p iff j < (p+1) // ratio."""
    return jnp.arange(n_rows) < (pos + 1) // ratio
