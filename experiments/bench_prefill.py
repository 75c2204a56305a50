"""Prefill speed of the layer-major chunked prefill (issue #10, item 2), and time to first token of a later agent
turn with and without the prefix cache (item 4).

    python experiments/bench_prefill.py MODEL.gguf [--lengths 4096,20480,55296] [--profiles all-hbm,lucebox,h200]
        [--chunk 4096] [--turn 20000,200] [--out FILE.jsonl]

For each profile (all-hbm = every weight resident, no tier machinery), engine decode width (--decode-widths; the
prompt is read at that width, jds41/prompt_pieces.py) and prompt length: one warm-up feed that compiles every
piece the length uses, then one timed feed of a fresh random prompt. Each run prints one JSON line (and appends
it to --out, default $OUT/bench_prefill.jsonl when $OUT is set):
- tok_s: prompt tokens / wall seconds of Session.feed (compilation excluded);
- bytes per prompt token moved into the GPU by the layer-major groups (at width W with tiered experts: layer-major
  groups of W-row blocks), per link: host (pinned host -> device) and
  ssd (the SSD experts each group asked for; slot-cache misses are `ssd_read` from the store's own counter),
  next to what the token-major scan would move for the same routing (from the routing trace, prefill.moved_bytes);
- hbm bytes per token: the per-token arithmetic reads every dense weight and the token's K experts per layer (the
  layer-major pass keeps decode's per-token matvecs, which is what makes it bit-identical), so HBM traffic per
  token is that of a decode step; with a prompt width R (--prompt-widths, the wide pass: grouped expert products)
  the dense weights count once per R-row block and each expert of a group's union once per group (the floor of
  the grouped products, which read an expert once per tile of R pairs);
- flops per token (2 per weight a token multiplies: dense matrices and its K experts) and the compute bound at the
  H200's 67 TFLOP/s of f32 (the wide pass multiplies in f32 at Precision.HIGHEST), reported beside the roofline;
- slot_cache_feed (an SSD tier): the slot cache's counters over the timed feed: host calls and their seconds, the
  part spent waiting for reads (stall_s) and copying answers out (copy_s), bytes read, and the reads the next-layer
  read-ahead started (set_ahead; --set-ahead on,off measures both on the same programs);
- engram_read (V4.1): host seconds of the timed feed's Engram row reads (one per piece; the first runs before any
  piece, the others while the piece before runs) and the rows the source read (the SSD source's own counter);
- roofline (DESIGN.md §8): tok/s no faster than 1 / max(bytes / bandwidth) over HBM 4.4 TB/s, PCIe 48 GB/s and
  SSD 1.9 GB/s (DESIGN.md §7), no slower than 1 / sum; and measured / roofline.
The agent turn (--turn PREFIX,NEW): a PREFIX-token conversation is read and snapshotted (prompt end); then
PREFIX + NEW tokens are fed in a fresh session, once resuming from the prefix cache and once re-reading
everything; TTFT is the wall time to the first token's logits.

CPU runs check the code path only (tests/test_bench_prefill.py): their timings are not speed figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit, _machine, planar_weights_on, triton_kernels_on  # noqa: E402  (sibling script)

from jds41 import prefill as PF  # noqa: E402
from jds41.engine import Engine  # noqa: E402
from jds41.prompt_pieces import prompt_pieces  # noqa: E402
from jds41.tiers.experts import HOST_STACK_AHEAD  # noqa: E402
from jds41.tiers.stores import ExpertLayout  # noqa: E402

BANDWIDTH = {"hbm": 4.4e12, "host": 48e9, "ssd": 1.9e9}  # bytes/s, DESIGN.md §7
# llama.cpp prefill on the 8-layer V4-Flash shape, DESIGN.md §7 (pp4096): experts in host memory / all on the GPU
LLAMACPP_8L = {"host_experts_tok_s": 158, "resident_tok_s": 5641}


F32_FLOPS = 67e12  # H200 SXM f32 (non-tensor) FLOP/s, NVIDIA's data sheet


def _dense(engine: Engine):
    """(name, tensor) of the weights every token multiplies: not the experts, not the embedding or Engram tables
    (a token reads one row of those)."""
    for name, t in engine.gguf.tensors.items():
        if not ("_exps." in name or name.endswith("engram_embd.weight") or name.startswith("token_embd")):
            yield name, t


def hbm_bytes_per_token(engine: Engine, union_bytes_per_token: float | None = None) -> int:
    """Bytes one token's arithmetic reads: every non-expert weight (the embedding: one row; Engram tables live on
    the host), plus K experts per routed layer. At decode width W a block of W rows reads the dense weights once,
    so they count 1/W per token; experts still count K per token (a block's union holds at most W*K). The wide
    pass (prompt width R): dense weights 1/R, experts `union_bytes_per_token` (each union expert once per group)."""
    g, cfg, plan = engine.gguf, engine.cfg, engine.plan
    rows = plan.prompt_width or plan.decode_width
    dense = sum(t.n_bytes for _, t in _dense(engine)) / rows + g.tensors["token_embd.weight"].row_bytes
    if union_bytes_per_token is not None:
        return round(dense + union_bytes_per_token)
    layout = ExpertLayout.from_model(g)
    return round(dense) + sum(cfg.n_experts_used * layout.expert_nbytes(layer) for layer in layout.layers)


def flops_per_token(engine: Engine) -> int:
    """2 per weight a token multiplies (dense matrices, its K experts per routed layer); attention scores left out."""
    cfg = engine.cfg
    dense = sum(int(np.prod(t.shape)) for _, t in _dense(engine))
    experts = sum(int(np.prod(t.shape)) // cfg.n_experts for name, t in engine.gguf.tensors.items()
                  if "_exps." in name)
    return 2 * (dense + cfg.n_experts_used * experts)


def union_bytes(engine: Engine, experts_TLK: np.ndarray) -> int:
    """Bytes of every distinct expert a group's tokens chose, over its routed layers: what grouped products read."""
    layout = ExpertLayout.from_model(engine.gguf)
    return sum(len(np.unique(experts_TLK[:, i])) * layout.expert_nbytes(layer)
               for i, layer in enumerate(layout.layers))


def roofline(per_token: dict) -> dict:
    times = {k: per_token.get(k, 0) / bw for k, bw in BANDWIDTH.items()}
    worst, total = max(times.values()), sum(times.values())
    return {"tok_s_overlapped": round(1 / worst, 1) if worst else None,
            "tok_s_serial": round(1 / total, 1) if total else None,
            "bound_by": max(times, key=times.get)}


def _traced(session) -> list:
    """Collect the routing trace of every model call of `session` (only recorded under a tier profile)."""
    traces = []
    record = session._record

    def keep(routing):
        if routing:
            traces.append(np.asarray(routing[0]["experts"]))
        record(routing)

    session._record = keep
    return traces


def _traces(engine: Engine) -> bool:
    """Whether a timed feed returns its routing: always with tiers; resident, for the wide pass's union bytes."""
    return engine.tiers is not None or engine.plan.prompt_width > 0


def warm_up(engine: Engine, *lengths: int, rng) -> float:
    """Compile every program feeds of these lengths run: each distinct piece fed once, as its own feed (a piece's
    length alone is cut into that piece), in one session: seconds."""
    plan = engine.plan
    distinct = {p for n in lengths for p in prompt_pieces(n, plan.decode_width, engine.prefill_chunk,
                                                          engine.tiers is not None, plan.prompt_width)}
    t0 = time.perf_counter()
    session = engine.session()
    session.trace_routing = _traces(engine)  # the same programs as the timed feed
    for _, m in sorted(distinct, key=lambda p: -p[1]):
        session.feed(rng.integers(8, engine.vocab_size, m).tolist())
    return time.perf_counter() - t0


def _moved(tiers, how: str, width: int, experts_TLK: np.ndarray) -> dict:
    """Bytes a piece moved per link, and what the token-major scan would move for the same routing: a layer-major
    group (at any width) moves its union once, a piece of W-row blocks read block after block each block's union,
    a scan or step every token's experts."""
    if how == "rows":
        blocks = [PF.moved_bytes(tiers, b) for b in experts_TLK.reshape(-1, width, *experts_TLK.shape[1:])]
        return {k: sum(b[k] for b in blocks) for k in blocks[0]}
    m = PF.moved_bytes(tiers, experts_TLK)
    group = how.startswith("layer-major") or how.startswith("wide")  # "wide", wide-tail and wide-rest: one union
    return m if group else {**m, "host": m["host_token_major"], "ssd": m["ssd_token_major"]}


class EngramReads:
    """Host time of the Engram row reads of one feed (`engine.engram_rows`, wrapped while in use): the first
    piece's read is always before any piece runs; later ones overlap the piece before, on the feed's read-ahead
    thread (Session._pieces)."""

    def __init__(self, engine: Engine):
        self.engine, self.seconds, self.calls, self.first_s = engine, 0.0, 0, None
        source = engine.engram[1] if engine.engram is not None else None
        self.source, self._rows0 = source, getattr(source, "rows_read", 0)

    def __enter__(self):
        read = self.engine.engram_rows

        def timed(new_tokens, history):
            t0 = time.perf_counter()
            rows = read(new_tokens, history)
            dt = time.perf_counter() - t0
            self.seconds, self.calls = self.seconds + dt, self.calls + 1
            self.first_s = dt if self.first_s is None else self.first_s
            return rows

        self.engine.engram_rows = timed
        return self

    def __exit__(self, *exc):
        del self.engine.engram_rows  # the instance attribute: the method shows through again

    def report(self, session) -> dict | None:
        """`wait_s`: how long the feed waited for the read-ahead thread's rows (Session.engram_wait_s): the part
        of the reads that did not overlap the pieces, besides the first piece's read (`first_read_s`)."""
        if self.source is None:
            return None
        return {"source": type(self.source).__name__, "calls": self.calls, "read_s": round(self.seconds, 4),
                "first_read_s": round(self.first_s or 0.0, 4), "wait_s": round(session.engram_wait_s, 4),
                "rows_read": getattr(self.source, "rows_read", 0) - self._rows0}


def prefill_run(engine: Engine, profile: str, n: int, chunk: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    width = engine.plan.decode_width
    cut = prompt_pieces(n, width, chunk, engine.tiers is not None, engine.plan.prompt_width)
    compile_s = warm_up(engine, n, rng=rng)
    tiers = engine.tiers
    ssd = tiers.stores.ssd if tiers is not None else None
    ssd_before = ssd.stats.bytes if ssd is not None else 0
    slots_before = ssd.stats.to_dict() if ssd is not None else None
    reader_before = tiers.reader.stats.to_dict() if tiers is not None else None
    session = engine.session()
    traces = _traced(session)
    session.trace_routing = _traces(engine)
    prompt = rng.integers(8, engine.vocab_size, n).tolist()
    with EngramReads(engine) as engram:
        t0 = time.perf_counter()
        session.feed(prompt)
        seconds = time.perf_counter() - t0
    moved = {"host": 0, "ssd": 0, "host_token_major": 0, "ssd_token_major": 0}
    if tiers is not None:
        for (how, _), experts in zip(cut, traces, strict=True):  # one trace per piece, in order
            m = _moved(tiers, how, width, experts)
            for k in moved:
                moved[k] += m[k]
    union = sum(union_bytes(engine, t) for t in traces) / n if engine.plan.prompt_width else None
    per_token = {"hbm": hbm_bytes_per_token(engine, union), "host": moved["host"] / n, "ssd": moved["ssd"] / n}
    roof = roofline(per_token)
    flops = flops_per_token(engine)
    tok_s = n / seconds
    kinds = {how: sum(m for h, m in cut if h == how) for how, _ in cut}  # tokens per kind of piece
    return {"kind": "prefill", "profile": profile, "prompt_tokens": n, "chunk": chunk, "decode_width": width,
            "prompt_width": engine.plan.prompt_width,
            "pieces": [m for how, m in cut if how not in ("scan", "step")], "tokens_by_piece": kinds,
            "seconds": round(seconds, 4), "tok_s": round(tok_s, 2),
            "compile_s": round(compile_s, 2),
            "bytes_per_token": {k: round(v) for k, v in per_token.items()},
            "token_major_bytes_per_token": {k: round(moved[k + "_token_major"] / n) for k in ("host", "ssd")},
            "ssd_read_bytes_per_token": round(((ssd.stats.bytes if ssd else 0) - ssd_before) / n),
            "roofline": roof, "flops_per_token": flops, "compute_bound_tok_s_f32": round(F32_FLOPS / flops, 1),
            "of_roofline": round(tok_s / roof["tok_s_overlapped"], 4) if roof["tok_s_overlapped"] else None,
            "vs_llamacpp_8l_host_experts": round(tok_s / LLAMACPP_8L["host_experts_tok_s"], 3),
            "tier_stats": tiers.stats() if tiers is not None else None, "device_peak_bytes": _device_peak_bytes(),
            "engram_read": engram.report(session), "slot_cache_feed": _delta(slots_before, ssd),
            "reader_feed": _reader_delta(reader_before, tiers, seconds),
            "whole_host_stack": any(b["routed"].host_whole for b in engine.params["blocks"] if "routed" in b),
            "host_stack_ahead": HOST_STACK_AHEAD}


def _counted(before: dict, now: dict, keys) -> dict:
    """What `keys` of a stats snapshot counted between `before` and `now` (floats rounded to 0.1 ms)."""
    return {k: round(now[k] - before[k], 4) if isinstance(now[k], float) else now[k] - before[k] for k in keys}


def _delta(before: dict | None, ssd) -> dict | None:
    """The SSD slot cache's counters over the timed feed alone (tier_stats counts since the engine opened, the
    warm-up included): how long its host calls took, how much of that was waiting for reads (stall) and copying
    answers out, and how many of its reads the next-layer read-ahead started."""
    if before is None:
        return None
    return _counted(before, ssd.stats.to_dict(), ("host_calls", "host_call_s", "stall_s", "copy_s", "bytes",
                                                  "misses", "prefetches", "set_ahead", "prefetch_used"))


def _reader_delta(before: dict | None, tiers, seconds: float) -> dict | None:
    """The O_DIRECT reader pool over the timed feed: bytes read and the seconds its threads spent in reads. Their
    ratio is the rate the SSD gave while reading; bytes over the feed's wall time, the rate it was used at; read_s
    over the wall time, how many reads were in flight on average (8 threads: at most 8)."""
    if before is None:
        return None
    fed = _counted(before, tiers.reader.stats.to_dict(), ("bytes_read", "chunks", "read_s"))
    moved, busy = fed["bytes_read"], fed["read_s"]
    return {"bytes": moved, "chunks": fed["chunks"], "read_s": busy,
            "gb_s_while_reading": round(moved / busy / 1e9, 3) if busy else None,
            "gb_s_over_feed": round(moved / seconds / 1e9, 3), "reads_in_flight": round(busy / seconds, 2)}


def _device_peak_bytes() -> int | None:
    """The device allocator's peak since the process started (every run before this one included); None where the
    backend keeps no such count (CPU)."""
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def turn_run(engine: Engine, profile: str, prefix: int, new: int, seed: int) -> dict:
    """TTFT of a later agent turn: resume from the cached conversation vs re-read all of it."""
    rng = np.random.default_rng(seed)
    conversation = rng.integers(8, engine.vocab_size, prefix).tolist()
    turn = conversation + rng.integers(8, engine.vocab_size, new).tolist()
    cache = engine.prefix_cache
    # Every piece the three reads below run (the conversation's, the new tokens' after a resume, the re-read's)
    # compiles first, so the first read is a compile-free prefill of PREFIX tokens, reported as such.
    warm_up(engine, prefix, new, prefix + new, rng=rng)
    first = engine.session()
    t0 = time.perf_counter()
    end = first.feed_prompt(conversation)  # turn 1 read
    read_s = time.perf_counter() - t0
    first.save_prefix(end)  # snapshotted at its end
    t0 = time.perf_counter()
    resumed = engine.session()
    resumed.feed_prompt(turn)
    cached_s = time.perf_counter() - t0
    engine.prefix_cache = None
    t0 = time.perf_counter()
    engine.session().feed(turn)
    full_s = time.perf_counter() - t0
    engine.prefix_cache = cache
    return {"kind": "agent_turn", "profile": profile, "prompt_width": engine.plan.prompt_width,
            "prefix_tokens": prefix, "new_tokens": new,
            "conversation_read_s": round(read_s, 4), "conversation_tok_s": round(prefix / read_s, 2),
            "cached_tokens": resumed.cached_tokens, "ttft_cached_s": round(cached_s, 4),
            "ttft_full_s": round(full_s, 4), "speedup": round(full_s / cached_s, 2),
            "snapshot_bytes": cache.nbytes, "prefix_cache": vars(cache.stats)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", default="4096,20480,55296", help="prompt lengths (comma separated)")
    ap.add_argument("--profiles", default="all-hbm,lucebox,h200")
    ap.add_argument("--chunk", type=int, default=4096, help="layer-major group size (at width W: whole W-row blocks)")
    ap.add_argument("--decode-widths", default="1", help="comma separated engine decode widths: the prompt is read "
                    "at the width the engine decodes at (jds41/prompt_pieces.py)")
    ap.add_argument("--prompt-widths", default="0", help="comma separated prompt widths R (0: the decode width; "
                    "R >= 2: the wide pass, grouped expert products, ModelPlan.prompt_width)")
    ap.add_argument("--turn", default="20000,200", help="PREFIX,NEW of the agent-turn TTFT ('' to skip)")
    ap.add_argument("--ctx", type=int, default=None, help="context (default: the longest prompt + 256)")
    ap.add_argument("--cache-bytes", type=int, default=32 << 30, help="prefix cache budget for the turn")
    ap.add_argument("--set-ahead", default="on", help="on, off or on,off: a prefill group's next-layer SSD "
                    "read-ahead (SsdStore.read_ahead); each value runs every length on the same programs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "bench_prefill.jsonl")
                    if os.environ.get("OUT") else None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    turn = [int(x) for x in args.turn.split(",")] if args.turn else None
    ctx = args.ctx or max(lengths + ([sum(turn)] if turn else [])) + 256
    import jax

    meta = {"model": os.path.basename(args.model), "commit": _commit(), "machine": _machine(),
            "triton_kernels": triton_kernels_on(), "planar_weights": planar_weights_on(),
            "device": str(jax.devices()[0]),
            "host": platform.node(), "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])])}
    results = []
    for profile, width, prompt_width in [(p, int(w), int(r)) for p in args.profiles.split(",")
                                         for w in args.decode_widths.split(",") for r in args.prompt_widths.split(",")]:
        engine = Engine.open(args.model, max_ctx=ctx, profile=None if profile == "all-hbm" else profile,
                             prefill_chunk=args.chunk, prefix_cache_bytes=args.cache_bytes, decode_width=width,
                             prompt_width=prompt_width)
        # Each row is written as soon as it is measured: a device call that runs out of time keeps what finished.
        ssd = engine.tiers.stores.ssd if engine.tiers is not None else None
        runs = [(ahead, functools.partial(prefill_run, engine, profile, n, args.chunk, args.seed + i))
                for ahead in args.set_ahead.split(",") for i, n in enumerate(lengths)]
        if turn:
            runs.append(("on", functools.partial(turn_run, engine, profile, turn[0], turn[1], args.seed + 100)))
        for ahead, run in runs:
            if ssd is not None:
                ssd.set_ahead = ahead == "on"
            r = {**run(), **meta, "max_ctx": ctx, "load_s": round(engine.load_seconds, 2),
                 "ssd_set_ahead": ahead == "on" if ssd is not None else None}
            line = json.dumps(r)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
            results.append(r)
        if engine.tiers is not None:
            engine.tiers.close()
    return results


if __name__ == "__main__":
    main()
