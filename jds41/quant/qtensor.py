"""`QTensor`, the weight leaf type for GGUF tensors, and the products that read only its quantized bytes.

Owns: the `QTensor` pytree (raw GGUF rows as the one array leaf; type and logical shape as static data), and
`qmatvec` (decode), `qmatmul` (prefill) and `qmatvec_experts` (routed experts gathered by index); `qmatvec_parts`
and `qmatvec_experts_parts` compute several products of one x (a gate and an up) as one kernel launch on CUDA.

Memory policy (DESIGN.md §1, §7): experts stay quantized in every tier and are never materialized as f32 for decode.
A `dot` does not take a dequantize into its fusion, so the one-token products are multiply-and-sum over out-major
`[.., out, in]` weights with no batch-1 axis on the weight (the `[1, out, in]` form measured 90x slower).

How that sum is spelled matters on XLA:CPU (jax 0.10.2), where two passes break the fusion of a plain `jnp.sum`
over a long row: YNNPACK claims any f32 add-reduce together with its multiply but cannot take bit ops, selects or
gathers, so an MXFP4/IQ decode left outside it was written out as a full f32 weight; and with YNNPACK off, the
tree reduction rewriter splits reductions wider than 32 into a reduce-window that again materializes its input.
So on CPU `_row_dot` sums each 32-value block as one two-operand (variadic) reduce over 16 lanes: neither pass
touches a variadic reduce, XLA's loop emitter fuses the whole decode into it, and only `[.., out, in/32]` partial
sums reach memory; a second variadic reduce adds those in an order that does not depend on the product's shape.
Other platforms get the plain sum, which XLA:GPU fuses and runs 3-5x faster there (H200).
tests/test_quant_hlo.py checks the compiled HLO on whichever backend runs it.

On CUDA the one-token products (`qmatvec`, `qmatvec_experts`) of the formats and layouts the Triton kernel takes
(MXFP4, planar Q8_0, IQ2_XXS, Q2_K: jds41/quant/triton_matvec.py) are that kernel instead (`rows_matvec`: XLA read
them at 4-20% of HBM bandwidth there); `xla_rows_matvec` is their XLA spelling, what every other platform runs and
the kernel is tested against. A tensor's `layout` says how its rows hold the blocks (quant/planar.py).

Only `qmatmul` with several tokens and `qmatmul_expert` (one expert of a stack for a tile of rows, the grouped prompt
pass of jds41/layers/grouped_experts.py) dequantize to an f32 copy and call `dot`: the copy is shared by the rows.
The wide prompt pass also traces the one-token products under `rows_as_dots()`: there `qmatvec` and
`qmatvec_experts` are spelled as a `dot` of the dequantized weight, so that `jax.vmap` over a block's rows turns
them into one [rows, in] x [in, out] matrix product (f32, HIGHEST) instead of a multiply-and-sum per row, which
recomputes the decode for every row and cannot use the GPU's matrix units.

Activation rounding (`QTensor.act_round`, opt-in, default None = products on the f32 activation as is): with
"ggml-cpu" the products first round the activation the way llama.cpp's CPU backend does before its dot products,
so llama.cpp can serve as a tight oracle for quantized files (tests/test_model_vs_llamacpp.py). ggml-cpu converts
the f32 activation row to the weight type's `vec_dot_type` (ggml-cpu.c type_traits_cpu): Q8_0 for Q8_0 and MXFP4
weights, F16 for F16 weights. Only these are emulated; F32 weights need nothing, and BF16 (vec_dot_type BF16) and
the K/IQ types (Q8_K rows of 256) are left unrounded, so "ggml-cpu" does not match llama.cpp tightly for them.
With "int8" the two-bit formats' products (IQ2_XXS, Q2_K) read x rounded to int8 blocks of 32 and are integer dot
products (quant/int8_act.py; on CUDA the dp4a kernel of quant/triton_int8.py); every other product reads x as is.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType
from jax import lax

from jds41.quant import int8_round_kernel, planar, swiglu_kernel, triton_int8, triton_matvec
from jds41.quant.blocks import (
    FLOAT_TYPES,
    NATIVE_DTYPES,
    byte_shape,
    check_qtype,
    dequantize_rows,
    n_cols_of,
    native_to_f32,
)
from jds41.quant.int8_act import INT8_TYPES, int8_values, round_int8, xla_int8_rows_matvec
from jds41.quant.swiglu_kernel import SwiGLU


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A GGUF tensor kept as stored. `shape` is the logical numpy-order shape, e.g. `[out, in]` or `[E, out, in]`.

    `data` is uint8 `[*shape[:-1], row_bytes]` for block types, or the values in their native dtype (float32,
    float16, bfloat16) for F32/F16/BF16. It may be a numpy array (zero-copy over a memory-mapped file), a jax
    array with any placement, or a `jax.ShapeDtypeStruct` (see `abstract`). The products below derive the shape
    they compute with from `data`, so a QTensor whose leaf was sliced by `lax.scan`/`vmap` (its static `shape`
    then still naming the stacked tensor) computes correctly.
    """

    data: Any
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    act_round: str | None = None  # None, "ggml-cpu" or "int8": how products round the activation (module docstring)
    # "ggml": rows as in the file; "planar": PLANAR_TYPES rows regrouped on the device, quants first, then scales
    # (jds41/quant/planar.py): the same values, aligned loads for the GPU kernels.
    layout: str = "ggml"

    def __post_init__(self):
        if self.act_round not in ACT_ROUNDINGS:
            raise ValueError(f"act_round must be one of {ACT_ROUNDINGS}, got {self.act_round!r}")
        if self.layout not in planar.LAYOUTS or (self.layout == "planar" and self.qtype not in planar.PLANAR_TYPES):
            raise ValueError(f"layout {self.layout!r} does not apply to {GGMLQuantizationType(self.qtype).name}")

    @classmethod
    def from_raw(cls, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 act_round: str | None = None) -> QTensor:
        """Wrap a tensor's bytes as they sit in the GGUF file (any array holding exactly those bytes).

        No copy for a contiguous numpy array or memmap: the bytes are reshaped, and float types are viewed as
        their native dtype. `gguf.GGUFReader`'s `tensor.data` can be passed as is. `act_round`: see the module.
        """
        qtype = check_qtype(qtype)
        shape = tuple(int(s) for s in shape)
        raw = np.asarray(raw)
        if qtype in FLOAT_TYPES:
            dtype = NATIVE_DTYPES[qtype]
            if raw.dtype != dtype:
                raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(dtype)
            if raw.size != math.prod(shape):
                raise ValueError(f"{qtype.name} tensor of shape {shape} needs {math.prod(shape)} values, "
                                 f"got {raw.size}")
            return cls(raw.reshape(shape), qtype, shape, act_round)
        want = byte_shape(qtype, shape)
        if raw.nbytes != math.prod(want):
            raise ValueError(f"{qtype.name} tensor of shape {shape} needs {math.prod(want)} bytes, got {raw.nbytes}")
        if raw.dtype != np.uint8:
            raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        return cls(raw.reshape(want), qtype, shape, act_round)

    @classmethod
    def abstract(cls, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> QTensor:
        """The same tensor with a `jax.ShapeDtypeStruct` leaf: for `jax.eval_shape` and planning, no bytes."""
        qtype = check_qtype(qtype)
        shape = tuple(int(s) for s in shape)
        if qtype in FLOAT_TYPES:
            return cls(jax.ShapeDtypeStruct(shape, NATIVE_DTYPES[qtype]), qtype, shape)
        return cls(jax.ShapeDtypeStruct(byte_shape(qtype, shape), np.uint8), qtype, shape)

    @property
    def n_cols(self) -> int:
        """Logical length of a row (the `in` dimension of a weight), from the leaf actually held."""
        return self.data.shape[-1] if self.qtype in FLOAT_TYPES else n_cols_of(self.qtype, self.data.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes of storage the leaf holds (what a tier budget counts)."""
        return math.prod(self.data.shape) * np.dtype(self.data.dtype).itemsize

    @property
    def rounds_activation(self) -> bool:
        """Whether a product with this tensor reads its activation rounded (`_act`), so that x and weight * x give
        products that differ by more than the weight: "ggml-cpu" follows llama.cpp in every product, "int8" rounds
        for its formats only."""
        return self.qtype in INT8_TYPES if self.act_round == "int8" else self.act_round is not None

    def dequantize(self) -> jax.Array:
        """All values as f32, shape `data.shape[:-1] + (n_cols,)`. Traceable; materializes f32 unless fused."""
        return _values(self.data, self.qtype, self.layout)

    def with_rows(self, data, shape: tuple[int, ...]) -> QTensor:
        """The same kind of tensor (type, layout, activation rounding) over other rows of it, e.g. a gathered slice
        or a reshape of the leading axes."""
        return dataclasses.replace(self, data=data, shape=tuple(shape))

    def with_layout(self, data, layout: str) -> QTensor:
        """This tensor's rows in another layout (`data` must hold them so: jds41/quant/planar.py)."""
        return dataclasses.replace(self, data=data, layout=layout)


jax.tree_util.register_dataclass(QTensor, data_fields=["data"], meta_fields=["qtype", "shape", "act_round", "layout"])

ACT_ROUNDINGS = (None, "ggml-cpu", "int8")
_Q8_0_ACT_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4)


def _ggml_cpu_q8_0(x: jax.Array) -> jax.Array:
    """f32 `x[..., n]` (n % 32 == 0) rounded to Q8_0 blocks of 32 and read back as f32, as ggml-cpu's x86 (AVX/AVX2)
    `quantize_row_q8_0` does (ggml-cpu/arch/x86/quants.c; the repacked-weight path's ggml_quantize_mat_q8_0_4x8 is
    the same): d = amax/127 stored as fp16, q = round-half-even(x * (127/amax)) (`_mm256_round_ps` NEAREST), value
    q * fp16(d). ggml's portable reference instead uses 1/d and `roundf`; the x86 form is the one llama-cpp-python
    matched bit-for-bit here (measured in tests/test_model_vs_llamacpp.py). q*d is exact in f32, so the product
    with the weight then equals ggml's integer dot up to f32 summation order."""
    b = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(jnp.float16).astype(jnp.float32)
    inv = jnp.where(amax != 0, np.float32(127) / jnp.where(amax != 0, amax, 1), 0)
    return (jnp.round(b * inv) * d).reshape(x.shape)  # jnp.round: half to even


def _act(x: jax.Array, w: QTensor) -> jax.Array:
    """The f32 activation a product with `w` reads: `x` as is, or rounded per `w.act_round` (module docstring)."""
    x = x.astype(jnp.float32)
    if w.act_round is None:
        return x
    if w.act_round == "int8":
        return int8_values(x) if w.qtype in INT8_TYPES else x
    if w.qtype in _Q8_0_ACT_TYPES:
        return _ggml_cpu_q8_0(x)
    if w.qtype == GGMLQuantizationType.F16:
        return x.astype(jnp.float16).astype(jnp.float32)  # F16C conversion: round to nearest even
    return x


def _values(data, qtype: GGMLQuantizationType, layout: str = "ggml") -> jax.Array:
    data = jnp.asarray(data)
    if qtype in FLOAT_TYPES:
        return native_to_f32(data, qtype)
    if layout == "planar":
        return planar.dequantize_planar(data, qtype)
    return dequantize_rows(data, qtype)


def _add_pairs(a, b):
    return a[0] + b[0], a[1] + b[1]


def _row_dot_xla_cpu(p: jax.Array) -> jax.Array:
    n = p.shape[-1]
    if n % 32:  # only float tensors can have such rows, and they have no decode to keep fused
        return jnp.sum(p, axis=-1)
    p = p.reshape(*p.shape[:-1], n // 32, 2, 16)
    zero = np.float32(0)
    lo, hi = lax.reduce((p[..., 0, :], p[..., 1, :]), (zero, zero), _add_pairs, (p.ndim - 2,))
    partial = lo + hi  # [.., in/32]
    # The partials are summed by a variadic reduce too (even ones, odd ones, then the two): a plain `jnp.sum` over
    # them took an order that depended on the whole product's shape, so a tier's piece of a layer's K experts
    # ([1, 256, 256] Q8_0 rows) did not give the bits of the same rows in the whole [6, 256, 256] product.
    if partial.shape[-1] % 2:
        partial = jnp.concatenate([partial, jnp.zeros_like(partial[..., :1])], axis=-1)
    even, odd = lax.reduce((partial[..., 0::2], partial[..., 1::2]), (zero, zero), _add_pairs, (partial.ndim - 1,))
    return even + odd


def _row_dot(w_RI: jax.Array, x_RI: jax.Array) -> jax.Array:
    """sum_i w[..., i] * x[..., i] in f32 (`x` broadcasts against `w`), spelled to stay fused with `w`'s decode.

    The spelling is chosen when lowering, per platform: XLA:CPU needs the variadic block sum (module docstring);
    on an H200 that form ran 3-5x slower than a plain `jnp.sum`, which XLA:GPU already fuses with the decode.
    """
    return lax.platform_dependent(w_RI * x_RI, cpu=_row_dot_xla_cpu, default=lambda p: jnp.sum(p, axis=-1))


_ROWS_AS_DOTS = contextvars.ContextVar("jds41_rows_as_dots", default=False)


@contextlib.contextmanager
def rows_as_dots():
    """Trace the one-token products inside this block as `dot`s of the dequantized weight (module docstring).

    A trace-time setting: only jitted functions whose cache key already tells the two spellings apart may trace
    under it (the wide prompt pass keys on its static tile). Per thread, like any context variable."""
    token = _ROWS_AS_DOTS.set(True)
    try:
        yield
    finally:
        _ROWS_AS_DOTS.reset(token)


def _check_in(x: jax.Array, w: QTensor, what: str) -> None:
    if x.shape[-1] != w.n_cols:
        raise ValueError(f"{what}: input has {x.shape[-1]} features, weight {w.qtype.name} rows have {w.n_cols}")


def qmatvec(x_in: jax.Array, w: QTensor) -> jax.Array:
    """y[o] = sum_i W[o, i] x[i] for one token; `w` logical `[out, in]`. f32 result, f32 accumulation.

    Dequantize, multiply and reduce form one fusion, so the only weight bytes touched are the quantized ones.
    """
    return qmatvec_parts(x_in, (w,))[0]


def qmatvec_made(x_in: jax.Array, w: dict, name: str, made: dict | None) -> jax.Array:
    """`qmatvec(x_in, w[name])`, or the value `made` holds under `name`: products of x_in already computed together
    (one launch, the same bits: model.attention_products)."""
    return made[name] if made is not None and name in made else qmatvec(x_in, w[name])


def qmatvec_parts(x_in: jax.Array, ws: tuple[QTensor, ...]) -> tuple[jax.Array, ...]:
    """`qmatvec(x_in, w)` for each w of `ws`: on CUDA one kernel launch where they `share_a_launch` (a gate and
    an up product of one x), with the bits of separate calls (a row's arithmetic is its tile's, and the tile is
    the shape's)."""
    for w in ws:
        if x_in.ndim != 1 or len(w.data.shape) != 2:
            raise ValueError(f"qmatvec takes x[in] and a 2-d weight, got x{list(x_in.shape)} and "
                             f"w{list(w.data.shape)}")
        _check_in(x_in, w, "qmatvec")
    x_in = _lazy_or_value(x_in, ws[0])
    if _ROWS_AS_DOTS.get():
        return tuple(jnp.einsum("i,oi->o", _act(x_in, w), _values(w.data, w.qtype, w.layout),
                                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) for w in ws)
    if not share_a_launch(ws):
        return tuple(qmatvec_parts(x_in, (w,))[0] for w in ws)
    w, raws, one = ws[0], _one_or_tuple(tuple(jnp.asarray(v.data)[None] for v in ws)), jnp.zeros(1, jnp.int32)
    if _int8(w):
        return tuple(y[0] for y in _as_tuple(_int8_rows_matvec(as_rows(x_in), w, raws, one)))
    xla = lambda x_I, raw_OR: _row_dot(_values(raw_OR, w.qtype, w.layout), _act(x_I, w))  # noqa: E731 (2-d)
    if not _kernel_applies(w):
        return tuple(xla(x_in, v.data) for v in ws)
    default = lambda x, raw, _idx: _each(raw, lambda r: xla(x[0], r[0])[None])  # noqa: E731
    return tuple(y[0] for y in _as_tuple(rows_matvec(as_rows(x_in), raws, one, w.qtype, w.layout, default=default)))


# One launch for a gate and an up product of one x (on by default since its first GPU run passed its bit tests: a
# V4.1 layer's IQ2_XXS gate/up 42.2 us against 2 x 22.3, the shared expert's Q8_0 12.2 against 2 x 6.7;
# results/profile_decode_round30_v41_4L_h200.jsonl). JDS41_SHARED_LAUNCH=0 (read at import) launches each alone.
_SHARED_LAUNCH = os.environ.get("JDS41_SHARED_LAUNCH", "1") == "1"


def share_a_launch(ws: tuple[QTensor, ...]) -> bool:
    """Whether one kernel launch computes the products of all of `ws` with one x: one format, layout, stored
    shape and activation rounding (the kernels read stacks of one shape, `triton_matvec.launch`), and switched on
    (`_SHARED_LAUNCH`)."""
    w = ws[0]
    same = all(v.qtype == w.qtype and v.layout == w.layout and v.act_round == w.act_round
               and v.data.shape == w.data.shape for v in ws[1:])
    return len(ws) == 1 or (_SHARED_LAUNCH and same)


def _one_or_tuple(raws: tuple):
    """One stack as an array (the one-stack kernel), several as a tuple (one launch for all)."""
    return raws[0] if len(raws) == 1 else raws


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _each(raw, f):
    """f of each stack of `raw` (an array, or a tuple of them), in the same structure."""
    return tuple(f(r) for r in raw) if isinstance(raw, tuple) else f(raw)


def qmatmul(x_TD: jax.Array, w: QTensor, *, precision=lax.Precision.HIGHEST) -> jax.Array:
    """y[t, o] = sum_d W[o, d] x[t, d] for T tokens; `w` logical `[out, in]`. f32 result, f32 accumulation.

    T == 1 (static) takes the fused `qmatvec` path. Otherwise the weight is dequantized once to f32 and fed to a
    `dot`: on CPU XLA cannot fuse the two, and the copy is shared by all T tokens. `precision` defaults to HIGHEST
    so GPUs do not drop to TF32; pass DEFAULT to allow it.
    """
    if x_TD.ndim != 2:
        raise ValueError(f"qmatmul takes x[T, in], got x{list(x_TD.shape)}")
    _check_in(x_TD, w, "qmatmul")
    if x_TD.shape[0] == 1:
        return qmatvec(x_TD[0], w)[None]
    w_OD = _values(w.data, w.qtype, w.layout)
    return jnp.einsum("td,od->to", _act(x_TD, w), w_OD, precision=precision,
                      preferred_element_type=jnp.float32)


def qmatmul_expert(x_TI: jax.Array, w_stack: QTensor, expert: jax.Array, *,
                   precision=lax.Precision.HIGHEST) -> jax.Array:
    """y[t, o] = sum_i W[expert, o, i] x[t, i] -> f32 [T, out]; `w_stack` logical `[E, out, in]`, `expert` a
    traced scalar. The one expert's raw rows are dequantized to f32 once and fed to a `dot` of the static shape
    [T, in] x [in, out]: with T fixed, every call is the same kernel, whose row t depends on x[t] only."""
    if x_TI.ndim != 2 or len(w_stack.data.shape) != 3:
        raise ValueError(f"qmatmul_expert takes x[T, in] and w[E, out, in], got x{list(x_TI.shape)} and "
                         f"w{list(w_stack.data.shape)}")
    _check_in(x_TI, w_stack, "qmatmul_expert")
    raw = lax.dynamic_index_in_dim(jnp.asarray(w_stack.data), expert, 0, keepdims=False)
    return jnp.einsum("ti,oi->to", _act(x_TI, w_stack), _values(raw, w_stack.qtype, w_stack.layout),
                      precision=precision, preferred_element_type=jnp.float32)


def qmatvec_experts(x: jax.Array, w_stack: QTensor, expert_idx_K: jax.Array, tile_k: int | None = None) -> jax.Array:
    """y[k, o] = sum_i W[idx[k], o, i] x[(k,) i]; `w_stack` logical `[E, out, in]`, result f32 `[K, out]`.

    `x` is `[in]` (one token shared by its K routed experts: gate/up) or `[K, in]` (one input per expert: down).
    Only the K selected experts' quantized rows are gathered (raw bytes, clamped indices), then dequantized inside
    the multiply-reduce fusion, so no f32 copy of even one expert is made. `tile_k`: compute with the GPU kernel's
    tile for that many experts (a piece of a layer's K, computed where its rows are, sums as the whole would).
    """
    return qmatvec_experts_parts(x, (w_stack,), expert_idx_K, tile_k)[0]


def qmatvec_experts_parts(x: jax.Array, w_stacks: tuple[QTensor, ...], expert_idx_K: jax.Array,
                          tile_k: int | None = None) -> tuple[jax.Array, ...]:
    """`qmatvec_experts(x, w, expert_idx_K, tile_k)` for each w of `w_stacks`: on CUDA one kernel launch where they
    `share_a_launch` (a layer's gate and up stacks), with the bits of separate calls."""
    K = expert_idx_K.shape[0]
    for w_stack in w_stacks:
        if len(w_stack.data.shape) != 3 or expert_idx_K.ndim != 1 or x.ndim not in (1, 2):
            raise ValueError(f"qmatvec_experts takes x[in] or x[K, in], w[E, out, in] and idx[K]; got "
                             f"x{list(x.shape)}, w{list(w_stack.data.shape)}, idx{list(expert_idx_K.shape)}")
        _check_in(x, w_stack, "qmatvec_experts")
    if x.ndim == 2 and x.shape[0] != K:
        raise ValueError(f"qmatvec_experts: x has {x.shape[0]} rows for {K} experts")
    x = _lazy_or_value(x, w_stacks[0])
    if _ROWS_AS_DOTS.get():
        spec = "ki,koi->ko" if x.ndim == 2 else "i,koi->ko"
        return tuple(jnp.einsum(spec, _act(x, w), _values(jnp.take(jnp.asarray(w.data), expert_idx_K, axis=0,
                                                                   mode="clip"), w.qtype, w.layout),
                                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) for w in w_stacks)
    if not share_a_launch(w_stacks):
        return tuple(qmatvec_experts_parts(x, (w,), expert_idx_K, tile_k)[0] for w in w_stacks)

    w_stack = w_stacks[0]
    layout = w_stack.layout
    raws = _one_or_tuple(tuple(jnp.asarray(w.data) for w in w_stacks))
    # a kernel's tile (formats the kernels take only)
    tile = lambda: None if tile_k is None else triton_matvec.default_tile(  # noqa: E731
        w_stack.qtype, tile_k, w_stack.data.shape[-2], w_stack.n_cols)
    if _int8(w_stack):
        return _as_tuple(_int8_rows_matvec(as_rows(x), w_stack, raws, expert_idx_K, tile()))
    x_XI = as_rows(x if isinstance(x, SwiGLU) else _act(x, w_stack))  # [1 or K, in]
    if not _kernel_applies(w_stack):
        return tuple(xla_rows_matvec(x_XI, jnp.asarray(w.data), expert_idx_K, w.qtype, layout) for w in w_stacks)
    return _as_tuple(rows_matvec(x_XI, raws, expert_idx_K, w_stack.qtype, layout, tile=tile()))


def xla_rows_matvec(x_XI: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype, layout: str = "ggml") -> jax.Array:
    """The XLA spelling of the one-token product over raw rows: y[k, o] = sum_i W[idx[k], o, i] x[k or 0, i] ->
    f32 [K, O], the selected rows gathered as bytes and decoded inside the multiply-reduce fusion. Every platform
    but CUDA computes decode's products so; on CUDA it is the reference the Triton kernel is checked against."""
    raw_KOR = jnp.take(raw_EOR, idx_K, axis=0, mode="clip")
    return _row_dot(_values(raw_KOR, qtype, layout), jnp.asarray(x_XI, jnp.float32)[:, None, :])


def rows_matvec(x_XI: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype, layout: str = "ggml",
                default=None, tile: tuple[int, int, int] | None = None) -> jax.Array:
    """`xla_rows_matvec`, computed on CUDA by the Triton kernel of triton_matvec (the choice is made when lowering:
    one traced function serves every platform). `default(x, raw, idx)` replaces the XLA spelling elsewhere; with
    JDS41_TRITON=interpret every platform runs the kernel, in Pallas' interpreter. `tile`: the kernel's, when not
    the one its shape gives. `raw_EOR` may be a tuple of stacks of one shape: one launch, a tuple of results."""
    def kernel(x, raw, idx, interpret=False):
        x = _f32_kernel_x(x, interpret)
        return triton_matvec.rows_matvec(x, raw, idx, qtype, layout=layout, interpret=interpret, tile=tile)

    if triton_matvec.INTERPRET:
        return kernel(x_XI, raw_EOR, idx_K, interpret=True)
    default = default or (lambda x, raw, idx: _each(raw, lambda r: xla_rows_matvec(x, r, idx, qtype, layout)))
    xla = lambda x, raw, idx: default(_value(x), raw, idx)  # noqa: E731
    return lax.platform_dependent(x_XI, raw_EOR, idx_K, cuda=kernel, default=xla)


def _kernel_applies(w: QTensor) -> bool:
    """The one-token product of `w` goes through the f32 Triton kernel on CUDA (triton_matvec): its format, layout
    and size have one, and the activation is read as is (llama.cpp's activation rounding is a CPU oracle's numerics,
    kept in XLA; the "int8" numerics reads the two-bit formats' x as int8, `_int8`)."""
    as_is = w.act_round is None or (w.act_round == "int8" and w.qtype not in INT8_TYPES)
    return as_is and triton_matvec.supported(w.qtype, w.nbytes, w.layout)


def _int8(w: QTensor) -> bool:
    """The product of `w` reads x as int8 blocks (the "int8" numerics and a two-bit format: quant/int8_act.py)."""
    return w.act_round == "int8" and w.qtype in INT8_TYPES


def _int8_round(x_XI: jax.Array, w: QTensor, interpret: bool):
    """(q, d, crumbs) the dp4a kernel reads for `w`: x rounded to int8 blocks by quant/int8_round_kernel.py's one
    launch (the same bits as `round_int8`), or with JDS41_INT8_ROUND_KERNEL=0 by XLA's three kernels; `crumbs`
    whether q comes in Q2_K's crumb-major order (the round kernel writes it so)."""
    crumbs = w.qtype == GGMLQuantizationType.Q2_K and int8_round_kernel.ENABLED
    if int8_round_kernel.ENABLED:
        q, d = int8_round_kernel.round_int8_rows(x_XI, crumb_major=crumbs, interpret=interpret)
    else:
        q, d = round_int8(x_XI)
    return q, d, crumbs


def _int8_rows_matvec(x_XI: jax.Array, w: QTensor, raw_EOR: jax.Array, idx_K: jax.Array, tile=None) -> jax.Array:
    """The one-token product of "int8" numerics: x [1 or K, I] rounded to int8 blocks, then the integer dot product
    of quant/int8_act.py, by the dp4a kernel on CUDA (quant/triton_int8.py) where it takes the rows, else by XLA
    (`_int8_round` says how the kernel's x is rounded)."""
    def xla(x, raw, idx):
        q, d = round_int8(_value(x))
        return _each(raw, lambda r: xla_int8_rows_matvec(q, d, r, idx, w.qtype, w.layout))

    if not triton_int8.supported(w.qtype, w.nbytes, w.layout):
        return xla(x_XI, raw_EOR, idx_K)

    def kernel(x, raw, idx, interpret=False):
        (q, d, crumbs), = kernel_inputs((x,), (w,), interpret)
        return triton_int8.rows_matvec_int8(q, d, raw, idx, w.qtype, w.layout, interpret=interpret, tile=tile,
                                            q_crumb_major=crumbs)

    if triton_matvec.INTERPRET:
        return kernel(x_XI, raw_EOR, idx_K, interpret=True)
    return lax.platform_dependent(x_XI, raw_EOR, idx_K, cuda=kernel, default=xla)


# What quant/co_launch.py asks of the products above: whether a product runs as a kernel, its tile, and its Job.


def rows_as_dots_active() -> bool:
    """Whether the products are being traced as `dot`s (`rows_as_dots`)."""
    return _ROWS_AS_DOTS.get()


def kernel_job_applies(ws: tuple[QTensor, ...]) -> bool:
    """Whether the one-token products of `ws` (with one x) are one kernel launch on CUDA: they `share_a_launch`
    and their format, layout and size have a kernel (the dp4a kernel for "int8" two-bit weights, else the f32
    one)."""
    w = ws[0]
    if not share_a_launch(ws):
        return False
    return triton_int8.supported(w.qtype, w.nbytes, w.layout) if _int8(w) else _kernel_applies(w)


def kernel_tile(w: QTensor, K: int) -> tuple[int, int, int, int]:
    """The kernel's tile (BO, NB, warps, splits) for K products with `w`'s rows (its shape's, as every path's)."""
    return triton_matvec.default_tile(w.qtype, K, w.data.shape[-2], w.n_cols)


def kernel_job(x_in, ws: tuple[QTensor, ...], raws: tuple, idx_K: jax.Array, tile_k: int | None,
               interpret: bool) -> triton_matvec.Job:
    """The kernel `Job` of the products of `ws` (raw stacks `raws` [E, O, R], indices idx_K) that `qmatvec_parts` /
    `qmatvec_experts_parts` launch where `kernel_job_applies`, reading `x_in`, the x of [1 or K, I] rows as
    `kernel_inputs` gives it (rounded as they round it): the same tile and step functions."""
    w, raws = ws[0], _one_or_tuple(raws)
    tile = None if tile_k is None else kernel_tile(w, tile_k)
    if _int8(w):
        q, d, crumbs = x_in
        return triton_int8.int8_job(q, d, raws, idx_K, w.qtype, w.layout, interpret, tile, q_crumb_major=crumbs)
    return triton_matvec.matvec_job(x_in, raws, idx_K, w.qtype, w.layout, tile)


@dataclasses.dataclass(frozen=True)
class PreRounded:
    """x [..., I] with its int8 blocks (q, d) = int8_act.round_int8(x), computed where x was (a sublayer input's
    launch, layers/mhc_input_kernel.py): a kernel product that reads int8 blocks in their plain order takes them
    instead of rounding x in a launch of its own (the same rounding code, so the same bits); every other reads x."""
    x: jax.Array
    q: jax.Array
    d: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    @property
    def ndim(self) -> int:
        return len(self.x.shape)

    def rows(self) -> PreRounded:
        n = self.x.shape[-1]
        return PreRounded(self.x.reshape(-1, n), self.q.reshape(-1, n), self.d.reshape(-1, n // 32))


jax.tree_util.register_dataclass(PreRounded, data_fields=["x", "q", "d"], meta_fields=[])


def reads_plain_int8(w: QTensor) -> bool:
    """Whether a product with `w` reads x as int8 blocks in their plain order, by a kernel where the kernels run
    (so a PreRounded x saves it a rounding launch)."""
    return _hidden_mode(w) == "int8" and triton_int8.supported(w.qtype, w.nbytes, w.layout)


def _hidden_mode(w: QTensor) -> str:
    """How a product with `w` reads its x (swiglu_kernel.MODES): int8 blocks as `_int8_round` gives them (Q2_K's
    order where the round kernel writes it), else f32."""
    if not _int8(w):
        return "f32"
    return "int8-crumbs" if w.qtype == GGMLQuantizationType.Q2_K and int8_round_kernel.ENABLED else "int8"


def kernel_inputs(xs: tuple, ws: tuple[QTensor, ...], interpret: bool) -> tuple:
    """What the kernel of the product of each x of `xs` ([X, I] rows, a SwiGLU or a PreRounded of them) with its
    weight of `ws` reads: (q, d, crumbs) for the "int8" numerics' products (`_int8_round`, or a PreRounded's own
    blocks where they are in the order read), else the f32 x (`_act`). The SwiGLU
    activations among them are computed together, one launch (quant/swiglu_kernel.py): a co-launch's requests
    prepared here get their hidden values from one launch, and the same bits as each prepared alone."""
    if not swiglu_kernel.ENABLED:
        xs = tuple(x.value() if isinstance(x, SwiGLU) else x for x in xs)
    lazy = [i for i, x in enumerate(xs) if isinstance(x, SwiGLU)]
    made = {}
    if lazy:
        modes = tuple(_hidden_mode(ws[i]) for i in lazy)
        made = dict(zip(lazy, swiglu_kernel.hidden_rows(tuple(xs[i] for i in lazy), modes, interpret)))
    prepared = []
    for i, (x, w) in enumerate(zip(xs, ws)):
        if i in made:
            prepared.append((*made[i], _hidden_mode(w) == "int8-crumbs") if _int8(w) else made[i])
        elif isinstance(x, PreRounded) and _hidden_mode(w) == "int8":
            prepared.append((x.q, x.d, False))
        else:
            x = _value(x)
            prepared.append(_int8_round(x, w, interpret) if _int8(w) else _act(x, w))
    return tuple(prepared)


def _value(x) -> jax.Array:
    """An activation as XLA computes it: a SwiGLU evaluated (swiglu_kernel's reference spelling), a PreRounded's x,
    an array as is."""
    if isinstance(x, SwiGLU):
        return x.value()
    return x.x if isinstance(x, PreRounded) else x


def as_rows(x):
    """x [in] or [K, in] (an array, a SwiGLU or a PreRounded) as [1 or K, in] rows."""
    return x.rows() if isinstance(x, (SwiGLU, PreRounded)) else x.reshape(-1, x.shape[-1])


def _lazy_or_value(x, w: QTensor):
    """x, a SwiGLU kept unevaluated only where the product with `w` is a kernel's on CUDA (its CUDA branch then
    computes it: `kernel_inputs`); evaluated by XLA on every other path (the dot form, XLA's products, the CPU
    oracle's roundings, JDS41_SWIGLU_KERNEL=0). A PreRounded stays where its blocks are what the product's kernel
    reads, else it is its x."""
    if isinstance(x, PreRounded):
        return x if not _ROWS_AS_DOTS.get() and reads_plain_int8(w) else x.x
    if not isinstance(x, SwiGLU):
        return x
    if not swiglu_kernel.ENABLED or _ROWS_AS_DOTS.get():
        return x.value()
    kernel = triton_int8.supported(w.qtype, w.nbytes, w.layout) if _int8(w) else _kernel_applies(w)
    return x if kernel else x.value()


def _f32_kernel_x(x, interpret: bool) -> jax.Array:
    """The f32 x [X, I] an f32 kernel reads: a SwiGLU computed by swiglu_kernel's launch, an array as is."""
    return swiglu_kernel.hidden_rows((x,), ("f32",), interpret)[0] if isinstance(x, SwiGLU) else x
