"""Row invariance: how a layer's T-token form gets exactly the arithmetic of its one-token (decode) form.

Speculative verification must reproduce decode bit for bit (MODEL.md §4), so the per-row arithmetic of a prefill
or verify row may not depend on T. Broadcasting a leading token axis is not enough on XLA: a reduction over many
rows can be lowered differently from the same reduction over one row (seen on CPU with 64 rows of width <= 512),
a vmapped matvec becomes a matmul with its own summation order, and XLA:CPU contracts a*b+c into an FMA only
inside one fusion, so where fusion boundaries fall changes the last bits. Two tools fix this:

- `island(tree)`: an optimization barrier. The one-token layer functions pass their token-dependent inputs
  and their outputs through it, so neither the producer of an input nor the consumer of an output can be fused
  into the layer: its fusions, and so its rounding, are the same in every program that calls it.
- `map_rows(fn, *xs_T)`: runs the one-token `fn` on each row with `jax.lax.map`; the loop body sees the decode
  shapes. Inputs and outputs of the body are islands too, because XLA removes a loop of trip count 1 and would
  otherwise fuse the T=1 body into its surroundings.

Cost: a barrier materializes a small activation (a token's [D] / [H, D] / [K] values) that could have stayed in a
fusion. Faster batched paths may replace `map_rows` later only together with a bit-identity test against decode.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def island(tree):
    """Pass a pytree of arrays through an optimization barrier: a fusion boundary, values unchanged."""
    return jax.lax.optimization_barrier(tree)


def map_rows(fn: Callable, *xs_T):
    """[fn(*row_t) for t] stacked on a new leading axis; each `xs_T` leaf has the token axis first."""
    return jax.lax.map(lambda row: island(fn(*island(row))), xs_T)
