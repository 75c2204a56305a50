"""Decode and 4K-prompt prefill speed of jds41 on full-size synthetic files, per tier profile, beside the roofline
(issue #5; DESIGN.md §7, §8). One JSON line per run.

    python experiments/bench_decode.py --arch deepseek41 --layers 6 --quant ds4-q2 \
        --profiles plain,all-hbm,lucebox,h200 --out results.jsonl

What it does, in order:
1. Writes `--size full --layers N` (synth `--fast`: real names, shapes, types and layout; experts cycle a pool of
   random experts, which costs nothing in speed) unless the file exists. V4.1's Engram tables are shrunk to
   `--engram-rows` rows per layer (the full 384M-row tables need 189 GiB); rows per token are the real count.
2. Routing skew: random weights route almost uniformly, real models do not. The router's selection bias
   (`exp_probs_b`, selection only: weights still come from the unbiased scores) is set to -g*ln(1+rank) over a
   random expert ranking per layer, with g fitted (numpy simulation of sqrt-softplus scores) so the top 10% of
   experts take `--skew-top10` of the selections: a Zipf-like fit, reported as such with the share measured on
   the model itself (a trained model's measured skew replaces this once issue #7 lands).
3. Usage: the all-resident model profiles `--usage-tokens` random tokens (tiers/profile.py's traced prefill) into a
   usage.json that ranks experts for the profiles' placement.
4. Per profile: time to ready (Engine.open), prefill of a `--prompt`-token prompt (tok/s), then `--decode` decode
   steps over a fixed random token stream in the device loop (decode_loop.decode_forced: one compiled while_loop,
   warmed up first), with tier hit rates and bytes per token for those steps.
5. Roofline (DESIGN.md §8): bytes per decode token on each resource -- HBM: dense weights (one embedding row),
   HBM-tier experts, the decode state; PCIe: host-tier and SSD-tier experts (the SSD tier's rows reach the graph
   through host memory) and Engram rows not in HBM; SSD: slot-cache misses and Engram rows read -- over the box's
   measured bandwidths; roofline tok/s = 1 / max(time per resource) (perfect overlap), the no-overlap bound beside.
   `ratio` = measured / roofline. On a GPU the row also carries that GPU's own measured HBM read bandwidth and the
   roofline and ratio with it (`device_hbm_read_bps`, `roofline_device_hbm_tok_s`, `ratio_device_hbm`).

Profiles (`NAME+all` / `NAME+selected`: the same with that `host_fetch`):
`plain` (no profile: the model's own stacks, the reference path of #3), shipped names (`all-hbm`,
`lucebox`, `ssd-heavy`), `h200` (the shipped profile's budgets resolved for the FULL model of this architecture and
applied as fractions, so an N-layer file gets the full model's split), `all-host` (every routed expert in pinned host
memory, the analogue of llama.cpp's `-ot exps=CPU`), or a JSON path. Timings on the 2-core CPU machines check the
code path only; they are not speed figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

# Bandwidths of the reference box (DESIGN.md §7): HBM read, pinned-host rows gathered inside jit, O_DIRECT SSD.
BW = {"hbm": 4.4e12, "pcie": 48e9, "ssd": 1.9e9}
H200_HBM, H200_HOST = 149_250_113_536, 128 << 30  # bytes, DESIGN.md §7


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr with the time since start: a run cut short by a time limit still says where it was."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def emit(row: dict, out: str | None) -> None:
    """One result as one JSON line: printed, and appended to `out` when given."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")


def _commit() -> str:
    """The commit the run used: $JDS41_COMMIT when the launcher sets it (the device box's copy of the tree carried
    stale git metadata on 2026-11-30: its `git rev-parse HEAD` named the session's first commit), else git's."""
    if os.environ.get("JDS41_COMMIT"):
        return os.environ["JDS41_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "unknown"


def triton_kernels_on() -> bool:
    """Whether decode's one-token products run as the Triton kernels on CUDA (JDS41_TRITON, quant/triton_matvec)."""
    from jds41.quant import triton_matvec

    return triton_matvec.ENABLED


def planar_weights_on() -> bool:
    """Whether resident Q8_0 / MXFP4 weights are regrouped into planar rows for those kernels (JDS41_PLANAR)."""
    from jds41.quant import triton_matvec

    return triton_matvec.planar_weights()


def q2k_kernel_on() -> bool:
    """Whether V4.1's Q2_K products go through the kernel (JDS41_Q2K_KERNEL, quant/triton_matvec.py)."""
    from jds41.quant import triton_matvec

    return triton_matvec.Q2K_KERNEL


def kernel_ab() -> dict:
    """The kernel's load-ahead formats, row splits and how many measured tiles it takes (JDS41_PREFETCH, JDS41_SPLITS,
    JDS41_MEASURED_TILES: quant/triton_matvec.py), whether Q2_K stacks are regrouped (JDS41_PLANAR_Q2K:
    quant/planar.py), the formats the "int8" numerics rounds for, its Q8_0 and Q2_K steps
    (JDS41_INT8_Q8_0, JDS41_INT8_Q8_0_FORM, JDS41_INT8_Q2_K_FORM: quant/int8_act.py, quant/triton_int8.py),
    whether its rounding is one Triton launch (JDS41_INT8_ROUND_KERNEL: quant/int8_round_kernel.py), whether a gate
    and an up product share a launch (JDS41_SHARED_LAUNCH: quant/qtensor.py), whether the router's top-K is the
    Triton program (JDS41_TOPK_KERNEL: layers/topk_kernel.py), whether attention is (JDS41_ATTN_KERNEL:
    layers/attention_kernel.py) and whether V4.1's and V4's sublayer inputs are (JDS41_MHC_KERNEL,
    JDS41_MHC_KERNEL_V4: layers/mhc_input_kernel.py) and whether the shared expert and the latent run on a second
    stream, and by which form of compute_on (JDS41_SIDE_STREAM: layers/side_stream.py), whether the routed and
    shared experts' products share launches (JDS41_CO_LAUNCH: quant/co_launch.py) and an attention sublayer's
    products of its input (JDS41_CO_LAUNCH_ATTENTION, there too), whether a compressor's sequential part is one
    launch (JDS41_COMPRESSOR_KERNEL: layers/compressor_kernel.py) and the attention's softmax (JDS41_SOFTMAX_KERNEL:
    layers/sink_softmax_kernel.py) and the router's selection (JDS41_ROUTE_KERNEL: layers/topk_kernel.py), whether an
    FFN's hidden activations are one launch (JDS41_SWIGLU_KERNEL: quant/swiglu_kernel.py) and its input's int8 blocks
    come from the launch writing it (JDS41_MHC_ROUND: layers/mhc_input_kernel.py), and the tiles JDS41_TILES set
    (quant/triton_matvec.py)."""
    from gguf import GGMLQuantizationType as T

    from jds41.layers import (
        attention_kernel,
        compressor_kernel,
        mhc_input_kernel,
        side_stream,
        sink_softmax_kernel,
        topk_kernel,
    )
    from jds41.quant import (
        co_launch,
        int8_act,
        int8_round_kernel,
        planar,
        qtensor,
        swiglu_kernel,
        triton_int8,
        triton_matvec,
    )

    return {"kernel_prefetch": sorted(t.name for t in triton_matvec.PREFETCH),
            "kernel_splits": {t.name: v for t, v in triton_matvec.SPLITS.items()},
            "measured_tiles": len(triton_matvec.MEASURED_TILES), "planar_q2k": planar.regrouped(T.Q2_K),
            "int8_types": sorted(t.name for t in int8_act.INT8_TYPES), "int8_q8_0_form": triton_int8._Q8_0_FORM,
            "int8_q2_k_form": triton_int8._Q2_K_FORM,
            "int8_round_kernel": int8_round_kernel.ENABLED, "shared_launch": qtensor._SHARED_LAUNCH,
            "topk_kernel": topk_kernel.ENABLED, "attn_kernel": attention_kernel.ENABLED,
            "attn_tile": attention_kernel.TILE, "attn_dot": attention_kernel.DOT,
            "mhc_kernel": mhc_input_kernel.ENABLED, "mhc_v4_kernel": mhc_input_kernel.ENABLED_V4,
            "side_stream": side_stream.MECHANISM,
            "co_launch": co_launch.ENABLED, "co_launch_attention": co_launch.ATTENTION,
            "compressor_kernel": compressor_kernel.ENABLED, "softmax_kernel": sink_softmax_kernel.ENABLED,
            "route_kernel": topk_kernel.ROUTE_ENABLED, "swiglu_kernel": swiglu_kernel.ENABLED,
            "mhc_round": mhc_input_kernel.ROUND_FFN_INPUT,
            "tiles_set": os.environ.get("JDS41_TILES", "")}


def _machine() -> str:
    import jax

    dev = jax.devices()[0]
    return f"{platform.node()} {dev.platform}:{getattr(dev, 'device_kind', '')} jax {jax.__version__}"


# ---- the file --------------------------------------------------------------------------------------------------


def model_config(arch: str, layers: int, engram_rows: int | None):
    from jds41.checkpoints import presets

    cfg = presets.preset(arch, "full", layers)
    if cfg.engram is not None and engram_rows:
        cfg = presets.with_engram_rows(cfg, engram_rows)
    return cfg


def write_file(path: str, cfg, quant: str) -> float:
    from jds41.checkpoints.synth import write_synthetic

    if os.path.exists(path):
        return 0.0
    t0 = time.perf_counter()
    write_synthetic(path + ".tmp", cfg, quant=quant, tokenizer="none", fast=True, progress=False)
    os.replace(path + ".tmp", path)
    return time.perf_counter() - t0


def fit_skew(n_experts: int, k: int, top10: float, seed: int = 0) -> float:
    """g such that selection by sqrt-softplus(z) - g*ln(1+rank), z ~ N(0,1) per token and expert, gives the top
    10% of experts `top10` of the selections (bisection on a simulation of 4096 tokens)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((4096, n_experts))
    s = np.sqrt(np.logaddexp(0, z))
    shape = -np.log1p(np.arange(n_experts))
    top = max(1, n_experts // 10)

    def share(g):
        sel = np.argpartition(-(s + g * shape), k - 1, axis=1)[:, :k]
        counts = np.bincount(sel.reshape(-1), minlength=n_experts)
        return np.sort(counts)[::-1][:top].sum() / counts.sum()

    lo, hi = 0.0, 4.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) < top10 else (lo, mid)
    return (lo + hi) / 2


def set_skew(path: str, top10: float, seed: int = 0) -> float:
    """Write the Zipf-like selection bias into every score-routed layer's exp_probs_b (in place)."""
    from jds41.checkpoints import open_model

    model = open_model(path)
    cfg = model.config
    g = fit_skew(cfg.n_experts, cfg.n_experts_used, top10, seed)
    rng = np.random.default_rng(seed)
    for layer in range(cfg.n_layers):
        if cfg.is_hash_layer(layer):
            continue
        info = model.tensors[f"blk.{layer}.exp_probs_b.bias"]
        dtype = {0: np.float32, 1: np.float16}[int(info.ggml_type)]
        bias = np.empty(cfg.n_experts, np.float64)
        bias[rng.permutation(cfg.n_experts)] = -g * np.log1p(np.arange(cfg.n_experts))
        mm = np.memmap(info.shard, dtype=dtype, mode="r+", offset=info.offset, shape=(cfg.n_experts,))
        mm[:] = bias.astype(dtype)
        mm.flush()
        del mm
    return g


def measure_usage(path: str, usage_path: str, tokens: int, seed: int = 1) -> dict:
    """Profile random prompts on the all-resident model into usage.json; returns the measured skew."""
    from jds41.engine import Engine
    from jds41.tiers.profile import CHUNK, profile_prompts
    from jds41.tiers.usage import ModelIdentity, UsageCounter

    engine = Engine.open(path, max_ctx=512)
    cfg = engine.cfg
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, 512 // CHUNK * CHUNK)]
               for _ in range(max(1, tokens // 512))]
    e = cfg.engram
    counter = UsageCounter(ModelIdentity.of(engine.gguf), [i for i in range(cfg.n_layers) if cfg.is_hash_layer(i)],
                           e.layer_ids if e else (), e.rows if e else ())
    profile_prompts(engine, prompts, counter)
    counter.finish(prompts=len(prompts), corpus={"source": "random tokens", "seed": seed}).save(usage_path)
    counts = counter.counts[[i for i in range(cfg.n_layers) if not cfg.is_hash_layer(i)]]
    top = max(1, cfg.n_experts // 10)
    shares = np.sort(counts, axis=1)[:, ::-1][:, :top].sum(1) / np.maximum(counts.sum(1), 1)
    del engine
    gc.collect()
    return {"tokens": int(counter.tokens), "top10_share_per_layer": [round(float(x), 4) for x in shares],
            "top10_share_mean": round(float(shares.mean()), 4)}


# ---- profiles --------------------------------------------------------------------------------------------------


def full_model_bytes(arch: str, quant: str) -> dict:
    """Routed / shared / Engram / dense bytes, and one expert's, of the FULL model of `arch` in `quant`
    (computed from the schema and the synthetic writer's type rules; nothing is written)."""
    from jds41.checkpoints import presets
    from jds41.checkpoints.schema import Kind, model_tensors
    from jds41.checkpoints.synth import choose_types, tensor_nbytes

    cfg = presets.preset(arch, "full")
    types, _ = choose_types(cfg, quant)
    out = {"routed": 0, "shared": 0, "engram": 0, "dense": 0}
    for name, spec in model_tensors(cfg).items():
        n = tensor_nbytes(spec.shape, types[name])
        key = ("routed" if spec.kind is Kind.EXPERTS else "shared" if "shexp" in name
               else "engram" if spec.kind is Kind.ROWS else "dense")
        out[key] += n
    out["expert"] = out["routed"] // (cfg.n_layers * cfg.n_experts)  # one routed expert (gate + up + down)
    return out


def profile_json(name: str, arch: str, quant: str, workdir: str) -> str | None:
    """A profile argument for Engine.open: None (plain), a shipped name, or a JSON file written here. A name ending
    in `+all` or `+selected` is that profile with that `host_fetch` (K host rows per layer, or only the selected)."""
    if name == "plain":
        return None
    fetch = next((f for f in ("all", "selected") if name.endswith("+" + f)), None)
    if fetch:
        from jds41.tiers.profiles import load_profile

        base = profile_json(name.removesuffix("+" + fetch), arch, quant, workdir)
        doc = {**load_profile(base).to_json(), "host_fetch": fetch}
        doc["name"] = name.replace("+", "-")
        path = os.path.join(workdir, f"profile-{doc['name']}-{arch}-{quant}.json")
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
        return path
    base = {"placement_source": "uniform", "lookahead": 1, "slot_cache_slots": 256, "engram_tables": "ssd",
            "router_lean": {"enabled": False, "margin": 0.0}}
    if name == "all-host":
        doc = {**base, "name": "all-host", "tier0_bytes": 0, "tier1_bytes": "all", "slot_cache_slots": 0,
               "lookahead": False, "engram_tables": "host",
               "comment": "every routed expert in pinned host memory: llama.cpp's -ot exps=CPU analogue"}
    elif name == "h200":
        b = full_model_bytes(arch, quant)
        from jds41.tiers.profiles import load_profile

        shipped = load_profile("h200")
        slots = shipped.slot_cache_slots * b["expert"]
        t0 = max(0, H200_HBM - b["dense"] - b["shared"] - slots - 16 * 2**30)
        t1 = max(0, H200_HOST - 16 * 2**30)
        f0 = min(1.0, t0 / b["routed"])
        f1 = min(1.0 - f0, t1 / b["routed"])
        doc = {**base, "name": "h200-scaled", "tier0_bytes": round(f0, 4), "tier1_bytes": round(f1, 4),
               "slot_cache_slots": shipped.slot_cache_slots,
               "comment": f"h200 budgets resolved for the full {arch} {quant} model ({b['routed'] / 2**30:.1f} GiB "
                          f"routed): {f0:.1%} of expert bytes in HBM, {f1:.1%} in host memory"}
    else:  # a shipped profile: its placement without its router lean (the lean changes routing, and a placement
        # benchmark must give plain decode's predictions); NAME+lean keeps the profile's lean and its guard
        from jds41.tiers.profiles import load_profile

        doc = load_profile(name.removesuffix("+lean")).to_json()
        if not name.endswith("+lean"):
            doc["router_lean"] = {**doc["router_lean"], "enabled": False, "margin": 0.0}
        # a profile JSON path (e.g. a lean margin under study) names its row and file by its file name
        doc["name"] = name = os.path.basename(name).replace(".json", "").replace("+", "-")
    path = os.path.join(workdir, f"profile-{name}-{arch}-{quant}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    return path


# The ladder (issue #5 item 3): the same workload with one feature switched on per rung. Budgets are lucebox's
# (6.54% of expert bytes in HBM, 60% in pinned host memory, the rest on the SSD) from the "ranked" rung on.
# (rung, profile fields, placement ranked by measured usage?, decode loop)
LADDER = (
    ("naive-ssd", {"tier0_bytes": 0, "tier1_bytes": 0}, False, "step"),
    ("host-tier", {"tier0_bytes": 0, "tier1_bytes": 0.6}, False, "step"),
    ("ranked", {"tier0_bytes": 0.0654, "tier1_bytes": 0.6}, True, "step"),
    ("cache-lookahead", {"tier0_bytes": 0.0654, "tier1_bytes": 0.6, "slot_cache_slots": 128, "lookahead": 1}, True,
     "step"),
    ("fused", {"tier0_bytes": 0.0654, "tier1_bytes": 0.6, "slot_cache_slots": 128, "lookahead": 1}, True, "device"),
    ("lean", {"tier0_bytes": 0.0654, "tier1_bytes": 0.6, "slot_cache_slots": 128, "lookahead": 1, "lean": True}, True,
     "device"),
)


def ladder_profile(rung: str, fields: dict, k: int, margin: float, workdir: str) -> str:
    """A rung's profile JSON: SSD experts get only a step's worth of slots (K, no reuse to speak of) until the
    cache rung, no look-ahead until then, the router lean only on the last rung."""
    doc = {"name": f"ladder-{rung}", "placement_source": "uniform", "slot_cache_slots": k, "lookahead": False,
           "engram_tables": "ssd", "router_lean": {"enabled": False, "margin": 0.0},
           **{key: v for key, v in fields.items() if key != "lean"}}
    if fields.get("lean"):
        doc["router_lean"] = {"enabled": True, "margin": margin}
    path = os.path.join(workdir, f"ladder-{rung}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    return path


# ---- one run ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bytes:
    hbm: float
    pcie: float
    ssd: float

    def roofline(self, bw: dict = BW) -> tuple[float, float]:
        t = [self.hbm / bw["hbm"], self.pcie / bw["pcie"], self.ssd / bw["ssd"]]
        return 1.0 / max(t), 1.0 / sum(t)


def device_hbm_read_bps(nbytes: int = 2 << 30, reps: int = 10) -> float | None:
    """This GPU's HBM read bandwidth, bytes/s: the best of `reps` timed sums of an `nbytes` f32 array (one read of
    every byte), or None where JAX has no GPU. The roofline stays the reference box's (DESIGN.md §8); this one number
    lets a row from another GPU (an H100 is lent when no H200 is) be read against its own memory too."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        return None
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    del x
    return nbytes / best


def device_roofline(row: dict, hbm_bps: float) -> dict:
    """A row's roofline with this GPU's measured HBM bandwidth in place of the reference box's (PCIe and SSD stay
    the box's), and the measured decode speed's ratio to it."""
    best, _ = Bytes(**row["bytes_per_token"]).roofline({**BW, "hbm": hbm_bps})
    return {"roofline_device_hbm_tok_s": round(best, 1), "ratio_device_hbm": round(row["decode_tok_s"] / best, 4)}


def static_bytes(engine) -> tuple[int, int]:
    """(dense bytes the GPU reads per token: every non-routed tensor, one embedding row, no Engram table;
    bytes of one token's Engram rows)."""
    gguf, cfg = engine.gguf, engine.cfg
    dense = 0
    for name, info in gguf.tensors.items():
        if "_exps." in name or "engram_embd" in name or "tid2eid" in name:
            continue
        dense += info.n_bytes // info.shape[0] if name == "token_embd.weight" else info.n_bytes
    engram = 0
    if cfg.engram is not None:
        engram = len(cfg.engram.layer_ids) * cfg.engram.n_buckets * cfg.engram.row_bytes
    return dense, engram


def state_bytes(session) -> int:
    import jax

    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(session.state)))


_COMPILES = [0]  # XLA compilations so far in this process (counted by a jax.monitoring listener)


def _count_compiles() -> int:
    """XLA compilations so far. A timed region must compile nothing: every row reports the compilations its
    prefill and decode made, so a figure that includes compile time cannot pass unnoticed."""
    if not getattr(_count_compiles, "listening", False):
        from jax import monitoring

        def on_event(name: str, *_args, **_kw) -> None:
            if name == "/jax/core/compile/backend_compile_duration":
                _COMPILES[0] += 1

        monitoring.register_event_duration_secs_listener(on_event)
        _count_compiles.listening = True
    return _COMPILES[0]


def _tier_snapshot(engine) -> dict:
    from jds41.engram_host_call import step_rows_fn
    from jds41.native.engram_ffi import EngramFfi

    t = engine.tiers
    if t is None:
        return {}
    snap = {"lookups": t.lookups.copy(), "bytes": t.bytes.copy(), "tokens": t.tokens, "lean_swaps": t.lean_swaps}
    if t.stores.ssd is not None:
        st = t.stores.ssd.stats
        snap["slot"] = (st.lookups, st.hits, st.misses, st.bytes, st.stall_s, st.host_calls, st.answer_rows,
                        st.host_call_s)
    src = engine.engram[1] if engine.engram is not None else None
    if src is not None and hasattr(src, "rows_read"):
        snap["engram_rows_read"] = src.rows_read
        host_call = step_rows_fn(engine)
        if isinstance(host_call, EngramFfi):  # the handler reads the file itself, behind its own row cache
            snap["engram_rows_read"] += host_call.counters()["rows_read"]
    return snap


def _engram_host(engine) -> str | None:
    """Which form the step's Engram host call took (jds41.engram_host_call): "ffi", "callback", or None."""
    from jds41.engram_host_call import step_rows_fn
    from jds41.native.engram_ffi import EngramFfi

    fn = step_rows_fn(engine)
    return None if fn is None else "ffi" if isinstance(fn, EngramFfi) else "callback"


def run_profile(path: str, name: str, args, usage_path: str | None, stream: list[int], prompt: list[int],
                prof: str | None = None, loop: str = "device", warm_tokens: tuple[list[int], list[int]] | None = None,
                numerics: str = "jds41") -> dict:
    """One profile: time to ready, prefill, then decode over `stream` in the device loop (`loop="device"`) or one
    jitted step and host round trip per token (`"step"`, the reference path). `prof` overrides the profile file
    (ladder rungs); `usage_path` None keeps the profile's own placement source. `warm_tokens` (prompt, stream)
    of the same lengths compile the programs: other tokens than the timed ones, so the caches the warm-up fills
    (the slot cache, the Engram row caches) hold nothing chosen for the timed tokens."""
    from jds41.decode_loop import decode_forced
    from jds41.engine import Engine

    if prof is None:
        prof = profile_json(name, args.arch, args.quant, args.workdir)
    t0 = time.perf_counter()
    engine = Engine.open(path, max_ctx=len(prompt) + len(stream) + 64, profile=prof,
                         usage=usage_path if prof is not None else None, numerics=numerics)

    def decode(session, tokens=stream):
        if loop == "device":
            return decode_forced(session, tokens)
        return np.asarray([int(np.argmax(session.feed([t]))) for t in tokens[:-1]])

    ready_s = time.perf_counter() - t0
    log(f"{name}: ready in {ready_s:.1f} s")
    # Compile the pieces of the timed prefill (its first --prefill-piece tokens, then the same again after them:
    # a later piece starts at another position but has the same shapes) and the decode loop. Until 8034809 this
    # fed 32 tokens, so the timed prefill of a longer prompt compiled its layer-major piece: the prefill_tok_s of
    # earlier rows include that compile (experiments/README.md). Until the twentieth session the warm-up fed the
    # timed prompt and stream themselves, so every Engram row and many experts of the timed decode were cached
    # before it started (results of earlier sessions: h200 read ~1.3 Engram rows per token from the SSD, not 48).
    warm_prompt, warm_stream = warm_tokens or (prompt, stream)
    warm = engine.session()
    t0 = time.perf_counter()
    warm.feed(warm_prompt[:args.prefill_piece])
    decode(warm, warm_stream)
    compile_s = time.perf_counter() - t0
    log(f"{name}: warm-up (compiles) {compile_s:.1f} s")
    del warm

    s = engine.session()
    compiles0 = _count_compiles()
    t0 = time.perf_counter()
    fed = 0
    # In pieces of --prefill-piece tokens, stopping once --prefill-budget-s is spent: a profile that streams every
    # expert token by token must not eat a whole device call (the first H200 run lost 10 minutes that way).
    while fed < len(prompt):
        piece = prompt[fed:fed + args.prefill_piece]
        s.feed(piece)
        fed += len(piece)
        if time.perf_counter() - t0 > args.prefill_budget_s:
            break
    prefill_s = time.perf_counter() - t0
    log(f"{name}: prefill {fed} of {len(prompt)} tokens in {prefill_s:.1f} s")
    compiles1 = _count_compiles()
    before = _tier_snapshot(engine)
    t0 = time.perf_counter()
    preds = decode(s)
    decode_s = time.perf_counter() - t0
    after = _tier_snapshot(engine)
    compiles = {"prefill": compiles1 - compiles0, "decode": _count_compiles() - compiles1}
    n = len(stream) - 1
    dense, engram_row_bytes = static_bytes(engine)
    cfg = engine.cfg
    row = {"profile": name, "loop": loop, "ready_s": round(ready_s, 2), "compile_s": round(compile_s, 2),
           "prefill_tokens": fed, "prefill_tok_s": round(fed / prefill_s, 2),
           "decode_tokens": n, "decode_tok_s": round(n / decode_s, 2),
           "decode_ms_per_token": round(1e3 * decode_s / n, 3),
           "predictions_sha256": hashlib.sha256(np.asarray(preds, np.int32).tobytes()).hexdigest()[:16],
           "compiles_while_timed": compiles, "engram_host": _engram_host(engine)}
    sb = state_bytes(s)
    if engine.tiers is None:
        expert = sum(engine.gguf.tensors[f"blk.{i}.ffn_{k}_exps.weight"].n_bytes for i in range(cfg.n_layers)
                     for k in ("gate", "up", "down")) / cfg.n_experts / cfg.n_layers
        per_tok = Bytes(dense + sb + cfg.n_layers * cfg.n_experts_used * expert, 0, 0)
        row["tiers"] = None
    else:
        tok = max(after["tokens"] - before["tokens"], 1)
        tb = (after["bytes"] - before["bytes"]) / tok
        lk = after["lookups"] - before["lookups"]
        ssd_miss_bytes = 0.0
        tiers = {"hbm_share": round(lk[0] / max(lk.sum(), 1), 4), "host_share": round(lk[1] / max(lk.sum(), 1), 4),
                 "ssd_share": round(lk[2] / max(lk.sum(), 1), 4),
                 "bytes_per_token": {"hbm": int(tb[0]), "host": int(tb[1]), "ssd_tier": int(tb[2])}}
        if "slot" in after:
            d = [a - b for a, b in zip(after["slot"], before["slot"])]
            tiers["slot_cache"] = {"lookups": d[0], "hit_rate": round(d[1] / max(d[0], 1), 4),
                                   "misses": d[2], "stall_s": round(d[4], 3),
                                   # the graph's SSD host calls: how many, how many expert rows they carried in,
                                   # and the time inside them (reads waited for included), per token
                                   "host_calls_per_token": round(d[5] / tok, 3),
                                   "answer_rows_per_token": round(d[6] / tok, 3),
                                   "host_call_ms_per_token": round(1e3 * d[7] / tok, 3)}
            ssd_miss_bytes = d[3] / tok
        engram_ssd = 0.0
        if "engram_rows_read" in after and engine.tiers.profile.engram_tables == "ssd":
            # each missed row is one O_DIRECT read of at least one 4 KiB block
            engram_ssd = (after["engram_rows_read"] - before["engram_rows_read"]) * 4096 / tok
        engram_pcie = engram_row_bytes if engine.tiers.profile.engram_tables != "hbm" else 0
        per_tok = Bytes(dense + sb + tb[0] + tb[1] + tb[2], tb[1] + tb[2] + engram_pcie, ssd_miss_bytes + engram_ssd)
        tiers["lookahead"] = engine.tiers.stats()["lookahead"]
        if engine.plan.lean_margin is not None:
            swaps = after["lean_swaps"] - before["lean_swaps"]
            scored = tok * cfg.n_experts_used * engine.tiers.n_scored_layers
            tiers["router_lean"] = {"margin": engine.plan.lean_margin, "swaps_per_token": round(swaps / tok, 3),
                                    "topk_agreement": round(1 - swaps / max(scored, 1), 5)}
        row["tiers"] = tiers
    best, worst = per_tok.roofline()
    row["bytes_per_token"] = {"hbm": int(per_tok.hbm), "pcie": int(per_tok.pcie), "ssd": int(per_tok.ssd)}
    row["roofline_tok_s"] = round(best, 1)
    row["roofline_no_overlap_tok_s"] = round(worst, 1)
    row["ratio"] = round(row["decode_tok_s"] / best, 4)
    if engine.tiers is not None:
        engine.tiers.close()
    del s, engine
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="deepseek41", choices=("deepseek4", "deepseek41"))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--quant", default="ds4-q2")
    ap.add_argument("--size", default="full", help="preset size (full on the GPU box; small/tiny to test on CPU)")
    ap.add_argument("--profiles", default="plain,all-hbm,lucebox,h200")
    ap.add_argument("--prompt", type=int, default=4096, help="prefill prompt length")
    ap.add_argument("--decode", type=int, default=128, help="decode steps timed")
    ap.add_argument("--prefill-piece", type=int, default=4096, help="tokens per prefill call (a whole chunk)")
    ap.add_argument("--prefill-budget-s", type=float, default=90.0,
                    help="stop prefilling after the piece that passes this many seconds (reported tokens = fed)")
    ap.add_argument("--skew-top10", type=float, default=0.45, help="top-10%% expert share of the Zipf-like fit")
    ap.add_argument("--usage-tokens", type=int, default=1024)
    ap.add_argument("--engram-rows", type=int, default=2_000_000)
    ap.add_argument("--workdir", default="/tmp/jds41-bench")
    ap.add_argument("--ladder", action="store_true", help="run the feature ladder instead of --profiles")
    ap.add_argument("--lean-margin", type=float, default=0.05, help="router-lean margin of the ladder's last rung")
    ap.add_argument("--numerics", default="jds41",
                    help="comma-separated Engine numerics, each run per profile in turn (jds41, int8: jds41/engine.py)")
    ap.add_argument("--out", default=None, help="append JSON lines here (also printed)")
    a = ap.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    cfg = model_config(a.arch, a.layers, a.engram_rows) if a.size == "full" else None
    if cfg is None:
        from jds41.checkpoints import presets

        cfg = presets.preset(a.arch, a.size, a.layers)
    path = os.path.join(a.workdir, f"{a.arch}-{a.size}-{a.layers}L-{a.quant}.gguf")
    log(f"writing {path}")
    write_s = write_file(path, cfg, a.quant)
    log(f"written in {write_s:.1f} s; setting the routing skew and measuring usage")
    g = set_skew(path, a.skew_top10) if a.skew_top10 > 0 else 0.0
    usage_path = path + ".usage.json"
    t0 = time.perf_counter()
    skew = measure_usage(path, usage_path, a.usage_tokens)
    usage_s = time.perf_counter() - t0
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt)]
    stream = [int(t) for t in rng.integers(0, cfg.vocab_size, a.decode + 1)]
    warm_tokens = ([int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt)],
                   [int(t) for t in rng.integers(0, cfg.vocab_size, a.decode + 1)])
    common = {"bench": "decode", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "triton_kernels": triton_kernels_on(),
              "planar_weights": planar_weights_on(), "q2k_kernel": q2k_kernel_on(),
              **kernel_ab(), "arch": a.arch, "size": a.size, "layers": a.layers,
              "quant": a.quant,
              "file_gib": round(os.path.getsize(path) / 2**30, 2), "write_s": round(write_s, 1),
              "routing": {"source": "zipf-fit selection bias" if a.skew_top10 > 0 else "random weights",
                          "target_top10_share": a.skew_top10, "g": round(g, 4), "measured": skew},
              "usage_s": round(usage_s, 1), "bandwidths": BW, "warm_up": "other tokens of the same lengths"}
    hbm_bps = device_hbm_read_bps()  # before any model holds HBM
    if hbm_bps is not None:
        common["device_hbm_read_bps"] = round(hbm_bps, -6)
    if a.ladder:
        runs = [(f"ladder-{rung}", ladder_profile(rung, fields, cfg.n_experts_used, a.lean_margin, a.workdir),
                 usage_path if ranked else None, loop) for rung, fields, ranked, loop in LADDER]
    else:
        runs = [(name, None, usage_path, "device") for name in a.profiles.split(",") if name]  # none: write only
    refs = {}
    for name, prof, usage, loop in runs:
        for numerics in a.numerics.split(","):
            row = {**common, "numerics": numerics,
                   **run_profile(path, name, a, usage, stream, prompt, prof, loop, warm_tokens, numerics)}
            ref = refs.setdefault(numerics, row["predictions_sha256"])
            row["same_predictions_as_first"] = row["predictions_sha256"] == ref  # the first row of its numerics
            if hbm_bps is not None:
                row.update(device_roofline(row, hbm_bps))
            emit(row, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
