"""The planar row layout of Q8_0, MXFP4 and IQ2_XXS weights: every block's quant bytes first, then every scale.

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

Planar rows exist only in memory: files and Orbax checkpoints keep GGML rows. An engine that runs the GPU kernels
regroups its resident weights once, on the device, after loading (`planar_params`), its tier stores regroup the
stacks they read, and the graph regroups the rows the SSD tier answers with; the one-token products then read them
with the planar Triton kernel on CUDA (quant/triton_matvec.py), and every other path decodes them here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from jds41.quant.blocks import iq2_xxs_values, mxfp4_values, q8_0_values

# qtype -> (values per block, scale bytes, quant bytes): a GGML block is the scale bytes, then the quant bytes.
PLANAR_TYPES = {T.Q8_0: (32, 2, 32), T.MXFP4: (32, 1, 16), T.IQ2_XXS: (256, 2, 64)}
LAYOUTS = ("ggml", "planar")
_VALUES = {T.Q8_0: q8_0_values, T.MXFP4: mxfp4_values, T.IQ2_XXS: iq2_xxs_values}


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
    return xp.concatenate([blocks[..., h:].reshape(*lead, -1), blocks[..., :h].reshape(*lead, -1)], axis=-1)


def from_planar(data, qtype):
    """Planar rows -> GGML rows (the inverse of `to_planar`)."""
    _, h, p = _fields(qtype)
    xp = np if isinstance(data, np.ndarray) else jnp
    nb = data.shape[-1] // (h + p)
    lead = data.shape[:-1]
    q = data[..., :nb * p].reshape(*lead, nb, p)
    d = data[..., nb * p:].reshape(*lead, nb, h)
    return xp.concatenate([d, q], axis=-1).reshape(*lead, nb * (h + p))


def quant_bytes(qtype, n_cols: int) -> int:
    """Bytes of a planar row's quant part (where its scales start)."""
    bs, _, p = _fields(qtype)
    return n_cols // bs * p


def dequantize_planar(data: jax.Array, qtype) -> jax.Array:
    """Planar rows uint8[..., R] -> f32[..., n_cols], the same bits `blocks.dequantize_rows` gives for the GGML
    rows. Traceable; fuses into its consumer like the GGML decoders."""
    bs, h, p = _fields(qtype)
    data = jnp.asarray(data)
    nb = data.shape[-1] // (h + p)
    lead = data.shape[:-1]
    q = data[..., :nb * p].reshape(*lead, nb, p)
    d = data[..., nb * p:].reshape(*lead, nb, h)
    return _VALUES[qtype](d, q).reshape(*lead, nb * bs)


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
        if not isinstance(leaf, QTensor) or leaf.qtype not in PLANAR_TYPES or leaf.layout != "ggml":
            return leaf
        data = leaf.data if isinstance(leaf.data, jax.Array) else jax.device_put(leaf.data)
        return leaf.with_layout(to_planar_on_device(data, leaf.qtype), "planar")

    out = {k: one(v) for k, v in params.items() if k != "blocks"}
    out["blocks"] = [{k: one(v) for k, v in block.items()} for block in params["blocks"]]
    return out
