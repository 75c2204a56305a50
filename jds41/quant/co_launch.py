"""Several one-token products of different formats, shapes and inputs as one kernel launch on CUDA.

Why: a V4.1 layer's routed products (IQ2_XXS gate/up 36.5 us, Q2_K down 22.5 us a token on an H100) are
instruction-bound at ~1 TB/s, and the shared expert's Q8_0 products (13.1 + 8.4 us, bandwidth-bound at ~1.5-1.9
TB/s) ran after them on the same stream (results/profile_decode_attn_dot39_v41_4L_h100.jsonl). Nothing orders the
shared expert after the routed ones but the stream. One grid holding both lets an SM keep programs of each
resident, so the shared expert's loads proceed while the routed steps compute. (XLA's second stream,
layers/side_stream.py, is the general form of the same idea; it has not compiled in the engine.)

Measured (H100, experiments/README.md, fortieth session): gate/up 45.5 us a call against 36.7 + 14.1 apart, down
29.7 against 22.6 + 8.6, 12 fewer launches and ~20 us less kernel time a 4-layer token; decode 766.0 and 750.3
tok/s against the defaults' 746.0 and 746.4, the same predictions. Putting W_kv's product (3.2 us) beside W_qb's
(20.8) took 24.6 us against 24.0 apart, so attention keeps its two launches.

Owns `co_launch(jobs, interpret)`: the `triton_matvec.Job`s as one `pallas_call` over a 1-D grid, each program
running one program of one job with that job's own body (`triton_matvec.program`), so every row's arithmetic is
the one its job's own launch gives (the same tile, warps, steps and sums; tests/test_co_launch.py checks the bits
against separate launches, in the interpreter and compiled on the GPU). The jobs' programs are interleaved in
proportion to their counts (`order`), so each job's programs are spread over the whole launch rather than queued
behind another's. The jobs must share a warp count (a Triton launch has one; the shared expert's gate/up tile has
4 warps for this); `products` falls back to separate launches where they do not.

Decode uses it in a layer's FFN (`moe.routed_and_shared`: the routed and shared gate/up products, then the two
down products) and for an attention sublayer's small products of its input (`model.attention_products`: W_qa,
W_kv, the compressors', the indexer's W_proj; `ATTENTION`); it keeps the separate functions as the reference, and
the other paths (prompt pieces, layer-major rows, tiered experts) compute separately, so the engine's equalities
check these bits.

`products(requests)` is the qtensor-level entry: each request a tuple of products of one x (`Dense` or `Experts`),
all computed by one launch where `ENABLED` (JDS41_CO_LAUNCH, read at import; "0" launches each request alone, for
A/B runs) and every product is a kernel's, else by qtensor's own functions.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jds41.quant import qtensor
from jds41.quant import triton_matvec as tm

ENABLED = os.environ.get("JDS41_CO_LAUNCH", "1") == "1"
# An attention sublayer's products of its input together (model.attention_products), under ENABLED. Forty-third
# session, an H100: V4-Flash 8 layers int8 560.3 and 559.2 against 553.0 tok/s, 431.5 against 460.5 launches and
# 1,836 against 1,865 us of kernels a token; V4.1 4 layers 771.6, 791.1 against 782.2, 780.4 (3 launches fewer a
# token); the same predictions in every arm. JDS41_CO_LAUNCH_ATTENTION=0 launches them one by one (A/B runs).
ATTENTION = os.environ.get("JDS41_CO_LAUNCH_ATTENTION", "1") == "1"


def order(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(job, local program) of each program of a launch running `counts[i]` programs of job i, interleaved: program
    p of job i sits at fraction (p + 1/2) / counts[i] of the launch (ties to the lower job). int32 [sum(counts)]."""
    jobs = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(counts)])
    local = np.concatenate([np.arange(n, dtype=np.int32) for n in counts])
    at = np.concatenate([(np.arange(n) + 0.5) / n for n in counts])
    perm = np.lexsort((jobs, at))
    return jobs[perm], local[perm]


def _co_kernel(*refs, specs, n_inputs):
    """One program of a co-launch: read its (job, local program) from the order tables, split the local program
    into the job's (k, column, split) (k fastest, as a job's own 3-D grid runs), and run that job's program,
    storing its [BO] sums at their place in the job's [splits, K, P * O] output."""
    job_ref, local_ref = refs[0], refs[1]
    pid = pl.program_id(0)
    job_id, local = job_ref[pid], local_ref[pid]
    at, outs = 2, refs[2 + sum(n_inputs):]
    for i, (spec, n) in enumerate(zip(specs, n_inputs)):
        job_refs, at = refs[at:at + n], at + n

        def run(spec=spec, job_refs=job_refs, o_ref=outs[i]):
            K, cols, _ = spec.grid
            k, j, split = local % K, (local // K) % cols, local // (K * cols)
            bo = spec.tile[0]

            def store(acc_O):
                o_ref[split, k, pl.ds(j * bo, bo)] = acc_O

            tm.program(spec, job_refs, store, k, j, split)

        pl.when(job_id == i)(run)


def co_launch(jobs: tuple[tm.Job, ...], interpret: bool, joint: bool = False) -> tuple:
    """`jobs` (one warp count) as one launch -> each job's result, as its own `triton_matvec.launch` returns it
    (`joint`: a job of several stacks as one array of their results side by side, `Job.finish`)."""
    warps = {job.tile[2] for job in jobs}
    if len(warps) != 1:
        raise ValueError(f"co_launch: the jobs' tiles ask for different warp counts {sorted(warps)}")
    if interpret:
        jobs = tm.interpreted(jobs)
    counts = tuple(int(np.prod(job.grid)) for job in jobs)
    job_of, local_of = order(counts)
    inputs = [job.inputs() for job in jobs]
    outs = pl.pallas_call(
        functools.partial(_co_kernel, specs=tuple(job.spec() for job in jobs),
                          n_inputs=tuple(len(i) for i in inputs)),
        out_shape=tuple(job.out_shape() for job in jobs), grid=(sum(counts),),
        compiler_params=None if interpret else tm.compiler_params(warps.pop()), interpret=interpret,
        name="co_" + "_".join(job.name.removeprefix("rows_matvec_") for job in jobs),
    )(jnp.asarray(job_of), jnp.asarray(local_of), *(a for i in inputs for a in i))
    return tuple(job.finish(out, joint) for job, out in zip(jobs, outs))


@dataclasses.dataclass(frozen=True)
class Dense:
    """`qtensor.qmatvec_parts(x, ws)`: products of one x [in] with 2-d weights."""
    x: jax.Array
    ws: tuple


@dataclasses.dataclass(frozen=True)
class Experts:
    """`qtensor.qmatvec_experts_parts(x, ws, idx, tile_k)`: products of x [in] or [K, in] with the K selected
    matrices of each 3-d stack of `ws`."""
    x: jax.Array
    ws: tuple
    idx: jax.Array
    tile_k: int | None = None


def _separately(request):
    if isinstance(request, Dense):
        return qtensor.qmatvec_parts(request.x, request.ws)
    return qtensor.qmatvec_experts_parts(request.x, request.ws, request.idx, request.tile_k)


def _job(request, x_in, interpret: bool) -> tm.Job:
    """The request's kernel job reading `x_in` (its x as `qtensor.kernel_inputs` prepares it)."""
    if isinstance(request, Dense):
        one = jnp.zeros(1, jnp.int32)
        return qtensor.kernel_job(x_in, request.ws, tuple(jnp.asarray(w.data)[None] for w in request.ws), one, None,
                                  interpret)
    return qtensor.kernel_job(x_in, request.ws, tuple(jnp.asarray(w.data) for w in request.ws), request.idx,
                              request.tile_k, interpret)


def _one_launch(requests) -> bool:
    """Whether `requests` can be one launch: switched on, every product a kernel's (one launch a request, as
    qtensor would give it), one warp count among their tiles."""
    if not ENABLED or len(requests) < 2 or qtensor.rows_as_dots_active():
        return False
    if not all(qtensor.kernel_job_applies(r.ws) for r in requests):
        return False
    warps = {qtensor.kernel_tile(r.ws[0], 1 if isinstance(r, Dense) else (r.tile_k or r.idx.shape[0]))[2]
             for r in requests}
    return len(warps) == 1


def products(requests: tuple, joint: bool = False) -> tuple:
    """Each request's products (a tuple a request, as `qmatvec_parts` / `qmatvec_experts_parts` give them): one
    kernel launch on CUDA where `_one_launch`, the same bits as the requests computed one by one; otherwise, and on
    every other platform, one by one. `joint`: a request's products as one array, side by side on the last axis
    (a gate/up pair's [..., 2F], as the launch writes it: swiglu_kernel.SwiGLU reads it so, with no slice or join
    kernel of XLA's between the launches; XLA:GPU did not fold the join of the two slices)."""
    requests = tuple(requests)

    def separately():
        outs = tuple(_separately(r) for r in requests)
        return tuple(jnp.concatenate(y, axis=-1) for y in outs) if joint else outs

    if not _one_launch(requests):
        return separately()

    def kernel(*_, interpret=False):
        # every request's x prepared together: the SwiGLU ones (a layer's down products) in one launch
        xs = qtensor.kernel_inputs(tuple(qtensor.as_rows(r.x) for r in requests), tuple(r.ws[0] for r in requests),
                                   interpret)
        results = co_launch(tuple(_job(r, x, interpret) for r, x in zip(requests, xs)), interpret, joint)
        outs = []
        for r, y in zip(requests, results):
            y = y if isinstance(y, tuple) else (y,)
            y = tuple(v[0] for v in y) if isinstance(r, Dense) else y
            outs.append(y[0] if joint else y)
        return tuple(outs)

    if tm.INTERPRET:
        return kernel(interpret=True)
    return lax.platform_dependent(cuda=kernel, default=separately)
