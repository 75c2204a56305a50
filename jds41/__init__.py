"""jds41: a JAX/XLA inference engine for DeepSeek V4(.1)-Flash-class MoE models across HBM, host memory and SSD."""

import os
import platform


def _default_xla_flag(flag: str, value: str) -> None:
    """Add --flag=value to XLA_FLAGS unless the user's XLA_FLAGS already sets that flag (theirs wins). XLA reads
    XLA_FLAGS when JAX first starts a backend, so this holds when jds41 is imported before any computation runs."""
    flags = os.environ.get("XLA_FLAGS", "")
    if f"--{flag}=" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{flag}={value}".strip()


# Row invariance on the CPU backend (layers/rowwise.py): on a CPU with AVX-512, XLA:CPU vectorizes the same
# elementwise fusion differently for one row and for many, and contracts a multiply-add into an FMA in one form and
# not the other (seen in the mHC Sinkhorn: 32 rows differed from 32 one-row calls in the last bit; with AVX2 code
# they agree). Capping the CPU backend's ISA at AVX2 keeps every CPU program in the form the equality tests verify.
# Only XLA:CPU reads this flag (x86-64 only).
if platform.machine().lower() in ("x86_64", "amd64"):
    _default_xla_flag("xla_cpu_max_isa", "AVX2")

# The same greedy output in every process (GPU). XLA:GPU times candidate GEMM and fusion configurations when it
# compiles and keeps the fastest, so two processes may compile a product with different tilings, so different
# summation orders; under int8 activations one ulp can flip a rounding and then a near-tied argmax. On an H100
# (experiments/results/bench_decode_determinism31_v41_4L_h100.jsonl) two processes with autotuning gave two
# prediction hashes, two without it gave one; decode speed was within noise (716/670 against 698/695 tok/s: the
# step's large products are the project's own Triton kernels, with tiles fixed by shape) and prefill ~1% slower.
# Level 0 makes XLA take its heuristic choice, a function of the shape and the GPU. Only XLA:GPU reads this flag.
_default_xla_flag("xla_gpu_autotune_level", "0")
