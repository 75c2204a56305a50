"""The router's top-K of a token's expert scores as one Pallas (Triton) program on the GPU.

Why: `jax.lax.top_k` over a router's E = 256 or 384 scores ran on the H200 as an XLA sort, 5.6 us a layer in the
V4.1 decode profile (`sort_*` in results/profile_decode_int8_26_v41_4L_h200.jsonl, one a layer), where the rest
of the router is ~1 us kernels. K is 6: one program can hold the E scores in registers and take K maxima, each a
max and a min-index reduction over the row, with no sort: 2.4 us a layer in the same profile with it
(results/profile_decode_optins_v41_4L_h200.jsonl).

`top_k(x_E, k)` -> (values [k], indices [k] int32) with `lax.top_k`'s result for scores that are finite or -inf:
descending values, and on equal values the lower index first (so an exact tie keeps the lower expert, as the
router's docstring promises); the same K picks whatever their order, since each round takes the lowest untaken
index holding the largest untaken value. NaN scores are outside that promise (a router never makes them). On CUDA
it runs the kernel (JDS41_TOPK_KERNEL=0, read at import, keeps XLA's sort there, for A/B runs), elsewhere
`lax.top_k`, the reference; JDS41_TRITON=interpret runs the kernel on every platform through Pallas' interpreter
(tests/test_topk_kernel.py). Values are copied, never computed, so the kernel and the reference agree bit for bit.

`route(logits_E, ...)` (the default on CUDA since the forty-fourth session; JDS41_ROUTE_KERNEL=0 keeps the top-K alone
in the kernel) is the router's whole selection in
the same one program: the gating scores of the logits, the bias, the top-K and the weights (the chosen scores,
normalised and scaled), where XLA ran the scores and the weights as a kernel each around the top-K's (~1.2 us each,
results/profile_decode_attn_together43_8L_h100.jsonl: `loop_add_sqrt_fusion`, `loop_multiply_fusion`). Its scores
are Triton's sqrt, exp and log1p, so it agrees with router.py's XLA spelling to f32 rounding, not bitwise (a pick
can differ only where two biased scores are within that rounding); on CUDA every path's router takes it when on.
An engine with the router lean compiled in (a tier profile that enables it) keeps XLA's spelling for its selection,
which the kernel does not take: there a lean backed off to margin 0 routes as the plain top-K of XLA's scores, the
same as this kernel's picks but for such near-ties.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import triton_matvec

WEIGHT_SUM_MIN = 6.103515625e-5  # the routed-weight sum's clamp (llama.cpp's 2^-14), router.py's too

ENABLED = os.environ.get("JDS41_TOPK_KERNEL", "1") == "1"
# the whole selection: on by default since its H100 run at ffbbc38 (with the compressor's and softmax's kernels;
# layers/compressor_kernel.py says what it measured): 3.25 us a layer where the top-K's 2.43 and XLA's two ~1.25
ROUTE_ENABLED = os.environ.get("JDS41_ROUTE_KERNEL", "1") != "0"
MAX_N = 1024  # scores one program holds (a router's experts; V4.1 384, V4-Flash 256)


def _picks(x, at, inside, k: int, width: int):
    """The k positions of the largest x, each the lowest untaken index holding the largest untaken value:
    [(value, index)] in lax.top_k's order."""
    x = jnp.where(inside, x, -jnp.inf)
    taken = ~inside  # positions past the row are never picked
    out = []
    for _ in range(k):
        best = jnp.max(jnp.where(taken, -jnp.inf, x))
        pick = jnp.min(jnp.where(~taken & (x == best), at, width))
        taken = taken | (at == pick)
        out.append((best, pick))
    return out


def _kernel(x_ref, v_ref, i_ref, *, n: int, k: int, width: int):
    row = pl.program_id(0)
    at = jnp.arange(width, dtype=jnp.int32)
    x = x_ref[row, jnp.minimum(at, n - 1)]  # a power-of-two block over the n scores
    for j, (best, pick) in enumerate(_picks(x, at, at < n, k, width)):
        v_ref[row, j] = best
        i_ref[row, j] = pick


def _scores(logits, inside, gating: str):
    """router.gate_scores in the kernel's ops (softmax over the lanes inside the row)."""
    one = jnp.float32(1)
    if gating == "sqrtsoftplus":  # softplus(l) = log(1 + e^l) = max(l, 0) + log1p(e^-|l|), as jax.nn.softplus
        return jnp.sqrt(jnp.maximum(logits, 0) + jnp.log1p(jnp.exp(-jnp.abs(logits))))
    if gating == "sigmoid":
        return one / (one + jnp.exp(-logits))
    e = jnp.exp(logits - jnp.max(jnp.where(inside, logits, -jnp.inf)))
    return e / jnp.sum(jnp.where(inside, e, jnp.float32(0)))


def _route_kernel(l_ref, *refs, n: int, k: int, width: int, gating: str, has_bias: bool, norm: bool,
                  scale: float):
    b_ref, (i_ref, w_ref, s_ref) = (refs[0], refs[1:]) if has_bias else (None, refs)
    row = pl.program_id(0)
    at = jnp.arange(width, dtype=jnp.int32)
    inside, col = at < n, jnp.minimum(at, n - 1)  # lanes past the row repeat the last expert (written again)
    scores = _scores(l_ref[row, col], inside, gating)
    s_ref[row, col] = scores
    picks = _picks(scores + b_ref[col] if has_bias else scores, at, inside, k, width)
    weights = [jnp.sum(jnp.where(at == pick, scores, jnp.float32(0))) for _, pick in picks]
    if norm:  # router.route: divided by the sum (left to right) clamped at 2^-14
        total = weights[0]
        for w in weights[1:]:
            total = total + w
        total = jnp.maximum(total, jnp.float32(WEIGHT_SUM_MIN))
        weights = [w / total for w in weights]
    for j, ((_, pick), w) in enumerate(zip(picks, weights)):
        i_ref[row, j] = pick
        w_ref[row, j] = w * jnp.float32(scale)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def top_k_rows(x_NE: jax.Array, k: int, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The kernel over N rows of E scores -> (values [N, k] f32, indices [N, k] int32), one program a row."""
    n_rows, n = x_NE.shape
    width = 1 << max(n - 1, 1).bit_length()  # Triton's blocks are powers of two
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, n=n, k=k, width=width),
        out_shape=(jax.ShapeDtypeStruct((n_rows, k), jnp.float32), jax.ShapeDtypeStruct((n_rows, k), jnp.int32)),
        grid=(n_rows,), compiler_params=params, interpret=interpret, name="router_top_k",
    )(x_NE.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("k", "gating", "norm", "scale", "interpret"))
def route_rows(logits_NE: jax.Array, bias_E: jax.Array | None, *, k: int, gating: str, norm: bool, scale: float,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router's selection of N rows of logits [N, E] by the kernel -> (idx [N, k] int32, weights [N, k] f32,
    scores [N, E] f32), one program a row; `bias_E` the selection bias or None."""
    n_rows, n = logits_NE.shape
    width = 1 << max(n - 1, 1).bit_length()
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    args = (jnp.asarray(logits_NE, jnp.float32),) + (() if bias_E is None else (jnp.asarray(bias_E, jnp.float32),))
    if interpret:  # interpreted, the kernel is XLA:CPU code inlined into its caller: keep its rounding its own
        args = lax.optimization_barrier(args)
    out = pl.pallas_call(
        functools.partial(_route_kernel, n=n, k=k, width=width, gating=gating, has_bias=bias_E is not None,
                          norm=norm, scale=float(scale)),
        out_shape=(jax.ShapeDtypeStruct((n_rows, k), jnp.int32), jax.ShapeDtypeStruct((n_rows, k), jnp.float32),
                   jax.ShapeDtypeStruct((n_rows, n), jnp.float32)),
        grid=(n_rows,), compiler_params=params, interpret=interpret, name="router_select",
    )(*args)
    return lax.optimization_barrier(out) if interpret else out


def route_applies(n: int, k: int) -> bool:
    """Whether the router's whole selection runs the kernel (`route`): switched on as well as `applies`."""
    return ROUTE_ENABLED and applies(n, k)


def route(logits_E: jax.Array, bias_E: jax.Array | None, k: int, gating: str, norm: bool, scale: float, default):
    """(idx [k], weights [k], scores [E]) of one row of router logits by the kernel on CUDA (interpreted where
    JDS41_TRITON=interpret), else `default(logits_E)`, router.py's XLA spelling."""
    run = functools.partial(route_rows, k=k, gating=gating, norm=norm, scale=scale)
    flat = jnp.asarray(logits_E, jnp.float32)[None]
    if triton_matvec.INTERPRET:
        idx, w, scores = run(flat, bias_E, interpret=True)
    else:
        idx, w, scores = lax.platform_dependent(
            flat, bias_E, cuda=run, default=lambda lg, _: tuple(a[None] for a in default(lg[0])))
    return idx[0], w[0], scores[0]


def applies(n: int, k: int) -> bool:
    """Whether `top_k` can run the kernel: not switched off, Pallas' Triton backend (or the interpreter), a short
    row."""
    return ENABLED and triton_matvec.ENABLED and (triton_matvec.has_triton_backend() or triton_matvec.INTERPRET) \
        and k <= n <= MAX_N


def top_k(x_E: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x_E, k)` for a row of scores [..., E] (module docstring), by the kernel where it `applies`."""
    x_E = jnp.asarray(x_E, jnp.float32)
    n = x_E.shape[-1]

    def xla(x):
        values, idx = lax.top_k(x, k)
        return values, idx.astype(jnp.int32)

    if not applies(n, k):
        return xla(x_E)
    lead = x_E.shape[:-1]
    flat = x_E.reshape(-1, n)
    if triton_matvec.INTERPRET:
        values, idx = top_k_rows(flat, k, interpret=True)
    else:
        values, idx = lax.platform_dependent(flat, cuda=lambda x: top_k_rows(x, k), default=xla)
    return values.reshape(*lead, k), idx.reshape(*lead, k)
