"""The planar row layout of Q8_0, MXFP4, IQ2_XXS and Q2_K weights: every block's quant bytes first, then every scale.

Why (experiments/README.md, "Where the step's time goes"): a GGML row interleaves a block's scale with its quants
(Q8_0: 2 + 32 bytes, MXFP4: 1 + 16), so no block starts on a 4-byte boundary. XLA:GPU read Q8_0 rows at ~900 GB/s
of the H200's 4.4 TB/s, and a Triton kernel over them has to load byte by byte. Planar rows hold the same bytes
regrouped:

    GGML    [d0 q0] [d1 q1] ... [d_{n-1} q_{n-1}]        (d: a block's scale bytes, q: its quant bytes)
    planar  [q0 q1 ... q_{n-1}] [d0 d1 ... d_{n-1}]

A row keeps its length (so shapes, byte counts, tier budgets and row gathers are unchanged), its quant bytes are
contiguous from the row's start (16-byte aligned whenever the row length is: rows of whole 256-value multiples
are), and the values are bit for bit those of the GGML row (`dequantize_planar` decodes each block's fields with
the same functions as blocks.py). Within a block the quant bytes keep their GGML order (MXFP4: byte j holds value j
in its low nibble and value j + 16 in its high one). IQ2_XXS (2 + 64 bytes a block) takes the layout too, so its
group words start 8-byte aligned; on the H200 that bought its kernel nothing measurable (68.1 us planar against
70.1 GGML in one call, 71.8 against 71.2 in another) and XLA's reads ~3% (results/bench_kernels_iq2_steps_h200.jsonl,
bench_kernels_q2k_iq2tiles_h200.jsonl).

Q2_K (16 scale|min bytes, 64 quant bytes, f16 d, f16 dmin a block) takes it too, with its quant bits reordered: the
file's byte c*32 + l holds values c*128 + s*32 + l at bits 2s (s = 0..3), so a 4-byte word spans four sub-blocks
and the kernel loaded one byte per value (~450 GB/s on the H200, twenty-fourth session). A planar Q2_K block's 64
quant bytes hold its 256 codes in value order, four a byte from the low bits (value 4t + u at bits 2u of byte t),
so a sub-block's 16 values are one aligned 4-byte word; its 20 scale bytes are the block's other fields in file order
(16 scale|min bytes, d, dmin). The codes, scales and values are unchanged (`dequantize_planar` decodes them with the
file decoder's arithmetic).

Planar rows exist only in memory: files and Orbax checkpoints keep GGML rows. An engine that runs the GPU kernels
regroups its resident weights once, on the device, after loading (`planar_params`), its tier stores regroup the
stacks they read, and the graph regroups the rows the SSD tier answers with; the one-token products then read them
with the planar Triton kernel on CUDA (quant/triton_matvec.py), and every other path decodes them here.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from jds41.quant.blocks import iq2_xxs_values, mxfp4_values, q2_k_values, q8_0_values

# qtype -> (values per block, scale bytes, quant bytes): a GGML block is the scale bytes, then the quant bytes
# (Q2_K's are split around its quants: `_split_block`).
PLANAR_TYPES = {T.Q8_0: (32, 2, 32), T.MXFP4: (32, 1, 16), T.IQ2_XXS: (256, 2, 64), T.Q2_K: (256, 20, 64)}
LAYOUTS = ("ggml", "planar")
# JDS41_PLANAR_Q2K=0 leaves Q2_K stacks in the file's layout when an engine regroups its weights (read at import: for
# A/B benchmarks of the planar Q2_K kernel against the GGML one).
_REGROUPED = frozenset(PLANAR_TYPES) - ({T.Q2_K} if os.environ.get("JDS41_PLANAR_Q2K", "1") == "0" else set())
_CRUMBS = np.array([0, 2, 4, 6], np.uint8)  # the bit offsets of a byte's four 2-bit codes


def _q2k_values(scales, quants):
    """Planar Q2_K fields -> f32[..., 256]: 20 scale bytes (16 scale|min, d, dmin), 64 bytes of codes in value
    order."""
    codes = _unpack_crumbs(quants)  # [..., 64, 4]: value 4t + u
    return q2_k_values(scales[..., :16], codes.reshape(*codes.shape[:-2], 256), scales[..., 16:18],
                       scales[..., 18:20])


_VALUES = {T.Q8_0: q8_0_values, T.MXFP4: mxfp4_values, T.IQ2_XXS: iq2_xxs_values, T.Q2_K: _q2k_values}


def _unpack_crumbs(packed):
    """bytes [..., n] -> their 2-bit codes [..., n, 4], code u from bits 2u (the inverse of `_pack_crumbs`)."""
    return (packed[..., :, None] >> _CRUMBS) & 3


def _pack_crumbs(codes, xp):
    """uint8 codes [..., n, 4] (each 0..3) -> bytes [..., n], code u at bits 2u."""
    out = codes[..., 0]
    for u in range(1, 4):
        out = out | (codes[..., u] << xp.uint8(2 * u))
    return out


def _split_block(blocks, qtype, xp):
    """GGML blocks [..., B] -> (scale bytes [..., h], planar quant bytes [..., p])."""
    if qtype != T.Q2_K:
        h = PLANAR_TYPES[qtype][1]
        return blocks[..., :h], blocks[..., h:]
    lead = blocks.shape[:-1]
    codes = (blocks[..., 16:80].reshape(*lead, 2, 1, 32) >> _CRUMBS.reshape(4, 1)) & 3  # [..., c, s, l]
    return (xp.concatenate([blocks[..., :16], blocks[..., 80:]], axis=-1),
            _pack_crumbs(codes.reshape(*lead, 64, 4), xp))  # value order c*128 + s*32 + l, four a byte


def _join_block(scales, quants, qtype, xp):
    """The inverse of `_split_block`: (scale bytes, planar quant bytes) -> GGML blocks."""
    if qtype != T.Q2_K:
        return xp.concatenate([scales, quants], axis=-1)
    lead = quants.shape[:-1]
    codes = _unpack_crumbs(quants).reshape(*lead, 2, 4, 32)  # [..., c, s, l]
    qs = _pack_crumbs(codes.swapaxes(-1, -2), xp).reshape(*lead, 64)  # byte c*32 + l, value s at bits 2s
    return xp.concatenate([scales[..., :16], qs, scales[..., 16:]], axis=-1)


def regrouped(qtype) -> bool:
    """Whether an engine that regroups its weights (`planar_params`, the tier stores) regroups this format."""
    return qtype in _REGROUPED


def _fields(qtype) -> tuple[int, int, int]:
    if qtype not in PLANAR_TYPES:
        raise ValueError(f"no planar layout for {T(qtype).name} (only {', '.join(t.name for t in PLANAR_TYPES)})")
    return PLANAR_TYPES[qtype]


def to_planar(raw, qtype):
    """GGML rows uint8[..., R] -> planar rows uint8[..., R] (numpy in, numpy out; jax in, jax out)."""
    _, h, p = _fields(qtype)
    xp = np if isinstance(raw, np.ndarray) else jnp
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // (h + p), h + p)
    lead = raw.shape[:-1]
    scales, quants = _split_block(blocks, qtype, xp)
    return xp.concatenate([quants.reshape(*lead, -1), scales.reshape(*lead, -1)], axis=-1)


def from_planar(data, qtype):
    """Planar rows -> GGML rows (the inverse of `to_planar`)."""
    _, h, p = _fields(qtype)
    xp = np if isinstance(data, np.ndarray) else jnp
    nb = data.shape[-1] // (h + p)
    lead = data.shape[:-1]
    q = data[..., :nb * p].reshape(*lead, nb, p)
    d = data[..., nb * p:].reshape(*lead, nb, h)
    return _join_block(d, q, qtype, xp).reshape(*lead, nb * (h + p))


def quant_bytes(qtype, n_cols: int) -> int:
    """Bytes of a planar row's quant part (where its scales start)."""
    bs, _, p = _fields(qtype)
    return n_cols // bs * p


def block_parts(data: jax.Array, qtype, layout: str) -> tuple[jax.Array, jax.Array]:
    """Rows uint8[..., R] in `layout` -> every block's (scale bytes [..., nb, h], planar quant bytes [..., nb, p]):
    the fields of a planar block whichever layout holds them (traceable)."""
    _, h, p = _fields(qtype)
    data = jnp.asarray(data)
    nb = data.shape[-1] // (h + p)
    lead = data.shape[:-1]
    if layout == "ggml":
        return _split_block(data.reshape(*lead, nb, h + p), qtype, jnp)
    return data[..., nb * p:].reshape(*lead, nb, h), data[..., :nb * p].reshape(*lead, nb, p)


def dequantize_planar(data: jax.Array, qtype) -> jax.Array:
    """Planar rows uint8[..., R] -> f32[..., n_cols], the same bits `blocks.dequantize_rows` gives for the GGML
    rows. Traceable; fuses into its consumer like the GGML decoders."""
    d, q = block_parts(data, qtype, "planar")
    return _VALUES[qtype](d, q).reshape(*d.shape[:-2], -1)


@functools.partial(jax.jit, static_argnums=1, donate_argnums=0)
def to_planar_on_device(raw, qtype):
    """`to_planar` of a device array, jitted, its GGML rows donated."""
    return to_planar(raw, qtype)


def planar_params(params: dict) -> dict:
    """The parameter pytree with its PLANAR_TYPES `QTensor` leaves regrouped into planar rows on the device (GGML
    rows go in, donated, one tensor at a time); values unchanged, other leaves pass through.

    A routed expert stack must have one layout wherever its rows are read: Triton compiled the two layouts' MXFP4
    loads into different register layouts and so different in-block summation orders on the H200, and placements
    must give the resident bits. So an engine that regroups its resident stacks here has its tier stores hold
    planar rows too (tiers/stores.build_stores(planar=True)), and the rows the SSD tier answers with are regrouped
    in the graph (tiers/experts.py)."""
    from jds41.quant.qtensor import QTensor

    def one(leaf):
        if not isinstance(leaf, QTensor) or not regrouped(leaf.qtype) or leaf.layout != "ggml":
            return leaf
        data = leaf.data if isinstance(leaf.data, jax.Array) else jax.device_put(leaf.data)
        return leaf.with_layout(to_planar_on_device(data, leaf.qtype), "planar")

    out = {k: one(v) for k, v in params.items() if k != "blocks"}
    out["blocks"] = [{k: one(v) for k, v in block.items()} for block in params["blocks"]]
    return out
