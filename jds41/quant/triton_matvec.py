"""Decode's one-token quantized products over raw rows as a Pallas (Triton) kernel for the GPU: its fast path there.

Why (experiments/README.md, "Where the step's time goes", "The Triton kernel", "Where a decode token's time goes"):
XLA:GPU fuses each format's block decode (blocks.py) into the multiply-and-sum of `qtensor._row_dot`, but read MXFP4
experts at 4-7% of HBM bandwidth on the H200 (its decode assembles each value from bit fields with selects, exact on
every backend, and that integer work, not the bytes, bounded it), V4.1's IQ2_XXS experts at ~140 GB/s in the loop,
and Q8_0 rows at ~900 GB/s. A kernel over Q8_0 rows in the GGML layout has to load byte by byte (a first design ran
4x slower than XLA and was dropped); in the planar layout (quant/planar.py) every load is contiguous and aligned.

Owns `rows_matvec(x_XI, raw_EOR, idx_K, qtype, layout) -> f32 [K, O]`: y[k, o] = sum_i W[idx[k], o, i] x[k or 0, i]
over raw rows `raw[E, O, row_bytes]` (a whole stack, or the K rows a tier gathered) of one of KINDS: MXFP4 in the
GGML layout (as in the file) or the planar one (what an engine with planar weights holds in every tier), Q8_0
planar, IQ2_XXS and Q2_K in either layout; `supported(...)`, which says when it applies;
`default_tile`, the tile rule; `planar_weights()`, whether an engine regroups its resident weights for it; and a
product's launch as a `Job` (`matvec_job`, `make_job`: inputs, step functions, tile, grid) with its one program body
(`program`), which `launch` runs alone and quant/co_launch.py beside other jobs in one grid.
`qtensor.qmatvec_experts` and `qtensor.qmatvec` call it on CUDA only (`lax.platform_dependent`); every other
platform and format, and the `rows_as_dots` / `act_round` products, keep the XLA spelling, which stays the
reference (tests/test_triton_matvec.py: the kernel in Pallas' interpreter on the CPU against a float64
re-derivation from gguf-py's dequantizer; on the GPU against XLA).

Loads: a program's step gathers its [BO rows, NB blocks, ...] bytes with explicit offsets (row * row_bytes + the
field's offset in the block), so any block size works and a warp's loads of a block's contiguous bytes coalesce;
in the planar layout the quants start at block * P from the row's start (P = 16 for MXFP4, 32 for Q8_0), aligned,
so Triton can load 16 bytes at once. MXFP4 decode: `_e2m1_doubled`, integer and float ops per value, no conversion
or select. IQ2_XXS: two lookups of magnitude bytes and one of sign bits per 8 values (IQ2XXS_GRID_WORDS, from
the packed grid blocks.py builds from gguf-py's grid). The
two-bit formats and Q8_0 turn their small integer codes into floats through 2^23's bits (`_small_int_to_f32`,
`_field_to_f32`: no conversion instruction); IQ2_XXS reads x permuted octet-major (`_octet_major`). Each format's
step is a load (the step's bytes) and a dot (the arithmetic), so IQ2_XXS can load a step ahead (PREFETCH); the
tile's fourth element splits a row's steps over programs (SPLITS), their sums added in split order.

Arithmetic (the same for every program, whatever E, K, the row's tier or the grid, for one tile): each step function
says its in-block order; the NB blocks of a step are summed and added to one f32 accumulator per row, step after
step. That is not XLA's order, so the kernel agrees with the XLA path to f32 rounding, not bitwise; decode stays
exact against itself because every such one-token product on CUDA is this kernel with a tile set by the shape alone
(placements, drafting, prompt pieces and row-batched decode alike). The two MXFP4 layouts are not interchangeable
there: Triton gave their loads different register layouts and so different summation orders on the H200, so a
tensor keeps one layout wherever it is read (planar.planar_params). `JDS41_TRITON=0` turns the kernel off (read
once, at import: for A/B benchmarks); without Pallas' Triton backend (deprecated in jax 0.11) the XLA path runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant.blocks import IQ2XXS_PACKED_GRID, mxfp4_half_scale
from jds41.quant.planar import quant_bytes

# JDS41_TRITON: "1" (default) the kernel on CUDA, "0" off (XLA everywhere), "interpret" the kernel on every
# platform through Pallas' interpreter: the engine's tests then run the kernel's arithmetic on the CPU
# (tests/test_triton_engine.py).
_MODE = os.environ.get("JDS41_TRITON", "1")
ENABLED, INTERPRET = _MODE != "0", _MODE == "interpret"
# JDS41_PLANAR=0 keeps resident weights in the GGML layout (for A/B benchmarks of the planar kernels).
PLANAR = os.environ.get("JDS41_PLANAR", "1") != "0"
_BACKEND = importlib.util.find_spec("jax.experimental.pallas.triton") is not None  # deprecated upstream (jax 0.11)
# qtype -> (values per block, bytes per block, bytes a step loads per block for the tile rule: the quants alone for
# the 32-value formats, whose tiles were measured so on the H200) of the formats the kernel decodes
BLOCKS = {T.MXFP4: (32, 17, 16), T.Q8_0: (32, 34, 32), T.IQ2_XXS: (256, 66, 66), T.Q2_K: (256, 84, 84)}
# (qtype, layout) pairs the kernel reads: Q8_0 only planar (its GGML rows, loaded byte by byte, ran at a quarter of
# XLA's speed), IQ2_XXS in both layouts (an engine with planar weights regroups it too), Q2_K in both (V4.1's down
# product [5120, 2304]: 9 blocks a row, so a step holds one block). Q2_K's GGML rows give a code's byte 4 sub-blocks
# and were loaded one byte a value: 43.2 us a call net of the loop against XLA's 67.2; planar rows (a sub-block one
# 4-byte word) 19.8 (results/bench_kernels_q2k_planar_h200.jsonl), and 51 -> 30 us a call in the decode profile
# (profile_decode_q2k25). JDS41_Q2K_KERNEL=0 leaves Q2_K to XLA (read at import: for A/B benchmarks).
Q2K_KERNEL = os.environ.get("JDS41_Q2K_KERNEL", "1") != "0"
KINDS = frozenset({(T.MXFP4, "ggml"), (T.MXFP4, "planar"), (T.Q8_0, "planar"), (T.IQ2_XXS, "ggml"),
                   (T.IQ2_XXS, "planar")} | ({(T.Q2_K, "ggml"), (T.Q2_K, "planar")} if Q2K_KERNEL else set()))
# The tile, set by the product's shape alone (so every path that computes a product of that shape, whatever the
# tier, layout or batching, sums in the same order): BO rows per program, NB blocks per step, NUM_WARPS warps.
# BO is made small enough that the grid has about PROGRAMS programs (a [2048, 4096] shared-expert matrix at BO = 16
# was 128 programs for 132 SMs: latency-bound), NB large enough that a program's step loads about STEP_BYTES.
# Both are powers of two (Triton's tiles are) that divide the shape, so any whole-block row length runs.
BO_MAX, PROGRAMS, STEP_BYTES, STEP_VALUES_MIN, NUM_WARPS = 16, 1024, 8192, 512, 4
# Offsets into the stack are 32-bit in Triton's lowering below 2^32 bytes, and signed products overflowed past
# 2^31 on the H200 (an illegal address with a 2.3 GB Q8_0 stack): larger stacks keep the XLA path.
MAX_STACK_BYTES = (1 << 31) - 1


def _kernel_type(name: str, variable: str):
    """The kernel format named `name` in environment variable `variable`, or a ValueError that names both."""
    if name not in T.__members__ or T[name] not in BLOCKS:
        raise ValueError(f"{variable}: {name!r} is not one of the kernel's formats {sorted(t.name for t in BLOCKS)}")
    return T[name]


def _splits_from(text: str) -> dict:
    """JDS41_SPLITS' "TYPE=S,..." as {type: S}, or a ValueError that says what it expected."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"JDS41_SPLITS: {item!r} is not TYPE=S with S a positive integer")
        out[_kernel_type(name, "JDS41_SPLITS")] = int(count)
    return out


# The formats whose steps load one step ahead (see `_kernel`): IQ2_XXS, whose step is arithmetic-heavy (its loads
# then overlap the arithmetic). In one H200 A/B its six gate/up products took 51.9 us against 60.9; the head
# (229 against 184), Q2_K and o_b took longer, their doubled byte registers costing occupancy
# (results/bench_kernels_prefetch_ab_h200.jsonl). JDS41_PREFETCH (read at import; for A/B benchmarks): "none",
# "all", or comma-separated type names.
_PREFETCH_ENV = os.environ.get("JDS41_PREFETCH", "IQ2_XXS")
PREFETCH = frozenset(BLOCKS if _PREFETCH_ENV == "all" else () if _PREFETCH_ENV == "none"
                     else (_kernel_type(name, "JDS41_PREFETCH") for name in _PREFETCH_ENV.split(",")))
# Row splits in the tile rule, per format (where they divide the row's steps): more programs, each a shorter loop.
# V4.1's IQ2_XXS gate/up in five (44.1 us against 50.9 for the six products, with prefetch:
# results/bench_kernels_twobit_splits_h200.jsonl; in the decode profile 33.3 us a call against 49.8 without
# either, profile_decode_ab23_v41_4L_h200.jsonl) and its Q2_K down, 9 blocks a row, in three (61.4 us against
# 64.3, bench_kernels_q2k_splits_h200.jsonl; 204.5 us a token against 207.0 in the profile: small).
# JDS41_SPLITS="TYPE=S,..." (read at import; for A/B benchmarks) replaces them.
_SPLITS_ENV = os.environ.get("JDS41_SPLITS")
SPLITS = _splits_from(_SPLITS_ENV) if _SPLITS_ENV is not None else {T.IQ2_XXS: 5, T.Q2_K: 3}


def has_triton_backend() -> bool:
    """Whether this JAX has Pallas' Triton backend (deprecated upstream in jax 0.11)."""
    return _BACKEND


def supported(qtype, stack_bytes: int, layout: str = "ggml") -> bool:
    """Whether `rows_matvec` takes this stack (else the XLA path computes the product): one of KINDS, under 2^31
    bytes."""
    return ENABLED and (_BACKEND or INTERPRET) and (qtype, layout) in KINDS and stack_bytes <= MAX_STACK_BYTES


def planar_weights(act_round: str | None = None) -> bool:
    """Whether an engine regroups its resident PLANAR_TYPES weights into planar rows (jds41/quant/planar.py) for
    these kernels: where they run (CUDA, or every platform with JDS41_TRITON=interpret) and the activation is read
    as is, or as int8 by the two-bit formats (the "int8" numerics, quant/triton_int8.py). Elsewhere the GGML rows
    stay, and XLA reads either layout to the same bits."""
    if not (ENABLED and PLANAR) or act_round not in (None, "int8") or not (_BACKEND or INTERPRET):
        return False
    return INTERPRET or jax.default_backend() == "gpu"


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    b = 1 << max(0, int(most).bit_length() - 1)  # the largest power of two <= most
    while n % b:
        b //= 2
    return b


# IQ2_XXS takes its own tile where it divides the shape: V4.1's gate/up [2304, 5120] ran 51.4 us at (16, 2) against
# 59.9 at the rule's (8, 4) in one H200 sweep (results/bench_kernels_iq2_groups_h200.jsonl); the sweep and the
# decode rows of experiments/README.md's twenty-second-session section check it.
IQ2_TILE = (16, 2)


# Tiles measured for V4.1's dense Q8_0 products, (qtype, K, n_out, n_in) -> (BO, NB, warps, splits): the best of
# one H200 sweep over rows {1, 4, 8, 16, 32} a program, {8, 16, 32} blocks a step, {2, 4, 8} warps and splits
# {1, 5} (results/bench_kernels_v41_q8_tiles_h200.jsonl; us a call in a 50-call loop, rule's tile -> this one):
# q_a 15.3 -> 12.6, kv 13.3 -> 9.8 (both 1 row a program by the rule: a short grid of long loops), q_b 30.2 -> 26.8,
# o_a 25.0 -> 23.4, o_b 28.5 -> 27.1, shared expert gate/up 16.2 -> 15.1, head 231 -> 222. In the decode profile
# (results/profile_decode_tiles24_v41_4L_h200.jsonl, us a call against profile_decode_seq24's): q_a 6.9 -> 4.7, kv
# 5.2 -> 2.9, q_b 19.7 -> 18.5, o_a 15.0 -> 14.3, o_b 18.5 -> 17.5, gate/up 8.0 -> 6.7, head 219 -> 208; the shared
# expert's down at the sweep's (16, 8, 8, 1) went 7.9 -> 8.6, so it keeps the rule's tile. Every other shape takes
# the rule. JDS41_MEASURED_TILES=0 (read at import; for A/B benchmarks) leaves all to it.
MEASURED_TILES = {
    (T.Q8_0, 1, 1280, 5120): (4, 32, 4, 5),  # attention q_a
    (T.Q8_0, 1, 512, 5120): (4, 32, 4, 5),  # attention kv
    (T.Q8_0, 1, 32768, 1280): (32, 8, 4, 1),  # attention q_b
    (T.Q8_0, 8, 1024, 4096): (16, 32, 4, 1),  # attention o_a: 8 groups, each its own input
    (T.Q8_0, 1, 5120, 8192): (8, 32, 4, 1),  # attention o_b
    # shared expert gate, up: 4 warps (15.1 us at 8 in the sweep; 14.1 against 13.3 a call in an H100 decode
    # profile) so that it shares a launch with the routed gate/up, which take 4 (quant/co_launch.py)
    (T.Q8_0, 1, 2304, 5120): (16, 8, 4, 5),
    (T.Q8_0, 1, 129280, 5120): (8, 32, 4, 1),  # output head
} if os.environ.get("JDS41_MEASURED_TILES", "1") != "0" else {}


def _tiles_from(text: str) -> dict:
    """JDS41_TILES' "TYPE:K:O:I=BO,NB,WARPS,SPLITS;..." as MEASURED_TILES entries, or a ValueError saying what it
    expected."""
    out = {}
    for item in filter(None, text.split(";")):
        shape, _, tile = item.partition("=")
        name, *dims = shape.split(":")
        numbers = [*dims, *tile.split(",")]
        if len(dims) != 3 or len(numbers) != 7 or not all(v.isdigit() and int(v) > 0 for v in numbers):
            raise ValueError(f"JDS41_TILES: {item!r} is not TYPE:K:O:I=BO,NB,WARPS,SPLITS of positive integers")
        out[(_kernel_type(name, "JDS41_TILES"), *map(int, dims))] = tuple(map(int, tile.split(",")))
    return out


# JDS41_TILES (read at import; for A/B benchmarks) adds or replaces measured tiles, e.g. the shared expert's gate/up
# at its sweep's 8 warps, JDS41_TILES="Q8_0:1:2304:5120=16,8,8,5" (it then cannot share the routed gate/up's launch).
MEASURED_TILES.update(_tiles_from(os.environ.get("JDS41_TILES", "")))


def default_tile(qtype, K: int, n_out: int, n_in: int) -> tuple[int, int, int, int]:
    """(BO, NB, warps, splits) for K products of [n_out, n_in] rows (the module's tile rule, or the measured tile of
    that shape; a function of the shape only)."""
    if (qtype, K, n_out, n_in) in MEASURED_TILES:
        return MEASURED_TILES[(qtype, K, n_out, n_in)]
    values, _, loaded = BLOCKS[qtype]
    if qtype == T.IQ2_XXS and n_out % IQ2_TILE[0] == 0 and (n_in // values) % IQ2_TILE[1] == 0:
        bo, nb = IQ2_TILE
    else:
        bo = _largest_power_of_two_dividing(n_out, min(BO_MAX, max(1, K * n_out // PROGRAMS)))
        most = max(STEP_VALUES_MIN // values, STEP_BYTES // (bo * loaded), 1)
        nb = _largest_power_of_two_dividing(n_in // values, most)
    splits = SPLITS.get(qtype, 1)
    return bo, nb, NUM_WARPS, splits if (n_in // values) % (nb * splits) == 0 else 1


_MAG, _SIGN, _ONE = np.uint32(0x01C00000), np.uint32(0x80000000), np.uint32(0x3F800000)


def _e2m1_doubled(q, shift: int):
    """The doubled e2m1 value ({0, 1, 2, 3, 4, 6, 8, 12}, sign at bit 3) of the nibble of uint32 bytes `q` at bit
    `shift` (0 or 4), with no lookup, conversion or select: the 3 magnitude bits m added at bits 22-24 to 1.0f read
    as g = {1, 1.5, 2, 3, 4, 6, 8, 12}, which is the value from m = 2 up; g + min(g - 2, 0) maps 1 and 1.5 (m = 0,
    1) to 0 and 1; the sign bit is then XORed in. Every intermediate is a normal f32, so no backend can flush it.
    XLA's decode (blocks._dec_mxfp4) assembles each value with selects and a conversion, and that work, not the
    bytes, bounded it on the H200."""
    g = lax.bitcast_convert_type(((q << (22 - shift)) & _MAG) + _ONE, jnp.float32)
    kv = g + jnp.minimum(g - np.float32(2), np.float32(0))
    sign = (q << (28 - shift)) & _SIGN
    return lax.bitcast_convert_type(lax.bitcast_convert_type(kv, jnp.uint32) ^ sign, jnp.float32)


def _f16_bytes(w_ref, r, at):
    """The two bytes of the little-endian f16s at byte offsets `at` of rows `r` (broadcast together)."""
    return w_ref[r, at], w_ref[r, at + 1]


def _f16_value(lo_hi):
    """The f16 of `_f16_bytes`' bytes, as f32."""
    lo, hi = (v.astype(jnp.uint16) for v in lo_hi)
    return lax.bitcast_convert_type(lo | (hi << 8), jnp.float16).astype(jnp.float32)


def _ar(n: int, axis: int, rank: int):
    """arange(n) as int32 laid along `axis` of a rank-`rank` shape of ones."""
    shape = [1] * rank
    shape[axis] = n
    return jnp.arange(n, dtype=jnp.int32).reshape(shape)


# Each format has a load function, which gathers one step's weight bytes (rows `rows` [BO], blocks b [NB] of the
# step) and nothing else, and a dot function, which turns those bytes and x row kx into the step's [BO] partial
# sums. Inside a block the order is fixed by the format (below); blocks are summed, then added to the accumulator.
# The split lets `_kernel` issue step t + 1's loads before step t's arithmetic (see there).


def _load_mxfp4(w_ref, rows, b, *, planar: bool, n_in: int):
    b2 = b[:, None]  # [NB, 1]
    q_at, e_at = (b2 * 16, n_in // 2 + b) if planar else (b2 * 17 + 1, b * 17)
    return w_ref[rows[:, None, None], (q_at + _ar(16, 1, 2))[None]], w_ref[rows[:, None], e_at[None, :]]


def _dot_mxfp4(loaded, x_ref, kx, b):
    """16 nibble bytes per block (value j low, value j + 16 high), an e8m0 scale: sum(lo*x + hi*x) * scale.
    The scales load as a [BO, NB] tile and x as [NB, 16] tiles, the load forms the H200 ran fast (e33c2e9); loaded
    as [BO, NB, 1] and squeezed, and x as [1, NB, 16] (be5a7e8), the resident V4-Flash products took 1.2-2.5x
    longer (experiments/README.md, thirteenth session)."""
    q, e = loaded[0].astype(jnp.uint32), loaded[1]  # [BO, NB, 16], [BO, NB]
    b2, pos = b[:, None], _ar(16, 1, 2)
    x_lo = x_ref[kx, b2 * 32 + pos][None]  # [1, NB, 16]: values 0-15 of each block (low nibbles)
    x_hi = x_ref[kx, b2 * 32 + 16 + pos][None]  # values 16-31 (high nibbles)
    sums = jnp.sum(_e2m1_doubled(q, 0) * x_lo + _e2m1_doubled(q, 4) * x_hi, axis=2)
    return jnp.sum(sums * mxfp4_half_scale(e), axis=1)


_Q8_MAGIC, _Q8_OFFSET = np.uint32(0x4B000080), np.float32((1 << 23) + 128)


def _load_q8_0(w_ref, rows, b, *, n_in: int):
    quants = w_ref[rows[:, None, None], (b[:, None] * 32 + _ar(32, 1, 2))[None]]  # [BO, NB, 32]
    return quants, _f16_bytes(w_ref, rows[:, None], (n_in + 2 * b)[None, :])


def _dot_q8_0(loaded, x_ref, kx, b):
    """Planar rows: 32 int8 per block from the row's start, f16 scales after them: sum(q*x) * d. Tiles loaded as
    in `_load_mxfp4`, for the same reason. Each int8 v becomes f32 as (2^23 + v + 128) - (2^23 + 128), exact."""
    raw, scale_bytes = loaded
    # v + 128 = byte ^ 0x80, ORed into 2^23's bits: no int-to-float conversion (an eighth of the FP32 rate)
    q = lax.bitcast_convert_type(raw.astype(jnp.uint32) ^ _Q8_MAGIC, jnp.float32) - _Q8_OFFSET
    sums = jnp.sum(q * x_ref[kx, b[:, None] * 32 + _ar(32, 1, 2)][None], axis=2)
    return jnp.sum(sums * _f16_value(scale_bytes), axis=1)


_MAGIC_I, _MAGIC_F = np.int32(0x4B000000), np.float32(1 << 23)  # 2^23 as f32 bits, and as a value


def _small_int_to_f32(m):
    """int32 m in [0, 2^23) -> f32 m exactly with two full-rate ops (2^23's bits OR m, minus 2^23) instead of an
    int-to-float conversion, which runs at a quarter of the FP32 rate on Hopper."""
    return lax.bitcast_convert_type(m | _MAGIC_I, jnp.float32) - _MAGIC_F


_MAGIC_U = np.uint32(0x4B000000)


def _field_to_f32(word, shift: int, mask: int):
    """The unsigned bit field (word >> shift) & mask of uint32 `word` (constant shift and mask) as f32, exactly:
    ORed into 2^23's bits, minus 2^23 (as `_small_int_to_f32`)."""
    return lax.bitcast_convert_type(((word >> np.uint32(shift)) & np.uint32(mask)) | _MAGIC_U, jnp.float32) - _MAGIC_F


def _iq2xxs_grid_words() -> np.ndarray:
    """The f32 IQ2_XXS step's grid table, uint32 [512]: words 2g and 2g + 1 hold grid entry g's magnitudes (8, 25 or
    43) as bytes, values 0-3 and 4-7.

    Three other forms lost on the H200 (twenty-fifth session; us a call net of the loop in bench_kernels, decode of
    V4.1 4 layers in tok/s, the same bits in each): a bf16 table, four lookups an octet and one op a value, 40-44 us
    against 19-27, decode 616/629 against 695/673 (results/bench_kernels_iq2_mags_*_h200.jsonl,
    bench_decode_iq2mags25); sign bits computed by population count (two lookups an octet, ~4 more ops), and the
    packed 2-bit codes with magnitudes by two FMAs (one lookup an octet, ~2 more ops a value), decode 647 and
    640/647 against 688/668 (bench_decode_iq2var25, bench_kernels_iq2_variants_*). So the step is bound by its
    lookups and its arithmetic together: neither can grow to shrink the other."""
    codes = (IQ2XXS_PACKED_GRID[:, None].astype(np.uint32) >> (2 * np.arange(8, dtype=np.uint32))) & 3
    mags = np.array([8, 25, 43], np.uint32)[codes].reshape(256, 2, 4)
    return (mags << (8 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32).reshape(512)


def _iq2xxs_sign_bytes() -> np.ndarray:
    """uint8 [128]: sign index i's 8 sign bits, i | parity(i) << 7 (ggml's even parity; bit k: value k negative).
    Bytes, not words: a warp's gather from a table of L 128-byte lines costs up to L L1 wavefronts, and this one is
    one line (as uint32 words it was four). The f32 kernel took 24.0 us a call net of the loop against 26.5 with the
    words (means of five calls each, spread 20-30; results/bench_kernels_signbytes_*_h200.jsonl); the int8 kernel
    reads it too (quant/triton_int8.py)."""
    i = np.arange(128, dtype=np.uint8)
    return i | (np.array([bin(int(v)).count("1") & 1 for v in i], np.uint8) << 7)


IQ2XXS_GRID_WORDS, IQ2XXS_SIGN_BYTES = _iq2xxs_grid_words(), _iq2xxs_sign_bytes()


def _load_iq2_xxs(w_ref, rows, b, *, planar: bool, n_in: int):
    r4, g, j = rows[:, None, None, None], _ar(8, 2, 4), _ar(4, 3, 4)  # [BO,1,1,1], [1,1,8,1] groups, [1,1,1,4] slots
    group = b[None, :, None, None] * (64 if planar else 66) + (0 if planar else 2) + g * 8
    idx = w_ref[r4, group + j]  # [BO, NB, 8, 4]
    aux = tuple(w_ref[r4, group + 4 + byte] for byte in range(4))  # [BO, NB, 8, 1] each
    d_at = quant_bytes(T.IQ2_XXS, n_in) + 2 * b if planar else b * 66  # planar: the d's after every group
    return idx, aux, _f16_bytes(w_ref, rows[:, None], d_at[None, :])


def _dot_iq2_xxs(loaded, x_ref, kx, b, grid_ref, sign_ref):
    """A 256-value block: f16 d, then 8 groups of (4 grid-index bytes, uint32 of 4 seven-bit sign indices and a
    4-bit scale s); planar rows hold every block's 64 group bytes first and the d's after them. Octet o = 4g + j
    (group g, slot j) holds 8 values: magnitudes from the grid entry of its index byte, signs from its sign index
    (with ggml's even-parity bit 7), looked up in IQ2XXS_GRID_WORDS and IQ2XXS_SIGN_BYTES. Per octet the sum over
    k = 0..7 of mag_k * (+-x_k) in that order, times d * (0.5 + s) / 4, then over octets and blocks. x comes permuted
    (`_octet_major`): value 8o + k of a block at 32k + o.

    Why this shape: the octet's work (index and sign loads, the lookups, the scale) is done once on
    [BO, NB, 8, 4] tensors (a group's sign word once, not once per slot) and the 8 values of an octet are a Python
    loop, so every shift is a constant and each k loads 32 contiguous floats of the permuted x. Per value: a byte
    of the magnitude word to f32 (`_field_to_f32`), the sign bit XORed into x, one multiply-add. V4.1's six
    [2304, 5120] products on the H200 (results/bench_kernels_iq2_groups_h200.jsonl, one call): 71.5 us for the
    earlier step over [BO, NB, 32, 8] tensors (Triton's layouts repeated each octet's work across the threads
    holding its values: ~23 instructions a value, ncu), 65.2 for this loop over [BO, NB, 32] octets with x as
    stored (ncu: 15.6 instructions a value, L1 82% busy with x's strided loads), 59.9 for this step (11 a value)."""
    idx_bytes, aux_bytes, d_bytes = loaded
    g, j = _ar(8, 2, 4), _ar(4, 3, 4)
    idx = idx_bytes.astype(jnp.int32)
    aux = aux_bytes[0].astype(jnp.uint32)
    for byte in range(1, 4):
        aux = aux | (aux_bytes[byte].astype(jnp.uint32) << (8 * byte))
    mags = (grid_ref[2 * idx], grid_ref[2 * idx + 1])  # magnitude bytes of values 0-3 and 4-7
    signs = sign_ref[((aux >> (7 * j).astype(jnp.uint32)) & 0x7F).astype(jnp.int32)].astype(jnp.uint32)
    x_at = b[:, None, None] * 256 + g[0] * 4 + j[0]  # [NB, 8, 4]: octet o's value 0 in the permuted x
    acc = None
    for k in range(8):
        x = x_ref[kx, x_at + 32 * k][None]  # [1, NB, 8, 4]
        signed_x = lax.bitcast_convert_type(
            lax.bitcast_convert_type(x, jnp.uint32) ^ ((signs << np.uint32(31 - k)) & _SIGN), jnp.float32)
        term = _field_to_f32(mags[k >> 2], 8 * (k & 3), 0xFF) * signed_x
        acc = term if acc is None else acc + term
    d = _f16_value(d_bytes)[:, :, None, None]
    scale = d * ((aux >> 28).astype(jnp.float32) + np.float32(0.5)) * np.float32(0.25)  # [BO, NB, 8, 1]
    return jnp.sum(jnp.sum(jnp.sum(acc * scale, axis=3), axis=2), axis=1)


def _octet_major(x_XI: jax.Array) -> jax.Array:
    """x [X, I] with each 256-value block's value 8o + k moved to 32k + o (the IQ2_XXS step's x)."""
    X, n_in = x_XI.shape
    return x_XI.reshape(X, n_in // 256, 32, 8).swapaxes(2, 3).reshape(X, n_in)


def _load_q2_k(w_ref, rows, b):
    r4, b4 = rows[:, None, None, None], b[None, :, None, None]
    sb, v = _ar(16, 2, 4), _ar(16, 3, 4)  # [1, 1, 16, 1] sub-blocks, [1, 1, 1, 16] values in one
    q_at = b4 * 84 + 16 + (sb >> 3) * 32 + (sb & 1) * 16 + v  # sub-block sb = 8c + 2s + h: byte c*32 + h*16 + v
    sc = w_ref[rows[:, None, None], (b[:, None] * 84 + _ar(16, 1, 2))[None]]  # [BO, NB, 16]
    d_at = (b * 84 + 80)[None, :]
    return w_ref[r4, q_at], sc, _f16_bytes(w_ref, rows[:, None], d_at), _f16_bytes(w_ref, rows[:, None], d_at + 2)


def _q2_k_block_sums(qx, xs, sc_bytes, d_bytes, dmin_bytes):
    """A step's [BO] sums from its per-sub-block sums of q*x [BO, NB, 16] and of x [1, NB, 16]: per block
    d * sum(scale * qx) - dmin * sum(min * xs) (both layouts' Q2_K steps)."""
    sc = sc_bytes.astype(jnp.int32)
    scaled = jnp.sum(_small_int_to_f32(sc & 15) * qx, axis=2)
    mins = jnp.sum(_small_int_to_f32(sc >> 4) * xs, axis=2)
    return jnp.sum(_f16_value(d_bytes) * scaled - _f16_value(dmin_bytes) * mins, axis=1)


def _dot_q2_k(loaded, x_ref, kx, b):
    """An 84-byte block: 16 bytes of (4-bit scale | 4-bit min << 4) for 16 sub-blocks of 16, 64 bytes of 2-bit
    quants (value c*128 + s*32 + l at bits 2s of byte c*32 + l), f16 d, f16 dmin. Per sub-block the sum of q*x
    and of x; then d * sum(scale * qx) - dmin * sum(min * x), the factoring ggml's own Q2_K dot uses."""
    q_bytes, sc_bytes, d_bytes, dmin_bytes = loaded
    sb, v = _ar(16, 2, 4), _ar(16, 3, 4)
    q = _small_int_to_f32((q_bytes.astype(jnp.int32) >> (2 * ((sb >> 1) & 3))) & 3)  # [BO, NB, 16, 16]
    x = x_ref[kx, b[:, None, None] * 256 + sb[0] * 16 + v[0]]  # [NB, 16, 16]
    qx = jnp.sum(q * x[None], axis=3)  # [BO, NB, 16]
    xs = jnp.sum(x, axis=2)[None]  # [1, NB, 16]
    return _q2_k_block_sums(qx, xs, sc_bytes, d_bytes, dmin_bytes)


def _load_q2_k_planar(w_ref, rows, b, *, n_in: int):
    w, t = _ar(16, 2, 4), _ar(4, 3, 4)  # [1, 1, 16, 1] sub-blocks (one 4-byte word each), [1, 1, 1, 4] its bytes
    codes = w_ref[rows[:, None, None, None], b[None, :, None, None] * 64 + w * 4 + t]  # [BO, NB, 16, 4]
    fields_at = quant_bytes(T.Q2_K, n_in) + b * 20  # each block's 16 scale|min bytes, d, dmin after every code
    sc = w_ref[rows[:, None, None], (fields_at[:, None] + _ar(16, 1, 2))[None]]  # [BO, NB, 16]
    d_at = (fields_at + 16)[None, :]
    return codes, sc, _f16_bytes(w_ref, rows[:, None], d_at), _f16_bytes(w_ref, rows[:, None], d_at + 2)


def _dot_q2_k_planar(loaded, x_ref, kx, b):
    """Planar Q2_K: a block's codes in value order, four a byte (value 4t + u at bits 2u of byte t), so a
    sub-block's 16 codes are its 4 bytes; then the 16 scale|min bytes, d and dmin. Per sub-block the sum of q*x
    (over the byte's 4 codes in order, then its 4 bytes) and of x, then d * sum(scale * qx) - dmin * sum(min * x) as
    `_dot_q2_k`. x comes permuted (`_crumb_major`: value 4t + u of a block at 64u + t), so each code position u of
    the loop below reads 64 contiguous floats and every shift is a constant."""
    codes, sc_bytes, d_bytes, dmin_bytes = loaded
    codes = codes.astype(jnp.uint32)
    w, t = _ar(16, 2, 4), _ar(4, 3, 4)
    x_at = b[:, None, None] * 256 + w[0] * 4 + t[0]  # [NB, 16, 4]: byte t of word w's code 0 in the permuted x
    qx_acc = x_acc = None
    for u in range(4):
        x = x_ref[kx, x_at + 64 * u][None]  # [1, NB, 16, 4]
        term = _field_to_f32(codes, 2 * u, 3) * x
        qx_acc, x_acc = (term, x) if u == 0 else (qx_acc + term, x_acc + x)
    qx, xs = jnp.sum(qx_acc, axis=3), jnp.sum(x_acc, axis=3)  # [BO, NB, 16], [1, NB, 16]
    return _q2_k_block_sums(qx, xs, sc_bytes, d_bytes, dmin_bytes)


def _crumb_major(x_XI: jax.Array) -> jax.Array:
    """x [X, I] with each 256-value block's value 4t + u moved to 64u + t (the planar Q2_K step's x)."""
    X, n_in = x_XI.shape
    return x_XI.reshape(X, n_in // 256, 64, 4).swapaxes(2, 3).reshape(X, n_in)


def _steps(qtype, planar: bool, n_in: int):
    """(load, dot) of a format's f32 step (the comment above `_load_mxfp4`)."""
    return {
        T.MXFP4: (functools.partial(_load_mxfp4, planar=planar, n_in=n_in), _dot_mxfp4),
        T.Q8_0: (functools.partial(_load_q8_0, n_in=n_in), _dot_q8_0),
        T.IQ2_XXS: (functools.partial(_load_iq2_xxs, planar=planar, n_in=n_in), _dot_iq2_xxs),
        T.Q2_K: (functools.partial(_load_q2_k_planar, n_in=n_in), _dot_q2_k_planar) if planar
        else (_load_q2_k, _dot_q2_k)}[qtype]


@dataclasses.dataclass(frozen=True)
class Job:
    """One product as a kernel launch computes it: x [1 or K, ...] in the form the step reads, the weight stacks
    (one shape, read with one x and one index list), idx [K], the step's other inputs (`extra`), its load and dot
    functions, whether it loads a step ahead, its tile (BO, NB, warps, splits), `steps` steps a program, and its
    kernel's name. `launch` runs one; quant/co_launch.py runs several in one grid."""
    x: jax.Array
    stacks: tuple
    idx: jax.Array
    extra: tuple
    load: object
    dot: object
    prefetch: bool
    tile: tuple
    steps: int
    name: str
    one_stack: bool  # the caller passed one stack, not a tuple: `finish` returns an array

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.stacks[0].shape

    @property
    def grid(self) -> tuple[int, int, int]:
        """(K, columns of programs over the parts' rows, splits)."""
        K, (_, n_out, _), (bo, _, _, splits) = self.idx.shape[0], self.shape, self.tile
        return K, len(self.stacks) * n_out // bo, splits

    def inputs(self) -> tuple:
        """The kernel's inputs in the order `program` reads them: idx (clamped), x, the flat stacks, extra. (A clamp
        of indices that are not constants is a ~1 us launch of XLA's: decode's are constants, model._ffn_block. A
        clamp inside the program kept the compiled bits but moved XLA:CPU's interpreted ones, forty-fifth session.)"""
        E, n_out, R = self.shape
        return (jnp.clip(self.idx.astype(jnp.int32), 0, E - 1), self.x,
                *(s.reshape(E * n_out, R) for s in self.stacks), *self.extra)

    def out_shape(self) -> jax.ShapeDtypeStruct:
        K, cols, splits = self.grid
        return jax.ShapeDtypeStruct((splits, K, cols * self.tile[0]), jnp.float32)

    def spec(self) -> Job:
        """This job with its arrays replaced by their shapes: what a kernel body may close over (it reads only
        shapes, the tile and the step functions; the values come through the refs)."""
        shape = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
        return dataclasses.replace(self, x=shape(self.x), stacks=tuple(map(shape, self.stacks)), idx=shape(self.idx),
                                   extra=tuple(map(shape, self.extra)))

    def finish(self, out, joint: bool = False):
        """The kernel's [splits, K, P * O] partial sums -> f32 [K, O] (a tuple of them for several stacks; `joint`:
        the stacks' results side by side, [K, P * O], with no slice), the splits added in split order, one add at a
        time: XLA keeps the order of explicit float adds wherever it fuses them, as it need not for a reduction over
        the split axis."""
        summed = functools.reduce(operator.add, (out[s] for s in range(1, self.tile[3])), out[0])
        if self.one_stack or joint:
            return summed
        n_out = self.shape[1]
        return tuple(summed[:, p * n_out:(p + 1) * n_out] for p in range(len(self.stacks)))


def program(job: Job, refs, store, k, j, split):
    """One program of `job`: BO rows of one selected matrix over `steps` steps of NB blocks (its split's share of
    the row) summed into one f32 accumulator per row, handed to `store`. `refs`: the job's inputs (`Job.inputs`).
    With `prefetch` step t + 1's bytes are loaded before step t's arithmetic and carried in the loop (register
    double buffering: Triton does not pipeline loads that feed no dot), so a program keeps a step's loads in
    flight while it computes; the last step's arithmetic follows the loop. The order of the sums is the same
    either way. With several parts (stacks of one shape read by one launch: a gate and an up product of one x)
    program column j takes part j // (O / BO), and the part's arithmetic is the one-part kernel's."""
    parts = len(job.stacks)
    idx_ref, x_ref, w_refs, extra = refs[0], refs[1], refs[2:2 + parts], refs[2 + parts:]
    load, dot, steps = job.load, job.dot, job.steps
    n_out, (bo, nb, _, _) = job.shape[1], job.tile
    kx = k if job.x.shape[0] > 1 else jnp.int32(0)
    per_part = n_out // bo
    rows = idx_ref[k] * n_out + (j % per_part) * bo + jnp.arange(bo, dtype=jnp.int32)  # of the flat [E * O, R] stack
    blocks = lambda t: (split * steps + t) * nb + jnp.arange(nb, dtype=jnp.int32)  # noqa: E731

    def rows_of(w_ref):
        if job.prefetch:
            def step(t, carry):
                acc_O, loaded = carry
                ahead = load(w_ref, rows, blocks(t + 1))
                return acc_O + dot(loaded, x_ref, kx, blocks(t), *extra), ahead

            acc_O, last = lax.fori_loop(0, steps - 1, step,
                                        (jnp.zeros((bo,), jnp.float32), load(w_ref, rows, blocks(0))))
            store(acc_O + dot(last, x_ref, kx, blocks(steps - 1), *extra))
        else:
            def step(t, acc_O):
                return acc_O + dot(load(w_ref, rows, blocks(t)), x_ref, kx, blocks(t), *extra)

            store(lax.fori_loop(0, steps, step, jnp.zeros((bo,), jnp.float32)))

    if parts == 1:
        rows_of(w_refs[0])
    else:
        for p, w_ref in enumerate(w_refs):
            pl.when(j // per_part == p)(functools.partial(rows_of, w_ref))


def _kernel(*refs, job: Job):
    """A launch of one job on its (K, columns, splits) grid; each program writes its [BO] block of the output."""
    o_ref = refs[-1]

    def store(acc_O):
        o_ref[0, 0, :] = acc_O

    program(job, refs[:-1], store, pl.program_id(0), pl.program_id(1), pl.program_id(2))


def compiler_params(warps: int):
    """Triton's parameters for a launch of `warps` warps (two stages, as every launch here)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def make_job(x_XI, raw_EOR, idx_K, extra, *, load, dot, prefetch: bool, tile, steps: int, name: str) -> Job:
    """A `Job` over raw rows `raw_EOR` [E, O, R] (or a tuple of stacks of one shape: one launch computes them all
    and returns a tuple) for K = len(idx_K) selections (clamped to the stack), x [1 or K, ...] (in the form the
    step reads), `extra` the step's other inputs; tile (BO, NB, warps, splits), `steps` steps a program."""
    stacks = raw_EOR if isinstance(raw_EOR, tuple) else (raw_EOR,)
    if any(s.shape != stacks[0].shape for s in stacks):
        raise ValueError(f"{name}: stacks read in one launch must have one shape, got {[s.shape for s in stacks]}")
    return Job(x_XI, stacks, idx_K, tuple(extra), load, dot, prefetch, tuple(tile), steps, name,
               one_stack=not isinstance(raw_EOR, tuple))


def interpreted(jobs: tuple[Job, ...]) -> tuple[Job, ...]:
    """`jobs` with their x and stacks passed through one optimization barrier, for a launch in Pallas' interpreter.
    Interpreted, a kernel is XLA:CPU code inlined into the caller (loops of one trip vanish): two calls on one weight
    could then share its decoded loads (CSE) and fuse, and so round, by their surroundings. The barrier keeps each
    call's arithmetic its own, as the compiled Triton kernel's is on the GPU."""
    barred = lax.optimization_barrier(tuple((job.x, job.stacks) for job in jobs))
    return tuple(dataclasses.replace(job, x=x, stacks=stacks) for job, (x, stacks) in zip(jobs, barred))


def launch(job: Job, interpret: bool):
    """`job` as one kernel launch on its (K, columns, splits) grid -> f32 [K, O] (a tuple for several stacks)."""
    params = None
    if interpret:
        (job,) = interpreted((job,))
    else:
        params = compiler_params(job.tile[2])
    bo = job.tile[0]
    out = pl.pallas_call(
        functools.partial(_kernel, job=job.spec()), out_shape=job.out_shape(), grid=job.grid,
        out_specs=pl.BlockSpec((1, 1, bo), lambda k, j, s: (s, k, j)),
        compiler_params=params, interpret=interpret, name=job.name,
    )(*job.inputs())
    return job.finish(out)


def checked_tile(name: str, kinds, qtype, layout: str, raw_EOR, K: int, X: int, n_in: int,
                 tile) -> tuple[int, int, int, int]:
    """The checks a kernel entry `name` makes of its rows (one of `kinds`, whole blocks, under 2^31 bytes) and of x
    (1 or K rows), then its tile (BO, NB, warps, splits): `tile` (splits 1 when left out) or the shape's."""
    E, n_out, R = (raw_EOR[0] if isinstance(raw_EOR, tuple) else raw_EOR).shape  # a tuple: launch checks the rest
    if (qtype, layout) not in kinds:
        raise ValueError(f"{name} does not take {qtype.name} rows in the {layout} layout")
    values, block, _ = BLOCKS[qtype]
    if n_in % values or R != n_in // values * block or X not in (1, K):
        raise ValueError(f"{name}: rows of {R} bytes for {n_in} inputs, x with {X} rows for {K} indices")
    if E * n_out * R > MAX_STACK_BYTES:
        raise ValueError(f"{name}: a stack of {E * n_out * R} bytes needs 64-bit offsets")
    bo, nb, warps, splits = (*tile, 1)[:4] if tile else default_tile(qtype, K, n_out, n_in)
    if n_out % bo or (n_in // values) % (nb * splits):
        raise ValueError(f"tile ({bo}, {nb}, splits {splits}) does not divide {n_out} rows of {n_in // values} blocks")
    return bo, nb, warps, splits


def matvec_job(x_XI: jax.Array, raw_EOR, idx_K: jax.Array, qtype, layout: str = "ggml",
               tile: tuple[int, ...] | None = None) -> Job:
    """The `Job` of `rows_matvec` (its arguments), for `launch` or quant/co_launch.py."""
    K, n_in = idx_K.shape[0], x_XI.shape[1]
    bo, nb, warps, splits = checked_tile("rows_matvec", KINDS, qtype, layout, raw_EOR, K, x_XI.shape[0], n_in, tile)
    values = BLOCKS[qtype][0]
    extra = (jnp.asarray(IQ2XXS_GRID_WORDS), jnp.asarray(IQ2XXS_SIGN_BYTES)) if qtype == T.IQ2_XXS else ()
    if qtype == T.IQ2_XXS:
        x_XI = _octet_major(x_XI)
    elif qtype == T.Q2_K and layout == "planar":
        x_XI = _crumb_major(x_XI)
    load, dot = _steps(qtype, layout == "planar", n_in)
    return make_job(x_XI.astype(jnp.float32), raw_EOR, idx_K, extra, load=load, dot=dot, prefetch=qtype in PREFETCH,
                    tile=(bo, nb, warps, splits), steps=n_in // (nb * values * splits),
                    name=f"rows_matvec_{qtype.name.lower()}_{layout}")


@functools.partial(jax.jit, static_argnames=("qtype", "layout", "interpret", "tile"))
def rows_matvec(x_XI: jax.Array, raw_EOR: jax.Array, idx_K: jax.Array, qtype, layout: str = "ggml",
                interpret: bool = False, tile: tuple[int, ...] | None = None) -> jax.Array:
    """y[k, o] = sum_i W[idx[k], o, i] x[k, i] (x [K, I]) or x[0, i] (x [1, I]) -> f32 [K, O], from raw rows
    `raw_EOR` uint8 [E, O, row_bytes] of `qtype` in `layout` ("ggml" as in the file, or "planar"). Indices are
    clamped to the stack like `jnp.take(mode="clip")`. `interpret` runs the kernel in Pallas' interpreter (any
    platform: the CPU tests); `tile` (BO, NB, warps[, splits]) overrides the tile for benchmarks (BO must divide O,
    and NB * splits the row's blocks: each of `splits` programs sums its share of a row's steps, and the shares'
    sums are added in split order). `raw_EOR` may be a tuple of stacks of one shape: one launch, a tuple of results
    (`launch`)."""
    return launch(matvec_job(x_XI, raw_EOR, idx_K, qtype, layout, tile), interpret)
