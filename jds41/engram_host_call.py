"""The step's Engram host call, as the device loops (decode_loop, speculative_loop) make it.

A step feeds a block of tokens (one in decode, the verify block in speculative decode) whose Engram rows depend
on token ids the device produced, so each step enters the host once. Two forms give the same bytes
(tests/test_engram_ffi.py): the FFI handler of jds41/native (C++, no Python on the step's path; with an SSD expert
tier it hands the fed token ids to a thread that starts their hash-layer experts' reads) and a Python
`io_callback` (which does that prefetch inside the step), kept where the handler has no form for the row source or
cannot be built, by default for an SSD expert tier with hash layers (measured faster there:
native/engram_ffi.engram_ffi_for), and on request (JDS41_ENGRAM_HOST=callback).
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jds41.layers.engram_rows import read_step_rows
from jds41.layers.side_stream import on_side_stream
from jds41.native.engram_ffi import engram_ffi_for


class CallbackRows:
    """The Python form: rows from the engine's row source, and the hash-layer experts' SSD reads started."""

    def __init__(self, engine):
        self.hasher, self.source = engine.engram
        self.tiers = engine.tiers
        e = self.hasher.ecfg
        self.shape = (len(e.layer_ids), e.n_buckets, e.row_bytes)

    def _host(self, block, hist, n_hist):
        block, n_hist = [int(t) for t in np.asarray(block)], int(np.asarray(n_hist).reshape(-1)[0])
        history = np.asarray(hist)[len(hist) - n_hist:] if n_hist else np.zeros((0,), np.int64)
        if self.tiers is not None:
            self.tiers.prefetch_tokens(block)
        return read_step_rows(self.source, self.hasher.row_ids_seq(block, history))

    def __call__(self, block, hist, n_hist):
        out = jax.ShapeDtypeStruct((block.shape[0], *self.shape), jnp.uint8)
        return io_callback(self._host, out, block, hist, n_hist, ordered=False)


_STEP_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_rows_fn(engine):
    """The engine's one host-call object (a static argument of the jitted loops, so they compile once per
    engine): `fn(block [T], hist [n-1], n_hist)` -> uint8 [T, n_layers, n_buckets, row_bytes] inside jit;
    None for a model without Engram."""
    if engine.engram is None:
        return None
    if engine not in _STEP_ROWS:
        _STEP_ROWS[engine] = engram_ffi_for(engine) or CallbackRows(engine)
    return _STEP_ROWS[engine]


def fetch_step_rows(rows_fn, block, hist, n_hist):
    """`rows_fn(block, hist, n_hist)` inside a device loop's step. Only the Engram layers read the rows (V4.1's
    first is layer 1), so with the side stream's site "engram" on, the host round trip (~200 us a token on an H100:
    copies out and in, the lookup) goes on the second stream (layers/side_stream.py), where it can overlap the
    layers before them; the same rows either way."""
    return on_side_stream("engram", rows_fn, block, hist, n_hist)
