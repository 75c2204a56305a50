"""Software pipelining of a Pallas (Triton) kernel's loop over weight bytes: Triton's `tt.num_stages` on its loops.

Why (experiments/README.md, thirty-first session): the one-token products are bound by latency, not by HBM. On the
H100, with 1.6x less bandwidth than the H200, a layer took only 1.22x as long and the Q8_0 products 1.03-1.19x; each
program waits for its step's loads before its arithmetic, with too few bytes in flight per SM. Triton's software
pipeliner issues a loop's loads S - 1 iterations ahead into shared memory (cp.async), without the registers a
program's own double buffering costs (`triton_matvec._kernel`'s `prefetch`, which made the Q8_0 head slower). By
default it pipelines only loads that feed a `tl.dot`; a loop that carries its own `tt.num_stages` attribute has
every wide enough load pipelined (Triton's AssignLatencies pass: `pipelineWithoutDot`, loads of at least 32
contiguous, aligned bits; triton-lang/triton pull request 7497 made the attribute reach all loads). Pallas sets no
attribute on the loops it lowers and has no option for one, so this module adds it after Pallas has built the
kernel's Triton module and before it is serialized.

How: a kernel asks for S stages by its name (`staged_name`: the suffix `__ls<S>`); `install()` wraps Pallas'
`lower_jaxpr_to_triton_module` once per process, and the wrapper sets `tt.num_stages = S` on every `scf.for` of a
module whose kernel name carries the suffix. The kernel's arithmetic is written as before, in the same order (the
staged loads read the same fields in wider loads: `triton_matvec.STAGED_LOADS`); Triton still picks
register layouts, and so the order of a reduction, per kernel, so tests/test_loop_stages.py checks the attribute in
the lowered module on the CPU and the bits against the unstaged kernel on the GPU. Where this JAX has no such
function to wrap, `install()` returns False and staged kernels run unstaged (their name still says what was asked;
`active()` says what ran).
"""

from __future__ import annotations

import re

_SUFFIX = re.compile(r"__ls(\d+)$")
_ATTR = "tt.num_stages"
_installed: bool | None = None  # None: not tried yet


def staged_name(name: str, stages: int | None) -> str:
    """`name` carrying a request for `stages` pipeline stages on its loops (None: no request, the name as is)."""
    if stages is None:
        return name
    if int(stages) < 1:
        raise ValueError(f"{name}: pipeline stages must be at least 1, got {stages}")
    return f"{name}__ls{int(stages)}"


def requested_stages(name: str) -> int | None:
    """The stages a kernel name asks for (`staged_name`), or None."""
    found = _SUFFIX.search(name)
    return int(found.group(1)) if found else None


def mark_loops(module, stages: int) -> None:
    """Set `tt.num_stages = stages` (i32) on every `scf.for` in the MLIR `module` (a Triton module)."""
    from jax._src.lib.mlir import ir

    with module.context:
        attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)
        pending = [module.operation]
        while pending:
            op = pending.pop()
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        inner = inner.operation
                        if inner.name == "scf.for":
                            inner.attributes[_ATTR] = attr
                        pending.append(inner)


def install() -> bool:
    """Wrap Pallas' Triton module lowering (once) so staged kernel names get their loops marked; whether it could."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # no Pallas Triton backend in this JAX
        _installed = False
        return False
    lower = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if lower is None:
        _installed = False
        return False

    def lower_with_stages(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        stages = requested_stages(getattr(jaxpr.debug_info, "func_name", "") or "")
        if stages is not None:
            mark_loops(result.module, stages)
        return result

    lowering.lower_jaxpr_to_triton_module = lower_with_stages
    _installed = True
    return True


def active() -> bool:
    """Whether staged kernels really get their loops marked in this process (after `install()`)."""
    return bool(_installed)
