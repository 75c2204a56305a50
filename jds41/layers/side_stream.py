"""An independent branch of a layer on a second CUDA stream (XLA's explicit stream annotation), so its kernels can
run while the main stream's run.

Why (experiments/README.md, thirty-sixth session): in V4.1's decode profile on an H100 the GPU is never idle
between kernels (every gap ~0 us), so a layer takes the sum of its ~40 kernels' durations, and many are short
kernels whose fixed cost (launch, ramp, tail) is most of their time. Two branches of a layer do not depend on the
rest of it until their results are added: the shared expert (two Q8_0 launches and a multiply, ~24 us) beside the
router and the routed experts (~65 us), and the token's K = V latent (a Q8_0 launch, its norm and rotation,
~6 us) beside the query's two products (~28 us). On a second stream their kernels can fill the SMs the other
branch's kernels leave idle in their ramps and tails. And a device loop's Engram host call (copies out and in and
the host's lookup, ~200 us of an idle GPU a token) feeds only the Engram layers, so on the second stream it can
overlap the layers before them (engram_host_call.fetch_step_rows). The kernels and their inputs are the same
either way, so every value is the same bits; only the order in which the GPU runs them changes.

`on_side_stream(site, fn, *args)` is fn(*args) wrapped in JAX's region-based `compute_on` with compute type
"gpu_stream:1": XLA turns the call into an async start and done on stream 1 (its flag
`xla_gpu_experimental_stream_annotation`, on by default in recent XLA); other platforms ignore the annotation and
run the call in place. Off unless JDS41_SIDE_STREAM (read at import) names its site: "1" every site (`ALL_SITES`:
the K = V "latent", the "shared" expert, the device loop's "engram" rows), or a comma list of them, so each can be
compiled and timed alone; where the installed jax offers no region-based `compute_on`, it stays off (`MECHANISM`
says which form is used and where).

Not usable on the GPU yet: its first run (20734c9, an H100, jax 0.11.2; experiments/README.md, thirty-seventh
session) failed to compile the engine's prefill graph: XLA found no execution stream for the call-start of the
K = V latent's region inside the layers' loop ("No ExecutionStreamId found for %call-start ... not reachable from
the module's entrypoint, or only reachable through embedded calls"). experiments/probe_side_stream.py asked which
graph shapes XLA accepts the annotation in: at 9676a52 (an H100) every one it tried compiled and kept the bits (top
level, while bodies, nested whiles, a weight argument, lax.platform_dependent, a host callback or a Pallas call
inside, a cond around) except a lax.cond inside the region, which failed as the engine did
(results/probe_side_stream39_h100.jsonl); its `--engine` mode tries the engine's sites one at a time. Lowered for
CUDA, the engine's regions held nested calls (the products' jitted `rows_matvec`, jnp.clip's), which the region's
attributes mark not inlineable and annotate for the stream, the one shape the small probe lacked; the failing
instruction was the reshape at the head of `rows_matvec`. Regions now inline them first (`inline_calls`), not yet
run on a GPU.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import jax
from jax.extend import core as jcore

ALL_SITES = ("latent", "shared", "engram")
STREAM = "gpu_stream:1"


def parse_sites(text: str) -> frozenset[str]:
    """JDS41_SIDE_STREAM's value -> the sites it switches on: "1" all, "0" or "" none, else a comma list."""
    if text in ("", "0"):
        return frozenset()
    if text == "1":
        return frozenset(ALL_SITES)
    sites = frozenset(text.split(","))
    if not sites <= set(ALL_SITES):
        raise ValueError(f"JDS41_SIDE_STREAM={text!r}: want 1, 0 or a comma list of {', '.join(ALL_SITES)}")
    return sites


SITES = parse_sites(os.environ.get("JDS41_SIDE_STREAM", "0"))


def _region_compute_on():
    """(the installed jax's region-based compute_on, its name), or (None, why not): jax 0.10 calls it
    `compute_on2`; later versions rewrote `compute_on` itself into that form."""
    try:
        from jax.experimental import compute_on as module
    except ImportError:
        return None, "no jax.experimental.compute_on"
    if hasattr(module, "compute_on2"):
        return module.compute_on2, "compute_on2"
    if "out_memory_spaces" in inspect.signature(module.compute_on).parameters:
        return module.compute_on, "compute_on"
    return None, "compute_on without regions"


_REGION, _FORM = _region_compute_on()
MECHANISM = ((f"{_FORM} ({','.join(s for s in ALL_SITES if s in SITES)})" if _REGION is not None
              else f"unavailable ({_FORM})") if SITES else "off")


def on_side_stream(site: str, fn: Callable, *args, inline: bool = True):
    """fn(*args) (a pytree of device arrays out), its kernels on stream 1 where `site` is switched on; the same
    values. `inline=False` keeps fn's nested calls as JAX lowers them (experiments/probe_side_stream.py's control)."""
    if site not in ALL_SITES:
        raise ValueError(f"on_side_stream: unknown site {site!r}")
    if site not in SITES or _REGION is None:
        return fn(*args)
    body = inline_calls(fn) if inline else fn
    return _REGION(body, compute_type=STREAM, out_memory_spaces=jax.memory.Space.Device)(*args)


# Primitives that only call a jaxpr (a nested jax.jit and its kin): a region takes their bodies in place.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call"})


def inline_calls(fn: Callable) -> Callable:
    """fn, traced with every nested call inlined, in conditionals' branches too: the same operations, the same
    values, no call boundary. Why: lowered in a region, each of them (the products' `rows_matvec` is a jax.jit, and
    it calls jnp.clip's) becomes a call that XLA must not inline, annotated for the stream like every operation in
    the region, which XLA then cannot place ("No ExecutionStreamId found for %call-start ... only reachable through
    embedded calls": the engine's prefill at 20734c9 failed on the reshape at the head of `rows_matvec`)."""
    def traced(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval_inlined(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return traced


def _eval_inlined(jaxpr: jcore.Jaxpr, consts, args) -> list:
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS:
            body = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
            outs = (_eval_inlined(body.jaxpr, body.consts, ins) if isinstance(body, jcore.ClosedJaxpr)
                    else _eval_inlined(body, (), ins))
        elif name == "cond":  # lax.platform_dependent's conditional (XLA folds it) holds the products' calls
            branches = tuple(_inlined_branch(b) for b in eqn.params["branches"])
            outs = eqn.primitive.bind(*ins, **{**eqn.params, "branches": branches})
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _inlined_branch(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in closed.in_avals]
    return jax.make_jaxpr(lambda *a: _eval_inlined(closed.jaxpr, closed.consts, a))(*avals)
