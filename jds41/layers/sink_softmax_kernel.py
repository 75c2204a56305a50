"""The attention's softmax with its sink (attention.attend_xla, between its two products) as one Pallas (Triton)
launch on the GPU (the default on CUDA since the forty-fourth session; JDS41_SOFTMAX_KERNEL=0 keeps XLA's four).

Why (results/profile_decode_attn_together43_8L_h100.jsonl, `one_token`): between the scores' product and the
weighted sum XLA:GPU runs the scale and the mask, the maximum, the exponentials' sum and the division as four
kernels of 1.2-1.5 us a layer (`loop_select_fusion`, two `input_reduce_fusion`, `loop_divide_fusion`), ~5.4 us for
64 heads x a few hundred keys. One program a head here holds its row of scores and does all four.

p[h, n] = exp(s[h, n] - top_h) / (sum_n' exp(s[h, n'] - top_h) + exp(sink_h - top_h)), s = scale * (q . k) where
the key is valid and -inf where not, top_h = max(max_n s[h, n], sink_h): `attend_xla`'s formula. The kernel's exp,
division and sums are Triton's, so it agrees with XLA's to f32 rounding, not bitwise; on CUDA every path's
attention takes it when it is on (decode, prompt, verify rows: a vmapped call adds a grid axis), so the engine's
equalities between them hold. JDS41_TRITON=interpret runs it in Pallas' interpreter on every platform
(tests/test_sink_softmax_kernel.py).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

# On by default (read at import) since its H100 run at ffbbc38, with the compressor's and the router's kernels
# (layers/compressor_kernel.py says what it measured): ~1.5 us a layer where XLA's four took ~5.4
ENABLED = os.environ.get("JDS41_SOFTMAX_KERNEL", "1") != "0"
MAX_KEYS = 8192  # keys a program holds in registers (V4-Flash: a window of 128 and up to 512 selected rows)


def _kernel(s_ref, valid_ref, sink_ref, p_ref, *, n: int, width: int, scale: float):
    h = pl.program_id(0)
    at = jnp.arange(width, dtype=jnp.int32)
    inside = at < n
    # lanes past the row repeat the last key (clamped reads) and write its value again: no masked stores needed
    col = jnp.minimum(at, n - 1)
    s = jnp.where(valid_ref[col] != 0, s_ref[h, col] * jnp.float32(scale), -jnp.inf)
    sink = sink_ref[h]
    top = jnp.maximum(jnp.max(jnp.where(inside, s, -jnp.inf)), sink)
    e = jnp.exp(s - top)
    denom = jnp.sum(jnp.where(inside, e, jnp.float32(0))) + jnp.exp(sink - top)
    p_ref[h, col] = e / denom


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def probabilities(s_HN: jax.Array, valid_N: jax.Array, sink_H: jax.Array, *, scale: float,
                  interpret: bool = False) -> jax.Array:
    """The attention weights [H, N] f32 of raw scores s [H, N] (q . k before the scale), valid [N] bool and the
    sinks [H], one program a head."""
    H, n = s_HN.shape
    width = 1 << max(n - 1, 1).bit_length()  # Triton's blocks are powers of two
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    args = (jnp.asarray(s_HN, jnp.float32), jnp.asarray(valid_N).astype(jnp.int32), jnp.asarray(sink_H, jnp.float32))
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        args = lax.optimization_barrier(args)
    p = pl.pallas_call(functools.partial(_kernel, n=n, width=width, scale=float(scale)),
                       out_shape=jax.ShapeDtypeStruct((H, n), jnp.float32), grid=(H,), compiler_params=params,
                       interpret=interpret, name="attention_sink_softmax")(*args)
    return lax.optimization_barrier(p) if interpret else p


def applies(n_keys: int) -> bool:
    """Whether `attend_xla` takes the kernel: switched on, Pallas' Triton backend or the interpreter, a row that fits
    a program."""
    return (ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET)
            and 1 <= n_keys <= MAX_KEYS)


def sink_softmax(s_HN, valid_N, sink_H, scale: float, default):
    """`probabilities` by the kernel on CUDA (interpreted where JDS41_TRITON=interpret), else `default(s, valid,
    sink)`, the XLA spelling."""
    run = functools.partial(probabilities, scale=scale)
    if triton_matvec.INTERPRET:
        return run(s_HN, valid_N, sink_H, interpret=True)
    return lax.platform_dependent(s_HN, valid_N, sink_H, cuda=run, default=default)
