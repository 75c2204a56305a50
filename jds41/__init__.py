"""jds41: a JAX/XLA inference engine for DeepSeek V4(.1)-Flash-class MoE models across HBM, host memory and SSD."""

import os
import platform

# Row invariance on the CPU backend (layers/rowwise.py): on a CPU with AVX-512, XLA:CPU vectorizes the same
# elementwise fusion differently for one row and for many, and contracts a multiply-add into an FMA in one form and
# not the other (seen in the mHC Sinkhorn: 32 rows differed from 32 one-row calls in the last bit; with AVX2 code
# they agree). Capping the CPU backend's ISA at AVX2 keeps every CPU program in the form the equality tests verify.
# Only XLA:CPU reads this flag (x86-64 only); set XLA_FLAGS with your own --xla_cpu_max_isa to override it.
if platform.machine().lower() in ("x86_64", "amd64") and "--xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX2").strip()
