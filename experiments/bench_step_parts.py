"""Where a decode step's time goes (issue #5, item 4): each part of one block, the output head, and the routed-expert
product in every expert format, timed alone on the device at full-model shapes. One JSON line.

    python experiments/bench_step_parts.py MODEL.gguf [--layer L] [--reps 200]

MODEL is a (synthetic) full-size file; its parameters are loaded plain (all resident). Parts, each jitted on its
own and run `--reps` times back to back (async dispatch overlaps the launches, so the per-call figure is device
time plus any launch gap a whole step would also see):
- mhc: the sublayer's hyper-connection mix, split (Sinkhorn), collapse and RMS norm;
- attention: the whole attention sublayer at position `--pos` (query, window ring, compressor, indexer, attend,
  output projections);
- router: scores and top-k;
- routed: the K routed experts of one token from the layer's own stacks (`routed_experts`);
- shared: the shared expert;
- engram: the Engram combine (layers with Engram);
- head: output norm and the vocabulary projection;
- step: one whole decode step (`model.decode_step`), for the sum check.
And `formats`: `routed_experts` for the same expert shape with random stacks of K*2 experts in Q8_0, MXFP4, Q4_K,
Q2_K and IQ2_XXS, with the bytes each reads and the implied GB/s -- the question of DESIGN.md §7 (sub-byte formats
in XLA) at this model's shapes. Bytes per part are the quantized bytes each reads, for a per-part roofline.
CPU runs check the code path only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import BW, _commit, _machine, emit  # noqa: E402  (sibling script, run as a file)

from jds41 import model as M  # noqa: E402
from jds41.engine import Engine  # noqa: E402
from jds41.layers.engram import engram_combine  # noqa: E402
from jds41.layers.mhc import hc_collapse  # noqa: E402
from jds41.layers.moe import routed_experts, shared_expert  # noqa: E402
from jds41.layers.norm import rms_norm  # noqa: E402
from jds41.layers.router import route  # noqa: E402
from jds41.quant import QTensor, qmatvec  # noqa: E402
from jds41.quant.random_blocks import random_bits  # noqa: E402

FORMATS = (T.Q8_0, T.MXFP4, T.Q4_K, T.Q2_K, T.IQ2_XXS)


def timed(fn, *args, reps: int) -> float:
    """Seconds per call of a jitted `fn` (compiled and run once first)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


_NOT_LAUNCHED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def launched_ops(hlo: str) -> dict:
    """Instructions of the optimized program's entry computation that run as device work (kernels, copies, library
    calls), by opcode: a step of many tiny kernels is bound by launch gaps, not bytes (a few microseconds each)."""
    counts: dict[str, int] = {}
    entry = hlo[hlo.index("\nENTRY "):] if "\nENTRY " in hlo else ""
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        rhs = line.split(" = ", 1)[-1]
        head = rhs.split("(", 1)[0].split() if "(" in rhs else []
        op = head[-1] if head else ""
        if op and op not in _NOT_LAUNCHED:
            counts[op] = counts.get(op, 0) + 1
    return {"total": sum(counts.values()), **dict(sorted(counts.items(), key=lambda kv: -kv[1])[:10])}


def qbytes(*qs) -> int:
    return int(sum(np.prod(q.data.shape) * q.data.dtype.itemsize for q in qs))


def expert_formats(cfg, D: int, F: int, reps: int, limit) -> list[dict]:
    rng = np.random.default_rng(0)
    K = cfg.n_experts_used
    x = jnp.asarray(rng.standard_normal(D), jnp.float32)
    idx = jnp.arange(K, dtype=jnp.int32) * 2  # distinct experts, every other one of the stack
    wts = jnp.full((K,), 1.0 / K, jnp.float32)
    out = []
    def stack(qt, shape):
        return QTensor(jax.device_put(jnp.asarray(random_bits(rng, qt, shape))), qt, shape)

    for qt in FORMATS:
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if D % block or F % block:
            out.append({"format": qt.name, "skipped": f"rows of {D} / {F} are not whole {block}-value blocks"})
            continue
        gate, up, down = stack(qt, (2 * K, F, D)), stack(qt, (2 * K, F, D)), stack(qt, (2 * K, D, F))
        fn = jax.jit(lambda x, g, u, d, i, w: routed_experts(x, g, u, d, i, w, limit))
        s = timed(fn, x, gate, up, down, idx, wts, reps=reps)
        read = qbytes(gate, up, down) // 2  # K of the 2K experts
        out.append({"format": qt.name, "us": round(s * 1e6, 1), "bytes": read, "gb_per_s": round(read / s / 1e9, 1),
                    "hbm_share": round(read / s / BW["hbm"], 4)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--layer", type=int, default=None, help="block to time (default: the last one)")
    ap.add_argument("--pos", type=int, default=4095, help="position the attention part runs at")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    engine = Engine.open(a.model, max_ctx=a.pos + 64)
    cfg, plan, params = engine.cfg, engine.plan, engine.params
    L = cfg.n_layers - 1 if a.layer is None else a.layer
    lp, w = plan.layers[L], params["blocks"][L]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((cfg.hc_mult, cfg.dim)) * 0.5, jnp.float32)
    h = jnp.asarray(rng.standard_normal(cfg.dim), jnp.float32)
    pos = jnp.int32(a.pos)
    state = M.init_state(plan)
    parts: dict[str, float] = {}
    limit = cfg.swiglu_limit[L]

    # Weights are arguments, never closed over: captured arrays become program constants (3.8 GB of them on the
    # H200's 4-layer file), which made compilation run past the call's time limit.
    parts["mhc"] = timed(jax.jit(lambda w, x: rms_norm(hc_collapse(x, M._sublayer_mix(cfg, w, "attn", x)[0]),
                                                       w["attn_norm"], cfg.rms_eps)), w, x, reps=a.reps)

    def attention(w, layers, h, pos):
        new = list(layers)
        return M._attention_block(plan, lp, w, layers, new, h, pos, {})

    if lp.index_source < 0 or lp.runs_indexer:  # a layer that picks its own rows can run alone
        parts["attention"] = timed(jax.jit(attention), w, state["layers"], h, pos, reps=a.reps)
    if not lp.hash_layer:
        parts["router"] = timed(jax.jit(lambda w, h: route(h, w["ffn_gate_inp"], w["exp_probs_b"], cfg).idx_K), w,
                                h, reps=a.reps)
    K = cfg.n_experts_used
    idx = jnp.asarray(rng.choice(cfg.n_experts, K, replace=False), jnp.int32)
    wts = jnp.full((K,), 1.0 / K, jnp.float32)
    stacks = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"])
    parts["routed"] = timed(jax.jit(lambda s, h, i, wt: routed_experts(h, *s, i, wt, limit)), stacks, h, idx, wts,
                            reps=a.reps)
    if cfg.n_shared_experts:
        parts["shared"] = timed(jax.jit(lambda w, h: shared_expert(h, w["ffn_gate_shexp"], w["ffn_up_shexp"],
                                                                   w["ffn_down_shexp"], cfg.swiglu_limit_shexp[L])),
                                w, h, reps=a.reps)
    if lp.engram_slot >= 0:
        e = cfg.engram
        rows = jnp.asarray(rng.integers(0, 120, (e.n_buckets, e.row_bytes)), jnp.uint8)
        parts["engram"] = timed(jax.jit(lambda w, x, r: engram_combine(x, r, w["engram_wkv"], w["engram_q"],
                                                                       w["engram_k"], cfg.rms_eps)), w, x, rows,
                                reps=a.reps)
    head = {"output_norm": params["output_norm"], "output": params["output"]}
    parts["head"] = timed(jax.jit(lambda p, y: qmatvec(rms_norm(y, p["output_norm"], cfg.rms_eps), p["output"])),
                          head, h, reps=a.reps)
    st = M.init_state(plan)
    step_s = None
    tok = jnp.int32(1)
    rows = engine.engram_rows([1], [])
    rows = None if rows is None else jnp.asarray(rows[0])
    logits, st = M.decode_step(plan, params, st, tok, rows)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for _ in range(max(10, a.reps // 10)):
        logits, st = M.decode_step(plan, params, st, tok, rows)
    jax.block_until_ready(logits)
    step_s = (time.perf_counter() - t0) / max(10, a.reps // 10)
    step_ops = launched_ops(M.decode_step.lower(plan, params, st, tok, rows).compile().as_text())

    expert = stacks[0].shape
    row = {"bench": "step_parts", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv),
           "model": os.path.basename(a.model), "layers": cfg.n_layers, "layer": L, "pos": a.pos,
           "layer_kind": {"ratio": lp.ratio, "hash": lp.hash_layer, "engram": lp.engram_slot >= 0,
                          "indexer": lp.runs_indexer},
           "us": {k: round(v * 1e6, 1) for k, v in parts.items()}, "step_us": round(step_s * 1e6, 1),
           "step_ops": step_ops,
           "routed_bytes": qbytes(*stacks) // cfg.n_experts * K,
           "head_bytes": qbytes(params["output"]),
           "expert_formats": expert_formats(cfg, expert[2], expert[1], a.reps, limit)}
    emit(row, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
