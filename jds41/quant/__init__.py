"""Quantized GGUF tensors in JAX: bit-exact dequantizers, the `QTensor` leaf, and products on quantized bytes.

Supported types: F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS, MXFP4 (DESIGN.md §1). `blocks` owns the byte layouts
and `dequantize`; `qtensor` owns `QTensor` and `qmatvec`/`qmatmul`/`qmatvec_experts`; `random_blocks` (numpy only,
not re-exported here) writes valid blocks for tests and synthetic model files.
"""

from jds41.quant.blocks import SUPPORTED_TYPES, block_size, dequantize, row_bytes
from jds41.quant.qtensor import (
    QTensor,
    qmatmul,
    qmatmul_expert,
    qmatvec,
    qmatvec_experts,
    qmatvec_experts_parts,
    qmatvec_made,
    qmatvec_parts,
)

__all__ = [
    "SUPPORTED_TYPES",
    "QTensor",
    "block_size",
    "dequantize",
    "qmatmul",
    "qmatmul_expert",
    "qmatvec",
    "qmatvec_experts",
    "qmatvec_experts_parts",
    "qmatvec_made",
    "qmatvec_parts",
    "row_bytes",
]
