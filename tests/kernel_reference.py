"""The float64 reference of the one-token quantized products that the kernel tests compare against: gguf-py's
dequantizer (an implementation independent of jds41's decoders) times x in numpy."""

from __future__ import annotations

import gguf
import numpy as np


def reference_rows_matvec(x_XI, raw_EOR, idx_K, qtype) -> np.ndarray:
    """y[k] = W[idx[k]] x[k] (x [K, I]) or W[idx[k]] x[0] (x [1, I]) in float64 from the GGML rows `raw_EOR`,
    indices clamped to the stack as the kernels clamp them."""
    x = np.asarray(x_XI, np.float64)
    rows = [gguf.quants.dequantize(raw_EOR[e], qtype).astype(np.float64) @ x[k if len(x) > 1 else 0]
            for k, e in enumerate(np.clip(idx_K, 0, len(raw_EOR) - 1))]
    return np.stack(rows)


def rel_error(got, want) -> float:
    """The largest absolute difference, relative to the largest magnitude of `want`."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())
