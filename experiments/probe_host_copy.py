"""Does a whole pinned-host array moved inside jit overlap the compute around it? (issue #10's all-host prefill)

    python experiments/probe_host_copy.py [--gib 2] [--reps 5] [--out FILE.jsonl]

Three jitted programs on a pinned-host uint8 stack of --gib GiB and a device f32 matrix:
- move: `jax.device_put(stack, Space.Device)` inside jit, a checksum of the moved bytes;
- compute: a chain of matmuls on the device matrix sized to take about as long as the move;
- both: the two in one program with no data between them.
If XLA runs the move as an asynchronous copy beside the compute, `both` takes about max(move, compute); if the copy
is a kernel on the compute stream, about move + compute. The optimized HLO's text is searched for copy-start /
copy-done (async copies) and dynamic-slice (the counts are mentions: an instruction's name and its uses). A fourth
program, `tied`, puts the host array and the first half of the compute's result through one optimization barrier
before the move: if the move then waits for that half and overlaps the other (tied about half + max(move, half))
and stays an async copy, a move can be held back to a chosen point, which is what a bounded look-ahead of host
stacks needs. One JSON line.
Meaningful on the GPU only (on the CPU the "pinned host" array is ordinary memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit, _machine  # noqa: E402  (sibling scripts)
from bench_kernels import _seconds  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--matmuls", type=int, default=0, help="matmuls in the compute chain (0: sized to the move)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else "device")
    n = int(a.gib * 2**30) // 4096 * 4096
    stack = jax.device_put(np.ones((n // 4096, 4096), np.uint8), host)
    m = jax.device_put(jnp.full((4096, 4096), 1e-4, jnp.float32), dev)

    def move(s):
        return jnp.sum(jax.device_put(s, jax.memory.Space.Device)[::64].astype(jnp.int32))

    def matmuls(x, count):
        for _ in range(count):
            x = jnp.tanh(x @ m)
        return x

    def chain(x, count):
        return jnp.sum(matmuls(x, count))

    rows = n // 4096
    moved_ok = int(jax.jit(move)(stack)) == -(-rows // 64) * 4096  # the moved bytes are the stack's (all ones)
    move_s = _seconds(jax.jit(move), stack, repeats=a.reps)
    one_s = _seconds(jax.jit(lambda x: chain(x, 1)), m, repeats=a.reps)
    count = a.matmuls or max(1, round(move_s / max(one_s, 1e-6)))
    compute_s = _seconds(jax.jit(lambda x: chain(x, count)), m, repeats=a.reps)
    both = jax.jit(lambda s, x: (move(s), chain(x, count)))
    both_s = _seconds(both, stack, m, repeats=a.reps)
    hlo = both.lower(stack, m).compile().as_text()

    def tied(s, x):  # the move held back behind the first half of the compute, free to overlap the second half
        y = matmuls(x, count // 2)
        s, y = jax.lax.optimization_barrier((s, y))
        return move(s), chain(y, count - count // 2)

    tied_jit = jax.jit(tied)
    try:
        tied_s = _seconds(tied_jit, stack, m, repeats=a.reps)
        tied_hlo = tied_jit.lower(stack, m).compile().as_text()
        half = compute_s / 2
        tied_row = {"tied_s": round(tied_s, 5), "tied_if_held_and_overlapped_s": round(half + max(move_s, half), 5),
                    "tied_copy_start": tied_hlo.count("copy-start"),
                    "tied_dynamic_slice": tied_hlo.count("dynamic-slice")}
    except Exception as e:  # noqa: BLE001  (what XLA says of a barrier on host memory is the finding)
        tied_row = {"tied_error": f"{type(e).__name__}: {str(e)[:300]}"}
    row = {"bench": "host_copy_overlap", "gib": round(n / 2**30, 3), "memory_kind": host.memory_kind,
           "moved_ok": moved_ok,
           "move_s": round(move_s, 5), "move_gb_s": round(n / move_s / 1e9, 1), "matmuls": count,
           "compute_s": round(compute_s, 5), "both_s": round(both_s, 5),
           "serial_s": round(move_s + compute_s, 5), "overlapped_s": round(max(move_s, compute_s), 5),
           "overlap_share": round((move_s + compute_s - both_s) / min(move_s, compute_s), 3),
           "hlo": {"copy_start": hlo.count("copy-start"), "copy_done": hlo.count("copy-done"),
                   "dynamic_slice": hlo.count("dynamic-slice")},
           **tied_row, "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv)}
    line = json.dumps(row)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return row


if __name__ == "__main__":
    main()
