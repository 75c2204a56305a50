"""Where XLA accepts a stream-annotated region (layers/side_stream.py) on the GPU: one small graph a case, each in
its own process so XLA_FLAGS can differ.

Why: at 20734c9 on an H100 (jax 0.11.2) the engine with JDS41_SIDE_STREAM=1 failed in its prefill graph with
"NOT_FOUND: No ExecutionStreamId found for %call-start ... not reachable from the module's entrypoint, or only
reachable through embedded calls" for the K = V latent's region inside the layers' while loop. This asks which
shapes of graph XLA compiles and runs with the annotation (`CASES`: at the top level, in while bodies, with the
weight a jit argument reshaped in the region, alone and fed to lax.platform_dependent as the engine's products
take it, with a cond inside or around it, a host callback or a Pallas call inside), each with XLA's command
buffers on and off, so the switch can be applied where it works or withdrawn. Each case also checks the value
against the same graph without the region.

At 9676a52 on an H100 every case compiled and kept the bits but a cond inside the region, which failed as the
engine had (results/probe_side_stream39_h100.jsonl). Lowered for CUDA, the engine's regions also held nested calls
(the products' jitted rows_matvec), a shape no case had: `while_nested_jit_raw` has one as JAX lowers it,
`while_nested_jit` the same inlined, as regions now are (side_stream.inline_calls). `--engine SETS` asks the
engine itself: for
each JDS41_SIDE_STREAM value in SETS (e.g. off,latent,shared,engram,1), in its own process, open a V4.1 file
(--model, or a synthetic full-size one of --layers layers written to --workdir, as bench_decode writes them),
feed a prompt and decode forced tokens in the device loop twice; a row with ok or the error, ms a token (not a
benchmark: one short run) and whether the predictions equal the "off" run's.

    python3 experiments/probe_side_stream.py --out results/probe_side_stream.jsonl
    python3 experiments/probe_side_stream.py --engine off,latent,shared,engram --layers 2 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = ("top", "while", "while_in_while", "while_weight_arg", "while_weight_platform", "while_cond_inside",
         "cond_around", "callback_while", "pallas_top", "pallas_while", "while_nested_jit", "while_nested_jit_raw")
NO_CMDBUF = "--xla_gpu_enable_command_buffer="
SITE = "shared"  # the small graphs' regions go through one of the engine's sites (all are on in their processes)


def run_case(case: str) -> dict:
    """Builds and runs one case here (in the child process); the row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jds41.layers import side_stream

    n = 512
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    x0 = jax.random.normal(jax.random.key(1), (n,), jnp.float32)

    def pallas_scale(y):  # y * 2 + 1 as a compiled Pallas call (GPU only: the CPU runs Pallas interpreted)
        from jax.experimental import pallas as pl

        def scale_kernel(y_ref, o_ref):
            o_ref[...] = y_ref[...] * 2.0 + 1.0

        return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype))(y)

    def side(x):
        return pallas_scale(x) if case.startswith("pallas") else jnp.tanh(a @ x)

    if case == "callback_while":
        def side(x):  # noqa: F811 (a host callback's rows, as the device loop's Engram fetch)
            rows = jax.pure_callback(lambda v: np.tanh(np.asarray(v)), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return rows * 2.0

    def side_with_cond(x):
        return jax.lax.cond(x[0] > 0, lambda v: jnp.tanh(a @ v), lambda v: jnp.sin(a @ v), x)

    def step(x, use_region: bool):
        if case == "while_cond_inside":
            branch = side_stream.on_side_stream(SITE, side_with_cond, x) if use_region else side_with_cond(x)
        elif case.startswith("while_nested_jit"):  # a jitted function inside, as the products' rows_matvec
            nested = jax.jit(lambda v: jnp.tanh(a @ v))
            fn = lambda v: nested(v) * 2.0  # noqa: E731
            inline = case == "while_nested_jit"  # the _raw case: the region as JAX lowers it, the call kept
            branch = side_stream.on_side_stream(SITE, fn, x, inline=inline) if use_region else fn(x)
        elif case == "cond_around":
            def annotated(v):
                return side_stream.on_side_stream(SITE, side, v) if use_region else side(v)
            branch = jax.lax.cond(x[0] > -100.0, annotated, lambda v: side(v) * 0.0, x)
        else:
            branch = side_stream.on_side_stream(SITE, side, x) if use_region else side(x)
        main = jnp.cos(a.T @ x)
        return (branch + main) / 4.0

    if case in ("while_weight_arg", "while_weight_platform"):  # the weight a jit argument, reshaped in the region
        w0 = a.reshape(1, n, n)  # (the engine's Q8_0 raw bytes: the failing call-start wrapped their [None] reshape)

        def side(x, w):  # noqa: F811
            if case == "while_weight_arg":
                return jnp.tanh(w.reshape(n, n) @ x)
            # as the engine's products: the stack [None] fed to lax.platform_dependent, a Pallas call on CUDA
            return jax.lax.platform_dependent(x, w.reshape(n, n)[None, None],
                                              cuda=lambda x, raw: pallas_scale(raw[0, 0] @ x),
                                              default=lambda x, raw: (raw[0, 0] @ x) * 2.0 + 1.0)

        def graph_w(x, use_region: bool, w):
            def body(i, v):
                branch = side_stream.on_side_stream(SITE, side, v, w) if use_region else side(v, w)
                return (branch + jnp.cos(w[0].T @ v)) / 4.0
            return jax.lax.fori_loop(0, 4, body, x)

        compiled, args = (lambda use: jax.jit(lambda x, w: graph_w(x, use, w))), (x0, w0)
    else:
        def graph(x, use_region: bool):
            if case in ("top", "pallas_top"):
                return step(x, use_region)
            if case == "while_in_while":
                inner = lambda v: jax.lax.fori_loop(0, 2, lambda j, u: step(u, use_region), v)  # noqa: E731
                return jax.lax.fori_loop(0, 3, lambda i, v: inner(v), x)
            return jax.lax.fori_loop(0, 4, lambda i, v: step(v, use_region), x)

        compiled, args = (lambda use: jax.jit(lambda x: graph(x, use))), (x0,)
    row = {"case": case, "xla_flags": os.environ.get("XLA_FLAGS", ""), "mechanism": side_stream.MECHANISM}
    try:
        row["annotated"] = "_xla_stream_annotation" in compiled(True).lower(*args).as_text()
        got = np.asarray(compiled(True)(*args))
        want = np.asarray(compiled(False)(*args))
        row.update(ok=True, same_bits=bool(np.array_equal(got, want)))
    except Exception as e:  # the failure is the measurement
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:400]}")
    return row


def run_engine(model: str) -> dict:
    """Opens `model` with this process's JDS41_SIDE_STREAM and decodes (in the child process); the row."""
    import hashlib
    import time

    import numpy as np

    from jds41.decode_loop import decode_forced
    from jds41.engine import Engine
    from jds41.layers import side_stream

    row = {"sites": os.environ.get("JDS41_SIDE_STREAM", "0"), "mechanism": side_stream.MECHANISM}
    try:
        engine = Engine.open(model, max_ctx=300, numerics="int8")
        rng = np.random.default_rng(3)
        top = min(4000, engine.cfg.vocab_size)
        prompt = [int(t) for t in rng.integers(8, top, 32)]
        warm, timed = ([int(t) for t in rng.integers(8, top, 65)] for _ in range(2))
        runs = []
        for stream in (warm, timed, timed):  # the first compiles; the last two must agree with each other
            session = engine.session()
            session.feed(prompt)
            t0 = time.perf_counter()
            runs.append((decode_forced(session, stream), time.perf_counter() - t0))
        (_, _), (preds, s1), (again, s2) = runs
        row.update(ok=True, ms_per_token=[round(1e3 * s / (len(timed) - 1), 3) for s in (s1, s2)],
                   predictions_sha256=hashlib.sha256(np.asarray(preds, np.int32).tobytes()).hexdigest()[:16],
                   repeats=bool(np.array_equal(preds, again)))
    except Exception as e:  # the failure is the measurement
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:600]}")
    return row


def _child_row(args: list[str], env: dict, label: dict, timeout: int) -> dict:
    """This script's child mode with `args`: its last JSON line, or a row with its exit and stderr's tail."""
    r = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {**label, "ok": False, "error": f"rc {r.returncode}: {r.stderr[-400:]}"}


def probe_engine(a, header: dict) -> None:
    model = a.model
    if model is None:
        from bench_decode import model_config, write_file

        os.makedirs(a.workdir, exist_ok=True)
        model = os.path.join(a.workdir, f"deepseek41-full-{a.layers}L-ds4-q2-probe.gguf")
        write_file(model, model_config("deepseek41", a.layers, a.engram_rows), "ds4-q2")
    off = None
    with open(a.out, "a") as out:
        for sites in a.engine.split(","):
            env = dict(os.environ, JDS41_SIDE_STREAM="0" if sites == "off" else sites.replace("+", ","))
            row = _child_row(["--out", a.out, "--engine-child", model], env, {"sites": sites}, 900)
            if sites == "off" and row.get("ok"):
                off = row["predictions_sha256"]
            if off is not None and row.get("ok"):
                row["same_predictions_as_off"] = row["predictions_sha256"] == off
            row = {**header, "mode": "engine", "layers": None if a.model else a.layers, **row}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--case", help="run one case here and print its row (the parent's child mode)")
    p.add_argument("--engine", help="comma-separated JDS41_SIDE_STREAM values for the engine (off: none; sites "
                   "joined by +, e.g. latent+shared)")
    p.add_argument("--engine-child", metavar="MODEL", help="the engine's run here (the parent's child mode)")
    p.add_argument("--model", help="the V4.1 GGUF for --engine (default: a synthetic full-size one)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--engram-rows", type=int, default=1 << 20, help="rows a table of the synthetic file")
    p.add_argument("--workdir", default="/tmp/jds41-bench")
    a = p.parse_args()
    if a.case:
        print(json.dumps(run_case(a.case)))
        return 0
    if a.engine_child:
        print(json.dumps(run_engine(a.engine_child)))
        return 0
    from bench_decode import _commit, _machine  # sibling script, run as a file

    header = {"bench": "probe_side_stream", "commit": _commit(), "machine": _machine(), "command": " ".join(sys.argv)}
    if a.engine:
        probe_engine(a, header)
        return 0
    with open(a.out, "a") as out:
        for flags in ("", NO_CMDBUF):
            for case in CASES:
                env = dict(os.environ, JDS41_SIDE_STREAM="1")
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
                row = _child_row(["--out", a.out, "--case", case], env, {"case": case}, 300)
                row = {**header, **row, "xla_flags_added": flags}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
