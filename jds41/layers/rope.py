"""Rotary position embedding as llama.cpp's `deepseek4` graph applies it (MODEL.md §2.2, LLAMACPP_DEEPSEEK4.md §3).

Owns the per-pair frequency tables and the rotation used by attention (q, the KV latent, the inverse rotation of
the output), the compressors and the indexer.

Layout: ggml rope mode 0, i.e. ADJACENT pairs (2k, 2k+1) of the LAST `rope_dim` dims of a vector; pair k turns by
angle pos * freq[k]:  (a, b) -> (a cos - b sin, a sin + b cos).

Frequencies: freq[k] = base^(-2k/R), R = rope_dim, k = 0..R/2-1. Layers with compress ratio 0 use `rope_base`
without scaling; layers with ratio > 0 (and their compressor and indexer) use `compress_rope_base`, with YaRN when
the file says `yarn`.

YaRN exactly as ggml computes it (ggml_rope_yarn_corr_dims + rope_yarn), with freq_scale = 1/factor and
ext_factor = 1:
  corr_dim(beta) = R * ln(orig_ctx / (beta * 2 pi)) / (2 ln base)
  low  = max(0,     floor(corr_dim(beta_fast)))
  high = min(R - 1, ceil(corr_dim(beta_slow)))
  ramp(k) = 1 - clamp((k - low) / max(0.001, high - low), 0, 1)      (1 for fast pairs, 0 for slow ones)
  ramp_mix = ramp(k) * ext_factor = ramp(k)
  theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix,  theta_extrap = pos * base^(-2k/R),
                                                                    theta_interp = theta_extrap / factor
so, theta being linear in pos, freq[k] = base^(-2k/R) * ((1 - ramp(k)) / factor + ramp(k)). Pairs below `low`
keep their frequency (extrapolation), pairs above `high` are divided by `factor` (interpolation). ggml would also
scale cos/sin by mscale = 1 + 0.1 ln(factor); deepseek4 cancels it (attn_factor = 1/mscale), so cos/sin are
unscaled here. With V4's numbers (R 64, base 160000, orig 65536, betas 32/1): low 15, high 25.

Tables are computed in float64 numpy and cast to float32 once, so every call returns identical values; ggml
evaluates the same formula in float32 (powf / repeated products), which differs by a few f32 ulps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jds41.config import ModelConfig

# (factor, original context, beta_fast, beta_slow)
YarnParams = tuple[float, int, float, float]


def yarn_corr_dims(rope_dim: int, base: float, orig_ctx: int, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml's (low, high) correction range in pair units: the pair indices where the YaRN ramp starts and ends."""
    def corr_dim(beta: float) -> float:
        return rope_dim * math.log(orig_ctx / (beta * 2.0 * math.pi)) / (2.0 * math.log(base))

    low = max(0.0, float(math.floor(corr_dim(beta_fast))))
    high = min(float(rope_dim - 1), float(math.ceil(corr_dim(beta_slow))))
    return low, high


def rope_freqs(rope_dim: int, base: float, yarn: YarnParams | None = None) -> np.ndarray:
    """Per-pair angular frequencies f32 [rope_dim // 2]: angle of pair k at position p is p * freqs[k]."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    k = np.arange(rope_dim // 2, dtype=np.float64)
    freqs = np.power(np.float64(base), -2.0 * k / rope_dim)
    if yarn is not None:
        factor, orig_ctx, beta_fast, beta_slow = yarn
        low, high = yarn_corr_dims(rope_dim, base, orig_ctx, beta_fast, beta_slow)
        ramp = 1.0 - np.clip((k - low) / max(0.001, high - low), 0.0, 1.0)
        freqs = freqs * ((1.0 - ramp) / factor + ramp)
    return freqs.astype(np.float32)


def layer_yarn(cfg: ModelConfig, layer: int) -> YarnParams | None:
    """The YaRN parameters of a layer: only compressed layers (ratio > 0) of a `yarn` file are scaled."""
    if cfg.ratio(layer) == 0 or cfg.rope_scaling != "yarn":
        return None
    return (cfg.rope_factor, cfg.rope_orig_ctx, cfg.yarn_beta_fast, cfg.yarn_beta_slow)


def layer_rope_freqs(cfg: ModelConfig, layer: int) -> np.ndarray:
    """Frequencies for block `layer`, shared by its attention, compressor and indexer."""
    base = cfg.rope_base if cfg.ratio(layer) == 0 else cfg.compress_rope_base
    return rope_freqs(cfg.rope_dim, base, layer_yarn(cfg, layer))


def apply_rope(x: jax.Array, pos, freqs, inverse: bool = False) -> jax.Array:
    """Rotate adjacent pairs of the last `2 * len(freqs)` dims of x [..., K] by pos * freqs (by minus that angle
    when `inverse`, which undoes a forward rotation at the same position).

    `pos` (int) is a scalar or an array over the LEADING axes of x: shape x.shape[:j] for some j < x.ndim (size-1
    axes broadcast), e.g. [T] for x [T, H, K]. The rotation is computed in f32 and returned in x's dtype; the
    other dims pass through.
    """
    freqs = jnp.asarray(freqs, jnp.float32)
    R = 2 * freqs.shape[0]
    K = x.shape[-1]
    if R > K:
        raise ValueError(f"rope dims {R} exceed the vector width {K}")
    pos = jnp.asarray(pos, jnp.int32)
    if pos.ndim >= x.ndim or any(p not in (1, n) for p, n in zip(pos.shape, x.shape[:pos.ndim], strict=True)):
        raise ValueError(f"pos shape {pos.shape} must match (or broadcast to) the leading axes of x {x.shape}")
    pos_f = pos.astype(jnp.float32).reshape(pos.shape + (1,) * (x.ndim - pos.ndim))  # [..., 1]
    angle = pos_f * freqs  # [..., R/2]; one f32 product, as ggml's p * theta_scale^k
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    xr = x[..., K - R:].astype(jnp.float32).reshape((*x.shape[:-1], R // 2, 2))
    a, b = xr[..., 0], xr[..., 1]
    rot = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape((*x.shape[:-1], R))
    rot = rot.astype(x.dtype)
    if R == K:
        return rot
    return jnp.concatenate([x[..., :K - R], rot], axis=-1)
