"""Serving throughput of `python -m jds41.serve` under a profile (and a drafter), measured from a real client.

Starts the server as a subprocess (`--profile`, `--draft`, `--decode-width`, `--slots` passed through), waits for
/health, then for each `--concurrency` level sends `--requests` completions from that many client threads at once
(token-id prompts: `--texts` held-out documents, else random ids; the same prompts at every level) and reports:
- `tok_s`: completion tokens of all requests over the level's wall time (what the box serves);
- per-request decode speed and time to first token, p50 / p95 (from each response's `timings`: `predicted_per_second`,
  `queue_ms + prompt_ms`);
- what /metrics counted during the level (expert lookups and hits per tier, SSD bytes, draft tokens accepted).
One JSON line per level (printed, and appended to `--out`). The server's tokens are those of
`python -m jds41.generate` (tests/test_serve_tiered.py, tests/test_serve_draft.py): this measures speed only.
CPU timings check the code path only: they are not speed figures.

GPU: python experiments/bench_serve.py MODEL.gguf --profile lucebox --concurrency 1,4 --requests 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import _commit  # noqa: E402  (sibling script)

METRICS = {  # JSON key -> Prometheus sample (name, label filter)
    "hbm_lookups": ("jds41:expert_lookups_total", 'tier="hbm"'),
    "host_lookups": ("jds41:expert_lookups_total", 'tier="host"'),
    "ssd_lookups": ("jds41:expert_lookups_total", 'tier="ssd"'),
    "ssd_hits": ("jds41:expert_hits_total", 'tier="ssd"'),
    "ssd_read_bytes": ("jds41:ssd_read_bytes_total", ""),
    "draft_tokens": ("jds41:spec_decode_num_draft_tokens_total", ""),
    "draft_accepted": ("jds41:spec_decode_num_accepted_tokens_total", ""),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for key, (name, labels) in METRICS.items():
        hit = next((line for line in text.splitlines() if re.match(re.escape(name) + r"[{ ]", line)
                    and labels in line), None)
        out[key] = float(hit.rsplit(" ", 1)[1]) if hit else 0.0
    return out


def _tail(path: str, n: int = 30) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-n:])


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: str) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; the end of its log ({log}):\n{_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not ready in {timeout:.0f} s")


def _prompts(args, vocab: int) -> list[list[int]]:
    if args.texts:
        from heldout import text_prompts

        from jds41.checkpoints import open_model
        from jds41.tokenizer import Tokenizer

        with open_model(args.model) as model:
            tok = Tokenizer.from_metadata(model.metadata, args.model)
        return text_prompts(tok, args.texts, args.requests, args.prompt_len)
    rng = np.random.default_rng(args.seed)
    return [[int(t) for t in rng.integers(16, vocab, args.prompt_len)] for _ in range(args.requests)]


def _one(url: str, model: str, prompt: list[int], args) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=args.request_timeout)
    r.raise_for_status()
    doc = r.json()
    return {"tokens": doc["usage"]["completion_tokens"], **doc["timings"]}


def _p50_p95(values: np.ndarray) -> dict:
    return {"p50": round(float(np.percentile(values, 50)), 3), "p95": round(float(np.percentile(values, 95)), 3)}


def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, args) -> dict:
    before = _metrics(url)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: _one(url, model, p, args), prompts))
    wall = time.perf_counter() - t0
    after = _metrics(url)
    ttft = np.array([d["queue_ms"] + d["prompt_ms"] for d in done])
    speed = np.array([d["predicted_per_second"] for d in done])
    tokens = sum(d["tokens"] for d in done)
    return {"concurrency": concurrency, "requests": len(done), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 3),
            "request_decode_tok_s": _p50_p95(speed), "ttft_ms": _p50_p95(ttft),
            "metrics": {k: after[k] - before[k] for k in METRICS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--profile", default="all-hbm")
    ap.add_argument("--draft", default=None, help="a draft GGUF or 'self' (serve --draft)")
    ap.add_argument("--decode-width", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--concurrency", default="1,4", help="comma separated client thread counts")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--texts", default=None, help="prompts from this held-out text (JSON Lines or .xz)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None, help="append JSON lines here (also printed)")
    ap.add_argument("--server-log", default=None, help="the server's stdout and stderr (default: beside --out, "
                    "else serve.log in the working directory)")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jds41.serve", args.model, "--port", str(port), "--slots", str(args.slots),
           "--ctx", str(args.ctx), "--profile", args.profile, "--decode-width", str(args.decode_width)]
    if args.draft:
        cmd += ["--draft", args.draft]
    log = args.server_log or (os.path.splitext(args.out)[0] + ".serve.log" if args.out else "serve.log")
    with open(log, "ab") as log_fh:  # the server's own account of a failure outlives this process
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT)
    try:
        ready_s = _wait_ready(url, proc, args.ready_timeout, log)
        props = httpx.get(url + "/props", timeout=30).json()
        model_id = props["model"]
        prompts = _prompts(args, props["vocab_size"])
        _one(url, model_id, prompts[0], args)  # warm-up: first request after ready (nothing should compile)
        # The machine as the SERVER sees it (/props): importing jax here would take GPU memory from the server.
        build = props.get("build", {})
        machine = f"{platform.node()} {build.get('backend', '?')} jax {build.get('jax', '?')}"
        meta = {"bench": "serve", "commit": _commit(), "machine": machine, "command": " ".join(sys.argv),
                "profile": args.profile, "draft": args.draft, "decode_width": args.decode_width,
                "slots": args.slots, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                "temperature": args.temperature, "ready_s": round(ready_s, 2), "tiers": props["tiers"]}
        for c in levels:
            row = {**meta, **run_level(url, model_id, prompts, c, args)}
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(line + "\n")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
