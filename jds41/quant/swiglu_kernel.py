"""An expert's hidden activation, silu(min(gate, limit)) * clip(up, -limit, limit), as a value the down products
take unevaluated (`SwiGLU`), computed on the GPU inside the launch that prepares their input: one Pallas (Triton)
launch gives every part of a layer's FFN its hidden values, rounded to int8 blocks where the "int8" numerics'
product reads them so (quant/int8_act.py) and f32 where a product reads f32.

Why (results/profile_decode_v4_state44_8L_h100.jsonl, V4-Flash 8 layers int8 on an H100): between a routed FFN's
gate/up launch and its down launch XLA ran three kernels, the routed experts' SwiGLU, the rounding kernel
(quant/int8_round_kernel.py) and the shared expert's SwiGLU, ~1.4 us each (4.4 us); here they are one (2.4 us) and
XLA's join of the gate/up halves (1.4 us; it does not fold the join on the GPU). Forty-fifth session, an H100
(experiments/README.md): a routed FFN 12 launches with this and the FFN input's blocks (model.rounds_ffn_input)
where it took 15; decode speed unresolved by two single pairs (+0.9% and -1.2%). The products'
entry points (quant/qtensor.py) and the co-launch (quant/co_launch.py) accept a `SwiGLU` where they take x: a path
whose product is a kernel's hands it to `hidden_rows` inside its CUDA branch (for a co-launch, every request's in
one launch), any other evaluates `SwiGLU.value()`, XLA's spelling (moe's reference, every platform but CUDA).

Bits. A program computes its values with the same code whichever launch and whichever other parts it runs with,
so every path on CUDA (decode's co-launch, the tiers' pieces, prompt rows, verification) gets the same hidden
values. The sigmoid is 1 / (1 + exp(-gate)) with libdevice's expf (what Pallas lowers exp to) and PTX's IEEE
division (Triton's own f32 division is the approximate div.full), the rounding is int8_round_kernel's; against
XLA's spelling they agree to f32 rounding, not bit for bit (tests/test_swiglu_kernel.py on an H100: h not equal
to XLA's, every int8 block's q equal at V4-Flash's and V4.1's widths, d within 2.2e-7).
Interpreted (the CPU tests, JDS41_TRITON=interpret) the body is XLA:CPU's own jax.nn.silu, so there the kernel and
the reference agree bit for bit and the tests check the plumbing (parts, rows, layouts) exactly.

JDS41_SWIGLU_KERNEL=0 (read at import) evaluates every `SwiGLU` with XLA, for A/B runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import int8_round_kernel as rk
from jds41.quant.int8_act import BLOCK

ENABLED = os.environ.get("JDS41_SWIGLU_KERNEL", "1") != "0"
CLAMP_MIN_LIMIT = 1e-6  # llama.cpp applies the SwiGLU clamps only for limit > 1e-6 (0 = off)
MODES = ("f32", "int8", "int8-crumbs")  # what a part's product reads: f32 values, int8 blocks, Q2_K's order of them


def swiglu(gate: jax.Array, up: jax.Array, limit) -> jax.Array:
    """silu(min(gate, limit)) * clip(up, -limit, limit); no clamp when limit <= 1e-6. f32. XLA's spelling, the
    reference."""
    gate, up = jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32)
    if isinstance(limit, (int, float)):
        if limit > CLAMP_MIN_LIMIT:
            gate = jnp.minimum(gate, jnp.float32(limit))
            up = jnp.clip(up, -jnp.float32(limit), jnp.float32(limit))
    else:  # a traced per-layer limit (e.g. scanned over stacked layers)
        lim = jnp.asarray(limit, jnp.float32)
        on = lim > CLAMP_MIN_LIMIT
        gate = jnp.where(on, jnp.minimum(gate, lim), gate)
        up = jnp.where(on, jnp.clip(up, -lim, lim), up)
    return jax.nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """`swiglu(gate, up, limit)` not yet evaluated, held as `gate_up` f32 [..., 2F] (the gate's F values, then the
    up's: what one launch of a gate and an up product writes, so the kernel reads it without a slice kernel of
    XLA's before it) and limit, a number or a traced scalar. `SwiGLU.of(gate, up, limit)` joins two arrays (XLA
    folds a join of the two halves of one array into that array)."""
    gate_up: jax.Array
    limit: object

    @classmethod
    def of(cls, gate: jax.Array, up: jax.Array, limit) -> SwiGLU:
        if gate.shape != up.shape:
            raise ValueError(f"SwiGLU: gate {gate.shape} and up {up.shape} differ")
        return cls(jnp.concatenate([jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32)], axis=-1), limit)

    @property
    def width(self) -> int:
        return self.gate_up.shape[-1] // 2

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.gate_up.shape[:-1], self.width)

    @property
    def ndim(self) -> int:
        return self.gate_up.ndim

    @property
    def gate(self) -> jax.Array:
        return self.gate_up[..., :self.width]

    @property
    def up(self) -> jax.Array:
        return self.gate_up[..., self.width:]

    def value(self) -> jax.Array:
        return swiglu(self.gate, self.up, self.limit)

    def rows(self) -> SwiGLU:
        """The same activation as [X, F] rows."""
        return SwiGLU(self.gate_up.reshape(-1, 2 * self.width), self.limit)


jax.tree_util.register_dataclass(SwiGLU, data_fields=["gate_up", "limit"], meta_fields=[])


def _limit_array(limit) -> jax.Array:
    """The limit as the kernel reads it, f32 [1]; a limit that turns the clamp off is 0 (a static off stays off)."""
    if isinstance(limit, (int, float)) and not limit > CLAMP_MIN_LIMIT:
        limit = 0.0
    return jnp.asarray(limit, jnp.float32).reshape(1)


def _hidden(g, u, lim, div, xla_silu: bool):
    """The SwiGLU of f32 blocks g, u under the scalar limit `lim`: the reference's clamp and silu(g) * u with
    sigmoid = 1 / (1 + exp(-g)) by `div` (the IEEE division compiled), or interpreted jax.nn.silu itself."""
    on = lim > np.float32(CLAMP_MIN_LIMIT)
    g = jnp.where(on, jnp.minimum(g, lim), g)
    u = jnp.where(on, jnp.clip(u, -lim, lim), u)
    if xla_silu:
        return jax.nn.silu(g) * u
    one = jnp.full_like(g, 1)
    return (g * div(one, one + jnp.exp(-g))) * u


@dataclasses.dataclass(frozen=True)
class _Part:
    """A part's static plan: X rows of F values, its mode, nbk blocks of 32 a program, programs [start, start + n)."""
    rows: int
    width: int
    mode: str
    nbk: int
    start: int

    @property
    def chunks(self) -> int:
        return self.width // BLOCK // self.nbk

    @property
    def programs(self) -> int:
        return self.rows * self.chunks


def _kernel(*refs, parts: tuple[_Part, ...], div, rint, xla_silu: bool):
    """One program: the part holding this program id takes its row's chunk of nbk blocks of 32 and writes its
    hidden values, or their int8 blocks and scales (in Q2_K's order for "int8-crumbs")."""
    pid = pl.program_id(0)
    ins, outs = refs[:2 * len(parts)], refs[2 * len(parts):]
    at_out = 0
    for i, part in enumerate(parts):
        gu_ref, lim_ref = ins[2 * i:2 * i + 2]
        n_out = 1 if part.mode == "f32" else 2
        out_refs, at_out = outs[at_out:at_out + n_out], at_out + n_out

        def run(part=part, gu_ref=gu_ref, lim_ref=lim_ref, out_refs=out_refs):
            local = pid - part.start
            row, first = local // part.chunks, (local % part.chunks) * part.nbk
            at = rk.block_positions(first, part.nbk)
            h = _hidden(gu_ref[row, at], gu_ref[row, part.width + at], lim_ref[0], div, xla_silu)
            if part.mode == "f32":
                out_refs[0][row, at] = h
                return
            q, d = rk.round_blocks(h, div=div, rint=rint)
            out_refs[0][row, rk.crumb_major_positions(at) if part.mode == "int8-crumbs" else at] = q
            out_refs[1][row, first + jnp.arange(part.nbk, dtype=jnp.int32)] = d

        pl.when((pid >= part.start) & (pid < part.start + part.programs))(run)


def hidden_rows(acts: tuple[SwiGLU, ...], modes: tuple[str, ...], interpret: bool = False) -> tuple:
    """Each of `acts` (rows [X, F], F a multiple of 32, of 256 for "int8-crumbs") in its mode of MODES, all in one
    launch: "f32" -> h f32 [X, F]; "int8" -> (q int8 [X, F], d f32 [X, F / 32]) = int8_act.round_int8(h); "int8-crumbs"
    -> the same with q in `triton_matvec._crumb_major` order. `interpret` runs it in Pallas' interpreter."""
    if len(acts) != len(modes) or not acts:
        raise ValueError(f"hidden_rows: {len(acts)} activations for {len(modes)} modes")
    parts, start, out_shape, inputs = [], 0, [], []
    for act, mode in zip(acts, modes):
        if mode not in MODES or act.ndim != 2 or act.gate_up.shape[-1] % 2:
            raise ValueError(f"hidden_rows: mode {mode!r} of {MODES}, gate and up [X, 2F]; got {act.gate_up.shape}")
        X, F = act.shape
        if F % (256 if mode == "int8-crumbs" else BLOCK):
            raise ValueError(f"hidden_rows: {F} values a row are not whole blocks for mode {mode!r}")
        part = _Part(X, F, mode, rk.row_chunk(F, mode == "int8-crumbs"), start)
        parts.append(part)
        start += part.programs
        out_shape.append(jax.ShapeDtypeStruct((X, F), jnp.float32 if mode == "f32" else jnp.int8))
        if mode != "f32":
            out_shape.append(jax.ShapeDtypeStruct((X, F // BLOCK), jnp.float32))
        inputs += [jnp.asarray(act.gate_up, jnp.float32), _limit_array(act.limit)]
    params = None
    if interpret:  # interpreted, the body is XLA:CPU code inlined into its caller: keep its rounding its own
        inputs = list(lax.optimization_barrier(tuple(inputs)))
    else:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=2, num_stages=1)
    div, rint = rk.asm_or_plain(interpret)
    outs = pl.pallas_call(
        functools.partial(_kernel, parts=tuple(parts), div=div, rint=rint, xla_silu=interpret),
        out_shape=tuple(out_shape), grid=(start,), compiler_params=params, interpret=interpret, name="swiglu_hidden",
    )(*inputs)
    if interpret:
        outs = lax.optimization_barrier(outs)
    results, at = [], 0
    for mode in modes:
        if mode == "f32":
            results.append(outs[at])
            at += 1
        else:
            results.append((outs[at], outs[at + 1]))
            at += 2
    return tuple(results)
