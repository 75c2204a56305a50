"""A compressor's sequential part (compressor.absorb) as one Pallas (Triton) launch on the GPU, updating the
compressor's state in place (the default on CUDA since the forty-fourth session; JDS41_COMPRESSOR_KERNEL=0 keeps
XLA's spelling).

Why (results/profile_decode_attn_together43_8L_h100.jsonl, `one_token`): XLA:GPU runs one token's `absorb` as about
seven kernels of 1-2.3 us (the two ring writes, the pooling's softmax and sum, the norm, RoPE, the read of the old
row and the write of the new one), ~10 us a compressor, and a V4-Flash layer with an indexer has two compressors,
one with a ratio of 128 has one: ~9 compressors and ~60 of the ~430 launches of an 8-layer token. Their work is a
few KB. One program here does all of it:

- writes the token's projections into the ring buffers at slot pos mod S (the score plus ape[pos mod r] where the
  layout has ape: compressor.absorb adds it, so every path adds it once, in the same place);
- only on the step that completes a block ((pos + 1) mod r == 0; `pl.when`, so the other r - 1 steps write the ring
  and nothing else), pools the block's candidates per feature (softmax of the scores weighting kv, the overlapped
  layout's previous block through columns [0, W), block 0's previous half kv 0 / score -inf), RMS-normalises the
  pooled row, writes it as the newest `latent` and, turned by RoPE at the block's first position, as row `block`.
  The norm needs the whole row's sum of squares before any column can be written, and a program cannot read back
  what its own threads wrote without a barrier, so it pools the columns twice, in chunks: the first pass sums the
  squares, the second pools again (the same code, the same bits), normalises, turns and writes. RoPE pairs column
  c with c ^ 1, which the second pass pools beside it (chunks are even-aligned, so a pair is in one chunk).
- the ring rows being pooled are read as they were before this step; the slot written now is taken from the
  token's own projections, not read back.
The ring buffers, rows and latent are aliased to the outputs (`input_output_aliases`), so nothing is copied.

Bits: the kernel's exp, division, reductions and contractions are Triton's, so it agrees with the XLA spelling
(compressor.absorb, the reference) to f32 rounding, not bitwise; on CUDA every path's absorb is this kernel when
it is on (decode, the layer-major prompt pass, the row-batched verify), so the engine's equalities between them
hold. JDS41_TRITON=interpret runs it in Pallas' interpreter on every platform (tests/test_compressor_kernel.py).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

# On by default (read at import) since its H100 run at ffbbc38 (with the softmax's and the router's kernels): V4-Flash
# 8 layers int8 decoded at 581.1 against 552.5 tok/s (results/bench_decode_v4_state44_8L_h100.jsonl), its GPU tests
# passed (v4_state_gpu_tests44_h100.txt); a compressor's step takes one launch of ~1.5 us where XLA ran ~7
ENABLED = os.environ.get("JDS41_COMPRESSOR_KERNEL", "1") != "0"
MOST_VALUES = 4096  # candidates x columns a pooling chunk holds, at most (registers: ~32 f32 a thread at 4 warps)
WARPS = 4


def _ar(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def layout(ratio: int, width: int, overlap: bool) -> tuple[int, int] | None:
    """(candidates a pooled row weighs, padded to a power of two; columns a chunk) or None where the kernel does not
    take the shape: a chunk needs an even power-of-two number of columns dividing the row."""
    n = _pow2(2 * ratio if overlap else ratio)
    cols = math.gcd(width, max(2, MOST_VALUES // n))
    return (n, cols) if cols >= 2 and cols & (cols - 1) == 0 else None


def _kernel(pos_ref, kv_t_ref, sc_t_ref, ape_ref, norm_ref, freqs_ref, kv_in, sc_in, rows_in, latent_in,
            kv_out, sc_out, rows_out, latent_out, *, ratio: int, width: int, buf_len: int, overlap: bool,
            has_gate: bool, n_cand: int, cols: int, n_rope: int, eps: float):
    del rows_in, latent_in  # aliased to rows_out / latent_out: what this step does not write keeps its value
    r, W, S = ratio, width, buf_len
    proj = 2 * W if overlap else W
    pos = pos_ref[0]
    slot, block = pos % S, pos // r
    at_c = _ar(cols)

    def score_now(col):  # the token's score at columns `col`, with ape where the layout has it
        sc = sc_t_ref[col]
        return sc + ape_ref[pos % r, col] if ape_ref is not None else sc

    # the ring row in one shot (a loop of chunks waits on each chunk's loads in turn): lanes past the row repeat its
    # last column and write it again
    col = jnp.minimum(_ar(_pow2(proj)), proj - 1)
    kv_out[slot, col] = kv_t_ref[col]
    if has_gate:
        sc_out[slot, col] = score_now(col)

    def pooled(at):
        """The block's pooled values at columns `at` [cols] (before the norm)."""
        if not has_gate:  # ratio 1 without a gate: the token's projection is its row
            return kv_t_ref[at]
        i = _ar(n_cand)
        if overlap:
            prev = i < r
            cand_slot = jnp.where(prev, (block * r - r + i + S) % S, (block * r + i - r) % S)
            off = jnp.where(prev, 0, W)
            live = (i < 2 * r) & ~(prev & (block == 0))
        else:
            cand_slot, off, live = (block * r + i) % S, jnp.zeros_like(i), i < r
        cand_slot = jnp.where(live, cand_slot, slot)  # a dead candidate reads any row; it is masked below
        col = off[:, None] + at[None, :]
        now = (cand_slot == slot)[:, None]
        kv = jnp.where(now, kv_t_ref[col], kv_in[cand_slot[:, None], col])
        sc = jnp.where(now, score_now(col), sc_in[cand_slot[:, None], col])
        live = live[:, None]
        kv = jnp.where(live, kv, jnp.float32(0))
        sc = jnp.where(live, sc, -jnp.inf)
        e = jnp.exp(sc - jnp.max(sc, axis=0)[None, :])
        weights = e / jnp.sum(e, axis=0)[None, :]
        return jnp.sum(weights * kv, axis=0)

    @pl.when((pos + 1) % r == 0)
    def emit():
        def squares(j, acc):
            p = pooled(j * cols + at_c)
            return acc + jnp.sum(p * p)

        total = lax.fori_loop(0, W // cols, squares, jnp.float32(0))
        scale = lax.rsqrt(total / jnp.float32(W) + jnp.float32(eps))
        angle_at = (block * r).astype(jnp.float32)  # the block's first position, as compressor.absorb turns it

        def write(j, carry):
            at = j * cols + at_c
            partner = at ^ 1
            own = pooled(at) * scale * norm_ref[at]
            other = pooled(partner) * scale * norm_ref[partner]
            latent_out[at] = own
            k = jnp.maximum(at - (W - n_rope), 0) // 2
            angle = angle_at * freqs_ref[k]
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            even = at % 2 == 0
            a, b = jnp.where(even, own, other), jnp.where(even, other, own)
            turned = jnp.where(even, a * cos - b * sin, a * sin + b * cos)
            rows_out[block, at] = jnp.where(at >= W - n_rope, turned, own)
            return carry

        lax.fori_loop(0, W // cols, write, 0)


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "has_gate", "eps", "interpret"))
def absorb_state(kv_buf, score_buf, rows, latent, kv_t, sc_t, ape, norm, freqs, pos, *, ratio: int, overlap: bool,
                 has_gate: bool, eps: float, interpret: bool = False):
    """(kv_buf, score_buf, rows, latent) after one token at `pos` (int32 scalar), by the kernel: kv_t / sc_t the
    token's projections [proj] (sc_t raw, before ape; None without a gate), ape [ratio, proj] or None, norm [W],
    freqs [R / 2]. compressor.absorb's state update, the same values to f32 rounding."""
    S, W = kv_buf.shape[0], rows.shape[1]
    n_cand, cols = layout(ratio, W, overlap)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    sc_t = f32(kv_t) * 0 if sc_t is None else f32(sc_t)  # a placeholder operand where there is no gate
    args = [jnp.reshape(jnp.asarray(pos, jnp.int32), (1,)), f32(kv_t), sc_t]
    if ape is not None:
        args.append(f32(ape))
    args += [f32(norm), f32(freqs), f32(kv_buf), f32(score_buf), f32(rows), f32(latent)]
    first_state = len(args) - 4
    kernel = functools.partial(_kernel, ratio=ratio, width=W, buf_len=S, overlap=overlap, has_gate=has_gate,
                               n_cand=n_cand, cols=cols, n_rope=2 * freqs.shape[0], eps=float(eps))
    if ape is None:  # keep the kernel's signature: no ape ref
        kernel = _without_ape(kernel)
    params = None
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        args = list(lax.optimization_barrier(tuple(args)))
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=WARPS, num_stages=1)
    state = args[first_state:]
    out = pl.pallas_call(
        kernel, out_shape=tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in state), grid=(1,),
        input_output_aliases={first_state + i: i for i in range(4)}, compiler_params=params, interpret=interpret,
        name="compressor_absorb")(*args)
    return lax.optimization_barrier(out) if interpret else out


def _without_ape(kernel):
    def run(pos_ref, kv_t_ref, sc_t_ref, *refs):
        return kernel(pos_ref, kv_t_ref, sc_t_ref, None, *refs)
    return run


def applies(ratio: int, width: int, overlap: bool) -> bool:
    """Whether compressor.absorb runs the kernel: switched on, Pallas' Triton backend or the interpreter, a shape
    `layout` takes."""
    return (ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET)
            and layout(ratio, width, overlap) is not None)
