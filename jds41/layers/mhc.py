"""Manifold-constrained hyper-connections (mHC): the 4-copy residual stream of DeepSeek V4 / V4.1.

Owns the per-sublayer mixing math (MODEL.md §2.1, §2.6; LLAMACPP_DEEPSEEK4.md §3, "hc" paragraph). The stream of
one token is x_HD (H = hc_mult = 4 copies of width D). A sublayer with parameters fn [M, H*D], scale [3],
base [M], M = (2+H)*H = 24, computes:

  hc_mix     mix_M = fn @ (x_flat * rsqrt(mean(x_flat^2) + eps)), x_flat = x_HD row-major (copy-major, H*D).
             llama.cpp RMS-normalises x_flat first and multiplies by fn after (LLAMACPP §3); the DeepSeek
             reference scales the product instead (MODEL.md §2.1). Same math; we follow llama.cpp, the oracle.
  hc_split   pre_H  = sigmoid(mix[0:H] * scale[0] + base[0:H]) + hc_eps
             post_H = 2 * sigmoid(mix[H:2H] * scale[1] + base[H:2H])
             comb_HH = Sinkhorn(mix[2H:] * scale[2] + base[2H:] viewed [src][dst] row-major):
               softmax over dst, + hc_eps, divide by (column sums + hc_eps); then (iters - 1) times: divide by
               (row sums + hc_eps), divide by (column sums + hc_eps). Row = fixed src, column = fixed dst.
  hc_collapse  y_D = sum_i pre_i * x_i                               (the sublayer's input, before its norm)
  hc_expand    x'_dst = post_dst * out_D + sum_src comb[src, dst] * x_src   (replaces the residual add)
  hc_head    (V4 output head, fn [H, H*D], scale [1], base [H]) pre = sigmoid(mix * scale[0] + base) + hc_eps,
             no post / comb / Sinkhorn, then hc_collapse.

Block wiring (model.py does it with these blocks; for sublayer s = attention or FFN of a layer):
  mix_s = hc_mix(x_s, fn_s, rms_eps); pre_s, post_s, comb_s = hc_split(mix_s, ...)
  V4:   out_s = f_s(norm_s(hc_collapse(x_s, pre_s)))
  V4.1: out_s = f_s(norm_s(hc_collapse(x_s, pre_{s-1})))      pre_{-1} = hc_onehot_pre(H) = [1, 0, 0, 0]
  both: x_{s+1} = hc_expand(x_s, out_s, post_s, comb_s)
  final V4: hc_head(x_last, output_hc_*); V4.1: hc_collapse(x_last, pre of the last FFN sublayer).
Our reading of the V4.1 lag (MODEL.md §2.6: "each sublayer's pre is consumed by the next sublayer"): every
sublayer still computes its full mix from ITS OWN input stream x_s and uses its own post/comb for its expand; only
the collapse weights lag by one sublayer: the pre computed from x_s (before s's expand) collapses x_{s+1}, the
stream after it. So attention of layer l uses the pre of layer l-1's FFN, and the FFN uses its layer's attention pre.
Layer 0's attention collapses with the one-hot pre on copy 0 (exactly the embedding, no hc_eps; all copies start
equal), and the model output collapses the final stream with the last FFN's pre, which is why V4.1 files carry no
output_hc_* tensors. The one-hot and the handed-over pre are both plain [H] arrays, so hc_collapse serves both.

Row invariance (rowwise.py): hc_split / hc_collapse / hc_expand / the head's gating are elementwise over H = 4
with every small sum written as an explicit left-to-right chain of adds, so a leading token axis broadcasts and
each row's arithmetic does not depend on the number of rows. hc_mix holds the only long reductions (RMS over H*D,
the product with fn); `hc_mix_rows` / `hc_head_rows` run the one-token computation per row (`map_rows`). Every
function is a fusion island (inputs and outputs behind optimization barriers), so its rounding does not depend on
what the caller fuses around it. All math is f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jds41.layers import sinkhorn_kernel
from jds41.layers.norm import rms_norm
from jds41.layers.rowwise import island, map_rows


def _f32(a) -> jax.Array:
    return jnp.asarray(a, jnp.float32)


def _chain_sum(parts: list[jax.Array]) -> jax.Array:
    """parts[0] + parts[1] + ... in that order (fixed association, independent of leading axes)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def hc_onehot_pre(hc: int) -> jax.Array:
    """The V4.1 collapse weights of layer 0's attention: copy 0 only, [1, 0, ..., 0] (no hc_eps)."""
    return jnp.zeros((hc,), jnp.float32).at[0].set(1.0)


def hc_mix(x_HD: jax.Array, fn_MK: jax.Array, eps: float) -> jax.Array:
    """Raw mixes of one token: fn [M, H*D] @ RMS-normalised flattened stream -> [M] (24 for a sublayer, H for head).

    `eps` is the model's rms eps (llama.cpp uses attention.layer_norm_rms_epsilon here, not hc_eps).
    """
    x_K = rms_norm(island(_f32(x_HD)).reshape(-1), None, eps)
    return island(jnp.dot(_f32(fn_MK), x_K, precision=jax.lax.Precision.HIGHEST))


def hc_mix_rows(x_THD: jax.Array, fn_MK: jax.Array, eps: float) -> jax.Array:
    """`hc_mix` for T tokens -> [T, M]; each row runs the one-token computation (bit-identical to decode)."""
    return map_rows(lambda x_HD: hc_mix(x_HD, fn_MK, eps), _f32(x_THD))


def _row_sums(c_SD: jax.Array) -> jax.Array:
    """sum over dst for every src, [..., S]; fixed left-to-right order."""
    return _chain_sum([c_SD[..., :, d] for d in range(c_SD.shape[-1])])


def _col_sums(c_SD: jax.Array) -> jax.Array:
    """sum over src for every dst, [..., D]; fixed left-to-right order."""
    return _chain_sum([c_SD[..., s, :] for s in range(c_SD.shape[-2])])


def _sinkhorn(logits_SD: jax.Array, hc_eps: float, iters: int) -> jax.Array:
    """[..., src, dst] logits -> the (approximately) doubly stochastic comb; see the module docstring."""
    eps = jnp.float32(hc_eps)
    m_S = logits_SD[..., :, 0]
    for d in range(1, logits_SD.shape[-1]):
        m_S = jnp.maximum(m_S, logits_SD[..., :, d])
    e_SD = jnp.exp(logits_SD - m_S[..., :, None])
    c_SD = e_SD / _row_sums(e_SD)[..., :, None] + eps  # softmax over dst, + hc_eps
    c_SD = c_SD / (_col_sums(c_SD)[..., None, :] + eps)

    # The reference keeps the loop: unrolled, XLA:CPU fuses the chain differently and its last bits move (enough to
    # move llama.cpp's near-tie flips in tests/test_model_vs_llamacpp.py). On the GPU this loop was the cost (XLA:GPU
    # runs each round as a host-launched iteration: 226 tok/s on V4-Flash 8L, 296 unrolled, where unrolled is still
    # ~20 fusions per sublayer), so on CUDA hc_split runs sinkhorn_kernel instead.
    def body(_, c_SD):
        c_SD = c_SD / (_row_sums(c_SD)[..., :, None] + eps)
        return c_SD / (_col_sums(c_SD)[..., None, :] + eps)

    return jax.lax.fori_loop(0, iters - 1, body, c_SD)


def hc_split(mix_M: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_eps: float,
             iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw mixes [..., (2+H)*H] -> (pre [..., H], post [..., H], comb [..., H(src), H(dst)]).

    Leading axes broadcast; per-row arithmetic is independent of them (elementwise, fixed-order sums).
    """
    mix_M, scale_3, base_M = island(_f32(mix_M)), _f32(scale_3), _f32(base_M)
    M = mix_M.shape[-1]
    H = round(((1 + M) ** 0.5) - 1)  # M = (2 + H) * H, so (H + 1)^2 = M + 1
    if (2 + H) * H != M or base_M.shape[-1] != M:
        raise ValueError(f"hc_split: mix width {M} / base width {base_M.shape[-1]} is not (2+H)*H")
    pre = jax.nn.sigmoid(mix_M[..., :H] * scale_3[0] + base_M[:H]) + jnp.float32(hc_eps)
    post = 2.0 * jax.nn.sigmoid(mix_M[..., H:2 * H] * scale_3[1] + base_M[H:2 * H])
    logits = mix_M[..., 2 * H:] * scale_3[2] + base_M[2 * H:]
    logits = logits.reshape(*logits.shape[:-1], H, H)
    if sinkhorn_kernel.applies(H):
        comb = sinkhorn_kernel.sinkhorn(logits, hc_eps, iters, default=lambda x: _sinkhorn(x, hc_eps, iters))
    else:
        comb = _sinkhorn(logits, hc_eps, iters)
    return island((pre, post, comb))


def hc_collapse(x_HD: jax.Array, pre_H: jax.Array) -> jax.Array:
    """y [..., D] = sum_i pre_i * x_i over the H copies (fixed order); x [..., H, D], pre [..., H]."""
    x_HD, pre_H = island((_f32(x_HD), _f32(pre_H)))
    H = x_HD.shape[-2]
    return island(_chain_sum([pre_H[..., i, None] * x_HD[..., i, :] for i in range(H)]))


def hc_expand(x_HD: jax.Array, out_D: jax.Array, post_H: jax.Array, comb_HH: jax.Array) -> jax.Array:
    """x'_dst = post_dst * out + sum_src comb[src, dst] * x_src -> [..., H, D]; comb is [..., src, dst]."""
    x_HD, out_D, post_H, comb_HH = island((_f32(x_HD), _f32(out_D), _f32(post_H), _f32(comb_HH)))
    H = x_HD.shape[-2]
    new = []
    for d in range(H):
        carried = _chain_sum([comb_HH[..., s, d, None] * x_HD[..., s, :] for s in range(H)])
        new.append(post_H[..., d, None] * out_D + carried)
    return island(jnp.stack(new, axis=-2))


def hc_head(x_HD: jax.Array, fn_HK: jax.Array, scale_1: jax.Array, base_H: jax.Array, hc_eps: float,
            eps: float) -> jax.Array:
    """V4 output collapse of one token: pre = sigmoid(hc_mix * scale[0] + base) + hc_eps; sum_i pre_i x_i -> [D]."""
    x_HD = island(_f32(x_HD))
    mix_H = hc_mix(x_HD, fn_HK, eps)
    pre = jax.nn.sigmoid(mix_H * _f32(scale_1)[0] + _f32(base_H)) + jnp.float32(hc_eps)
    return hc_collapse(x_HD, pre)


def hc_head_rows(x_THD: jax.Array, fn_HK: jax.Array, scale_1: jax.Array, base_H: jax.Array, hc_eps: float,
                 eps: float) -> jax.Array:
    """`hc_head` for T tokens -> [T, D], one-token arithmetic per row."""
    return map_rows(lambda x_HD: hc_head(x_HD, fn_HK, scale_1, base_H, hc_eps, eps), _f32(x_THD))
