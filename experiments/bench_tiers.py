"""Per-tier bandwidth through jds41's own stores, against the raw figures of DESIGN.md §7 (issue #4, item 8).

Experts have V4-Flash's MXFP4 shape (gate/up [2048, 4096], down [4096, 2048]: 13.4 MB each) and live in a raw
file laid out like GGUF expert stacks (random bytes: bandwidth does not care about values). Measured:
- ssd:  ExpertReader (8 O_DIRECT threads, 1 MiB requests) reading every expert, 6 at a time (one layer's top-6);
        raw figure 1.9 GB/s (8 threads, 1 MiB O_DIRECT on the GPU box).
- host: HostStore stacks in pinned_host memory, 6 experts per layer gathered inside one jitted step by the graph's
        own path (tiers/experts.host_rows: dynamic index into the whole host array, then device_put), 8 layers
        per step; raw figure 48 GB/s (same mechanism, DESIGN.md §7) / 55 GB/s (whole-array transfer).
- slot: SsdStore.fetch through the slot cache (cold then warm), the host call the graph makes on an SSD miss.
Prints one JSON line. CPU runs check the code path only (memory kinds are labels there): not speed figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from jds41.tiers.experts import host_rows
from jds41.tiers.ssd import ExpertReader
from jds41.tiers.stores import ExpertLayout, HostStore, SsdStore, Stack

D, F = 4096, 2048
ROW_GATE, ROW_DOWN = D // 32 * 17, F // 32 * 17  # MXFP4 bytes per row


def make_file(path: str, layers: int, experts: int) -> ExpertLayout:
    gate_b, down_b = F * ROW_GATE, D * ROW_DOWN
    per_layer = experts * (2 * gate_b + down_b)
    stacks, off = {}, 0
    for layer in range(layers):
        st = []
        for kind, shape, eb in (("gate", (experts, F, D), gate_b), ("up", (experts, F, D), gate_b),
                                ("down", (experts, D, F), down_b)):
            st.append(Stack(kind, f"blk.{layer}.ffn_{kind}_exps.weight", path, off, T.MXFP4, shape, eb))
            off += experts * eb
        stacks[layer] = tuple(st)
    if not os.path.exists(path) or os.path.getsize(path) != off:
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(layers):
                left = per_layer
                while left:
                    n = min(left, 256 << 20)
                    f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                    left -= n
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the SSD figure must not come from the page cache
    os.close(fd)
    return ExpertLayout(stacks)


def bench_ssd(layout: ExpertLayout, experts: int) -> dict:
    keys = [(layer, e) for layer in layout.layers for e in range(experts)]
    with ExpertReader(layout) as reader:
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(keys), 6):
            out = reader.read(keys[i:i + 6])
            n += sum(v.nbytes for v in out.values())
        dt = time.perf_counter() - t0
        return {"bytes": n, "seconds": round(dt, 3), "gb_per_s": round(n / dt / 1e9, 3), "direct_io":
                reader.stats.to_dict().get("direct_io")}


def bench_host(layout: ExpertLayout, experts: int, steps: int) -> dict:
    local = {(layer, e): e for layer in layout.layers for e in range(experts)}
    with ExpertReader(layout) as reader:
        store = HostStore(layout, local, reader)
    stacks = [store.stacks[layer] for layer in layout.layers]
    kind = stacks[0]["gate"].data.sharding.memory_kind

    @jax.jit
    def step(stacks, idx_LK):
        total = jnp.zeros((), jnp.uint32)
        for layer, st in enumerate(stacks):
            for k in ("gate", "up", "down"):
                rows = host_rows(st[k], idx_LK[layer])
                total = total + jnp.sum(rows, dtype=jnp.uint32)  # every byte must arrive on the device
        return total

    rng = np.random.default_rng(1)
    idx = [jnp.asarray(rng.integers(0, experts, (len(stacks), 6)), jnp.int32) for _ in range(steps + 2)]
    step(stacks, idx[0]).block_until_ready()
    t0 = time.perf_counter()
    for i in range(steps):
        step(stacks, idx[i + 1]).block_until_ready()
    dt = time.perf_counter() - t0
    moved = steps * len(stacks) * 6 * layout.expert_nbytes(layout.layers[0])
    return {"memory_kind": kind, "steps": steps, "layers_per_step": len(stacks), "bytes": moved,
            "seconds": round(dt, 4), "gb_per_s": round(moved / dt / 1e9, 2), "note": store.note}


def bench_slots(layout: ExpertLayout, experts: int) -> dict:
    local = {(layer, e): e for layer in layout.layers for e in range(experts)}
    out = {}
    with ExpertReader(layout) as reader:
        store = SsdStore(layout, local, reader, n_slots=experts * len(layout.layers))
        for phase in ("cold", "warm"):
            t0, n = time.perf_counter(), 0
            for layer in layout.layers:
                for i in range(0, experts, 6):
                    ids = np.arange(i, min(i + 6, experts))
                    parts = store.fetch(layer, ids, np.ones(len(ids), bool))
                    n += sum(p.nbytes for p in parts)
            dt = time.perf_counter() - t0
            out[phase] = {"bytes": n, "seconds": round(dt, 3), "gb_per_s": round(n / dt / 1e9, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default="/tmp/jds41_bench_experts.bin")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    t0 = time.perf_counter()
    layout = make_file(args.file, args.layers, args.experts)
    made = time.perf_counter() - t0
    result = {
        "experiment": "bench_tiers", "issue": 4,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": f"{platform.node()} {jax.devices()[0].device_kind} x{jax.device_count()}, {os.cpu_count()} cores",
        "jax": jax.__version__, "backend": jax.default_backend(),
        "expert_bytes": layout.expert_nbytes(0), "layers": args.layers, "experts_per_layer": args.experts,
        "file_gb": round(os.path.getsize(args.file) / 1e9, 2), "file_write_s": round(made, 1),
        "ssd": bench_ssd(layout, args.experts), "host": bench_host(layout, args.experts, args.steps),
        "slot_cache": bench_slots(layout, args.experts),
        "raw_reference": {"ssd_gb_per_s": 1.9, "host_in_jit_gb_per_s": 48, "host_whole_array_gb_per_s": 55},
    }
    result["ratio_to_raw"] = {"ssd": round(result["ssd"]["gb_per_s"] / 1.9, 3),
                              "host": round(result["host"]["gb_per_s"] / 48, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
