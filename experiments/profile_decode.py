"""Where a decode token's device time goes (issue #5, item 4): an XLA profile of the device loop, summed per kernel
and per model part. One JSON line.

    python experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 --decode 64 \
        --hlo-dump /tmp/hlo --out results/profile_decode_v4_8L_h200.jsonl

What it does: writes (or reuses) bench_decode's synthetic file with its routing skew, opens it under `--profile`
(plain = the model's own stacks), feeds a `--prompt`-token prompt, compiles and warms the device loop
(`decode_loop.decode_forced`), then runs `--decode` steps of it under `jax.profiler` and reads the Perfetto trace
back: every kernel and copy the device ran, grouped by name, with how many ran per token and their time per token;
the union of their intervals (device busy time) against the wall time of the loop, whose difference is time the
device sat idle (launch gaps, host round trips, host callbacks); and one middle token's kernels in order with the
idle time before each (`one_token`), which says where that idle time sits.

With `--hlo-dump DIR`, XLA writes the optimized HLO of the decode loop there (set before jax starts), and each
kernel is attributed to the model part its fusion came from: model.step's scope (engram, attn, ffn, head) and the
jds41 module it was traced in (mhc, attention, moe, ... or quant/...), read off the fusion's op_name and stack-frame
metadata. A kernel whose name matches no instruction (a copy, a cuBLAS call) is attributed by its name.

The trace and timings are only meaningful on the GPU; on CPU this checks the code path (the trace then holds the
host threads' work, and 'device' means XLA:CPU's thread pool).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import json
import os
import re
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _set_dump(dump_dir: str | None) -> None:
    """Ask XLA to dump the decode loop's optimized HLO (must run before jax is imported)."""
    if dump_dir:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text "
                                   "--xla_dump_hlo_module_re=.*_loop.*").strip()


# ---- the trace -------------------------------------------------------------------------------------------------


def device_events(trace: dict) -> tuple[list[dict], str]:
    """The complete ('X') events of the device's streams: (events, which process they came from). On a GPU that is
    the `/device:GPU:0` process; on CPU (a code-path check only) XLA's CPU client threads stand in for it."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [pid for pid, n in names.items() if "/device:GPU" in n]
    if gpu:
        pids = set(gpu[:1])
        ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] in pids]
        return ev, names[gpu[0]]
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e.get("ph") == "M"
               and e.get("name") == "thread_name" and "XLA" in e["args"].get("name", "")}
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e.get("tid")) in threads]
    return ev, "cpu threads"


def busy_us(events: list[dict]) -> float:
    """Length of the union of the events' intervals (us): time at least one kernel or copy was running."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    total, end = 0.0, -1.0
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kernel_table(events: list[dict], tokens: int) -> list[dict]:
    """Per kernel name: launches per token, us per token, mean us per launch; largest first."""
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        a = acc[e["name"]]
        a[0] += 1
        a[1] += float(e.get("dur", 0))
    rows = [{"name": n, "per_token": round(c / tokens, 2), "us_per_token": round(t / tokens, 2),
             "mean_us": round(t / c, 2)} for n, (c, t) in acc.items()]
    return sorted(rows, key=lambda r: -r["us_per_token"])


def one_token(events: list[dict], tokens: int, sources: dict | None = None) -> dict | None:
    """One middle token's kernels in launch order, each with the idle time before it, and the gap before the next
    token's marker: where a token's idle time sits (one long host round trip at the loop's edge, or a short gap
    before every kernel). A token runs from one launch of the marker (the longest kernel that runs exactly once a
    token: the output head) to the next. None when no kernel runs once a token."""
    once = [r for r in kernel_table(events, tokens) if r["per_token"] == 1.0]
    if not once:
        return None
    marker = max(once, key=lambda r: r["mean_us"])["name"]
    ordered = sorted(events, key=lambda e: float(e["ts"]))
    at = [i for i, e in enumerate(ordered) if e["name"] == marker]
    if len(at) < 2:
        return None
    mid = len(at) // 2 - 1
    window = ordered[at[mid]:at[mid + 1]]
    sequence, end, gaps = [], float(window[0]["ts"]), []
    for e in window:
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        gap = max(0.0, ts - end)
        end = max(end, ts + dur)
        src = (sources or {}).get(e["name"])
        sequence.append([e["name"], round(dur, 2), round(gap, 2), src[1] if src else ""])
        gaps.append((gap, e["name"]))
    nxt = float(ordered[at[mid + 1]]["ts"])
    gaps.append((max(0.0, nxt - end), f"{marker} (next token)"))
    span = nxt - float(window[0]["ts"])
    total_gap = sum(g for g, _ in gaps)
    return {"marker": marker, "kernels": len(window), "span_us": round(span, 1),
            "gap_us": round(total_gap, 1), "gaps_over_5us": [[round(g, 1), n] for g, n in gaps if g > 5],
            "sequence": sequence}


# ---- attribution from the optimized HLO ------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\b(?:fusion|custom-call|copy|while|conditional)\(")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
SCOPES = ("engram", "attn", "ffn", "head")  # jax.named_scope names model.step gives its parts
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')
_FIELDS = re.compile(r"(\w+)=(\d+)")


def _frames(text: str):
    """The HLO module's stack-frame tables: frame id -> (file, function, line, parent frame id)."""
    tables: dict[str, dict[int, object]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = _TABLE_ROW.match(line) if current is not None else None
        if not m:
            current = None
            continue
        current[int(m.group(1))] = m.group(2) if m.group(2) is not None else dict(
            (k, int(v)) for k, v in _FIELDS.findall(m.group(3)))
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs, frames = tables.get("FileLocations", {}), tables.get("StackFrames", {})
    out = {}
    for fid, fr in frames.items():
        loc = locs.get(fr["file_location_id"], {})
        out[fid] = (files.get(loc.get("file_name_id"), "?"), funcs.get(loc.get("function_name_id"), "?"),
                    loc.get("line", 0), fr.get("parent_frame_id", 0))
    return out


def _where(frames: dict, fid: int) -> tuple[str, str] | None:
    """(innermost jds41 frame, innermost frame in a model part: jds41/layers/*, model.py or tiers/*), each as
    'path:line function' relative to the package."""
    inner = part = None
    seen = set()
    while fid in frames and fid not in seen:
        seen.add(fid)
        file, func, line, parent = frames[fid]
        if "jds41/" in file:
            rel = file.split("jds41/", 1)[-1]
            here = f"{rel}:{line} {func}"
            inner = inner or here
            if part is None and (rel.startswith(("layers/", "tiers/")) or rel == "model.py"):
                part = here
        if parent == fid:
            break
        fid = parent
    return (inner, part or inner) if inner else None


def hlo_sources(dump_dir: str) -> dict[str, tuple[str, str, str]]:
    """Kernel name -> (innermost jds41 source, model-part source, model.step scope) of the fusion or custom call it
    runs, read from the after-optimizations HLO text XLA dumped (stack-frame tables, op_name scopes). Kernel names
    are instruction names, on the GPU with '.' written '_'; both spellings are keys."""
    out: dict[str, tuple[str, str, str]] = {}
    for path in glob.glob(os.path.join(dump_dir, "*_loop*after_optimizations.txt")):
        with open(path) as fh:
            text = fh.read()
        frames = _frames(text)
        for line in text.splitlines():
            m = _INSTR.match(line)
            f = _FRAME.search(line) if m else None
            where = _where(frames, int(f.group(1))) if f else None
            if where:
                op = _OP_NAME.search(line)
                scope = next((p for p in reversed(op.group(1).split("/")) if p in SCOPES), "") if op else ""
                out[m.group(1)] = out[m.group(1).replace(".", "_").replace("-", "_")] = (*where, scope)
    return out


# Pallas kernels by the name their pallas_call gives them -> the module that owns them
NAMED_KERNELS = {"router_top_k": "layers/topk_kernel.py", "mhc_sinkhorn": "layers/sinkhorn_kernel.py",
                 "attend_one_pass": "layers/attention_kernel.py",
                 "round_int8": "quant/int8_round_kernel.py"}


def part_of(name: str, sources: dict[str, str]) -> str:
    """The model part a kernel belongs to: its source module (e.g. 'layers/mhc.py'), or a class by name."""
    src = sources.get(name)
    if src:
        return "/".join(p for p in (src[2], src[1].split(":", 1)[0]) if p)
    named = next((m for k, m in NAMED_KERNELS.items() if name.startswith(k)), None)
    if named:
        return named
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "copies"
    if "matvec" in low or "triton" in low:
        return "quant/triton_matvec.py"
    if "gemv" in low or "gemm" in low or "cublas" in low or "sm90" in low:
        return "cublas"
    return "unattributed"


def summarize(events: list[dict], tokens: int, wall_s: float, sources: dict[str, str]) -> dict:
    table = kernel_table(events, tokens)
    parts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in table:
        r["part"] = part_of(r["name"], sources)
        if r["name"] in sources:
            r["source"], r["in"], _ = sources[r["name"]]
        parts[r["part"]][0] += r["per_token"]
        parts[r["part"]][1] += r["us_per_token"]
    busy = busy_us(events) / tokens
    wall = 1e6 * wall_s / tokens
    return {"wall_us_per_token": round(wall, 1), "device_busy_us_per_token": round(busy, 1),
            "device_idle_us_per_token": round(wall - busy, 1),
            "kernels_per_token": round(sum(r["per_token"] for r in table), 1),
            "kernel_us_per_token": round(sum(r["us_per_token"] for r in table), 1),
            "parts": {k: {"kernels_per_token": round(v[0], 1), "us_per_token": round(v[1], 1)}
                      for k, v in sorted(parts.items(), key=lambda kv: -kv[1][1])},
            "top_kernels": table[:40]}


# ---- the run ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="deepseek4", choices=("deepseek4", "deepseek41"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="mxfp4")
    ap.add_argument("--size", default="full")
    ap.add_argument("--profile", default="plain", help="a bench_decode profile name (plain = model's own stacks)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--skew-top10", type=float, default=0.45)
    ap.add_argument("--usage-tokens", type=int, default=512, help="only for tiered profiles")
    ap.add_argument("--engram-rows", type=int, default=2_000_000)
    ap.add_argument("--workdir", default="/tmp/jds41-bench")
    ap.add_argument("--trace-dir", default=None, help="where jax.profiler writes (default: under --workdir)")
    ap.add_argument("--hlo-dump", default=None, help="dump the loop's optimized HLO here and attribute kernels")
    ap.add_argument("--numerics", default="jds41", help="the Engine's numerics (jds41, int8: jds41/engine.py)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    _set_dump(a.hlo_dump)

    import jax
    import numpy as np

    sys.path.insert(0, _HERE)
    import bench_decode as B

    from jds41.checkpoints import presets
    from jds41.decode_loop import decode_forced
    from jds41.engine import Engine

    os.makedirs(a.workdir, exist_ok=True)
    cfg = (B.model_config(a.arch, a.layers, a.engram_rows) if a.size == "full"
           else presets.preset(a.arch, a.size, a.layers))
    path = os.path.join(a.workdir, f"{a.arch}-{a.size}-{a.layers}L-{a.quant}.gguf")
    write_s = B.write_file(path, cfg, a.quant)
    if write_s and a.skew_top10 > 0:  # a freshly written file gets bench_decode's routing skew
        B.set_skew(path, a.skew_top10)
    usage = None
    if a.profile != "plain":
        usage = path + ".usage.json"
        if not os.path.exists(usage):
            B.measure_usage(path, usage, a.usage_tokens)
    prof = B.profile_json(a.profile, a.arch, a.quant, a.workdir)
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt)]
    stream = [int(t) for t in rng.integers(0, cfg.vocab_size, a.decode + 1)]
    # Three streams of one length: the warm-up (compiles), the unprofiled run, the profiled run. Each is new to
    # the caches the runs before it filled (slot cache, Engram rows), as in bench_decode.
    warm_prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt)]
    warm_stream, plain_stream = ([int(t) for t in rng.integers(0, cfg.vocab_size, a.decode + 1)] for _ in range(2))
    engine = Engine.open(path, max_ctx=2 * (a.prompt + a.decode) + 64, profile=prof,
                         usage=usage if prof is not None else None, numerics=a.numerics)
    B.log("warming up (compiles the device loop)")
    warm = engine.session()
    warm.feed(warm_prompt)
    decode_forced(warm, warm_stream)
    t0 = time.perf_counter()
    decode_forced(warm, plain_stream)  # a second, compile-free run: the unprofiled figure
    plain_s = time.perf_counter() - t0
    del warm

    s = engine.session()
    s.feed(prompt)
    trace_dir = a.trace_dir or os.path.join(a.workdir, "trace")
    jax.block_until_ready(s.state)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    preds = decode_forced(s, stream)
    wall_s = time.perf_counter() - t0
    jax.profiler.stop_trace()
    traces = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    with gzip.open(traces[-1]) as fh:
        trace = json.load(fh)
    events, source = device_events(trace)
    sources = hlo_sources(a.hlo_dump) if a.hlo_dump else {}
    tokens = len(stream) - 1
    row = {"bench": "profile_decode", "commit": B._commit(), "machine": B._machine(), "command": " ".join(sys.argv),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "triton_kernels": B.triton_kernels_on(),
           "planar_weights": B.planar_weights_on(), "q2k_kernel": B.q2k_kernel_on(), **B.kernel_ab(),
           "arch": a.arch, "size": a.size, "layers": a.layers, "quant": a.quant, "profile": a.profile,
           "numerics": a.numerics,
           "decode_tokens": tokens, "unprofiled_tok_s": round(tokens / plain_s, 2),
           "profiled_tok_s": round(tokens / wall_s, 2), "events_from": source,
           "predictions_sha256": hashlib.sha256(np.asarray(preds, np.int32).tobytes()).hexdigest()[:16],
           **summarize(events, tokens, wall_s, sources), "one_token": one_token(events, tokens, sources)}
    B.emit(row, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
