"""The float64 reference of mHC's Sinkhorn normalisation (MODEL.md §2.1) that the mHC kernel tests compare against."""

from __future__ import annotations

import numpy as np


def numpy_sinkhorn(logits: np.ndarray, eps: float, iters: int) -> np.ndarray:
    """[..., src, dst] logits -> comb in float64: softmax over dst + eps, normalise columns, then (iters - 1) x (rows,
    columns), each normalisation dividing by the sums + eps."""
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    c = e / e.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return c
