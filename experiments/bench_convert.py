"""Conversion throughput and restore time: GGUF -> Orbax checkpoint (jds41.checkpoints.convert), then time to ready
from each form.

1. writes a synthetic file (`python -m jds41.checkpoints.synth`, real names/shapes/quant types at `--size`);
2. converts it in a subprocess (`python -m jds41.checkpoints.convert ... --json`): seconds, GB/s of source bytes,
   the child's peak RSS (the converter streams: it should stay near its piece size, not the model size);
3. per form, in a fresh subprocess each (so neither warms the other's process): `Engine.open` seconds (time to
   ready: host buffers of every resident tensor, the engine's own path) and the first token after it (device
   transfer and compile included), plus the dense tensors brought to device memory (and pinned host) the direct
   way: GGUF = O_DIRECT load + device_put, Orbax = restore straight into the sharding.
`--drop-caches` tries `/proc/sys/vm/drop_caches` before each timed open (root only; the JSON says if it worked),
otherwise the second read of a file may come from the page cache.

Ends with one JSON line (commit, machine, command); with $OUT set it is also written to $OUT/bench_convert.json.
CPU timings are resource checks only, never speed figures (experiments/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERT_SCRIPT = r"""
import json, logging, resource, sys
logging.getLogger("absl").setLevel(logging.ERROR)
from jds41.checkpoints.convert import convert
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
summary = convert(sys.argv[1], sys.argv[2], piece_bytes=int(sys.argv[3]), progress=False)
summary["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
summary["rss_after_imports_mib"] = round(base / 1024, 1)
print(json.dumps(summary))
"""

OPEN_SCRIPT = r"""
import json, logging, sys, time
logging.getLogger("absl").setLevel(logging.ERROR)
import jax, numpy as np
path, want_profile = sys.argv[1], sys.argv[2] or None
t0 = time.perf_counter()
from jds41.engine import Engine
engine = Engine.open(path, profile=want_profile)
opened = time.perf_counter() - t0
engine.session().feed([1])
first = time.perf_counter() - t0
from jds41.checkpoints import model_tensors
from jds41.checkpoints.schema import Kind
model = engine.gguf
dense = [n for n, s in model_tensors(model.config).items()
         if s.kind is not Kind.ROWS and not n.endswith("_exps.weight")]
nbytes = sum(model.tensors[n].n_bytes for n in dense)
out = {"open_s": round(opened, 3), "first_token_s": round(first, 3), "load": engine.load_stats,
       "dense_bytes": nbytes}
dev = jax.devices()[0]
kinds = {m.kind for m in dev.addressable_memories()}
for kind in ("device", "pinned_host"):
    if kind not in kinds:
        continue
    t = time.perf_counter()
    if hasattr(model, "restore"):
        arrays = model.restore(dense, memory_kind=kind, verify=False)
    else:
        from jds41.tiers.loader import load_tensors
        sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
        arrays = load_tensors(model, dense, progress=False, sharding=sharding).arrays
    jax.block_until_ready(list(arrays.values()))
    dt = time.perf_counter() - t
    out[f"dense_to_{kind}"] = {"seconds": round(dt, 3), "gb_per_s": round(nbytes / dt / 1e9, 3)}
    del arrays
if engine.tiers is not None:
    engine.tiers.close()
print(json.dumps(out))
"""


def _run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return proc, time.perf_counter() - t0


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="deepseek41", choices=["deepseek4", "deepseek41"])
    ap.add_argument("--size", default="full")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quant", default="ds4-q2")
    ap.add_argument("--engram-rows", type=int, default=1 << 20, help="rows per Engram table (the full ones are huge)")
    ap.add_argument("--workdir", default="/tmp/jds41_bench_convert")
    ap.add_argument("--piece-mib", type=int, default=256)
    ap.add_argument("--profile", default="", help="also open with this tier profile (e.g. h200)")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the files (default: delete them at the end)")
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, f"{args.arch}-{args.size}-{args.layers}.gguf")
    dst = os.path.join(args.workdir, f"{args.arch}-{args.size}-{args.layers}.orbax")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(dst + ".partial", ignore_errors=True)
    synth_cmd = [sys.executable, "-m", "jds41.checkpoints.synth", "--arch", args.arch, "--size", args.size,
                 "--layers", str(args.layers), "--quant", args.quant, "--out", src, "--quiet"]
    if args.engram_rows and args.arch == "deepseek41":
        synth_cmd += ["--engram-rows", str(args.engram_rows)]
    _, synth_s = _run(synth_cmd)

    dropped = _drop_caches() if args.drop_caches else None
    proc, convert_s = _run([sys.executable, "-c", CONVERT_SCRIPT, src, dst, str(args.piece_mib << 20)])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    src_bytes = _size(src)
    _, verify_s = _run([sys.executable, "-m", "jds41.checkpoints.convert", "--verify", dst, "--quiet", "--json"])

    opens = {}
    for form, path in (("gguf", src), ("orbax", dst)):
        for profile in dict.fromkeys(["", args.profile]):
            if args.drop_caches:
                _drop_caches()
            p, _ = _run([sys.executable, "-c", OPEN_SCRIPT, path, profile])
            opens[f"{form}{'+' + profile if profile else ''}"] = json.loads(p.stdout.strip().splitlines()[-1])

    import jax

    result = {
        "experiment": "bench_convert", "issue": 9,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "machine": f"{platform.node()} {jax.devices()[0].device_kind} x{jax.device_count()}, {os.cpu_count()} cores",
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "model": {"arch": args.arch, "size": args.size, "layers": args.layers, "quant": args.quant,
                  "gguf_bytes": src_bytes, "orbax_bytes": _size(dst), "synth_s": round(synth_s, 1)},
        "convert": {"wall_s": round(convert_s, 3), "gb_per_s": round(src_bytes / convert_s / 1e9, 3),
                    "inner": summary, "piece_mib": args.piece_mib},
        "verify_s": round(verify_s, 3), "drop_caches": dropped,
        "open": opens,
    }
    if "orbax" in opens and "gguf" in opens:
        result["orbax_over_gguf_open"] = round(opens["orbax"]["open_s"] / max(opens["gguf"]["open_s"], 1e-9), 3)
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_convert.json"), "w") as f:
            f.write(line + "\n")
    if not args.keep:
        os.remove(src)
        shutil.rmtree(dst, ignore_errors=True)


if __name__ == "__main__":
    main()
