"""Loading, failing, cancelling and counting, against real server processes.

- The port answers at once: /health is 503 with load progress (phase, bytes done, bytes total) until the model
  is ready (the hidden --load-delay holds the load so the state is observable), and requests get 503 + Retry-After.
- A broken model file (truncated; a misshapen tensor) ends the process with status 1 and a message naming the
  file and the tensor; arguments that cannot work (an unknown profile or profile file, a missing model or draft
  file) exit 2 at once.
- A client that disconnects (stream or not) frees its slot within 1 s and the gauges return to 0; after 200
  requests abandoned by a 0.5 s client timeout a fresh request completes within 5 s (vLLM test_basic.py), and
  the server's memory has not grown (SGLang test_abort.py).
- Metric counters are exact after N requests (vLLM test_metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from gguf_surgery import patch, tensor_field, write_bytes
from serve_harness import REPO, free_port, server_env, sse_events, start_server, tiny_model

from jds41.checkpoints import read_header
from jds41.serve.streaming import PING, with_pings

pytestmark = pytest.mark.timeout(300)
LOAD_DELAY_S = 4
LONG = {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 4000}  # seconds of decoding on the tiny model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server caught while loading: `loading` holds what /health, /v1/models, /metrics and a chat request
    answered before the model was ready."""
    srv = start_server(tmp_path_factory, "reliability", "--load-delay", str(LOAD_DELAY_S), "--max-queue", "256",
                       ready=False)
    try:
        first = httpx.get(srv.url + "/health").json()["load"]["phase"]
        assert first in ("starting", "validating", "reading"), first
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").json()["load"]["phase"] != "reading":  # imports take a while
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.loading = {"health": httpx.get(srv.url + "/health"), "models": httpx.get(srv.url + "/v1/models"),
                       "chat": httpx.post(srv.url + "/v1/chat/completions",
                                          json={"messages": [{"role": "user", "content": "hi"}]}),
                       "progress": srv.metric("jds41:model_load_progress")}
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def wait_idle(server, within: float) -> float:
    """Seconds until both gauges read 0; fails after `within`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if server.metric("jds41:num_requests_running") == 0 and server.metric("jds41:num_requests_waiting") == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"gauges still not 0 after {within} s")


def test_loading_is_observable(server):
    health = server.loading["health"]
    assert health.status_code == 503 and int(health.headers["retry-after"]) > 0
    body = health.json()
    assert body["error"]["type"] == "unavailable_error" and body["status"] == "reading"
    assert body["load"]["phase"] == "reading" and body["load"]["bytes_total"] > 0
    assert 0 <= body["load"]["bytes_done"] <= body["load"]["bytes_total"]
    assert server.loading["models"].json()["data"][0]["status"] == "loading"
    chat = server.loading["chat"]
    assert chat.status_code == 503 and chat.json()["error"]["type"] == "unavailable_error"
    assert "retry-after" in chat.headers and "loading" in chat.json()["error"]["message"]
    assert server.loading["progress"] < 1
    ready = httpx.get(server.url + "/health").json()
    assert ready["load"]["bytes_done"] == ready["load"]["bytes_total"] == body["load"]["bytes_total"]
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["status"] == "loaded"
    assert server.metric("jds41:model_load_progress") == 1


def test_ping_comments_while_waiting():
    async def slow():
        await asyncio.sleep(0.25)
        yield "a"
        yield "b"

    async def collect():
        return [x async for x in with_pings(slow(), 0.05)]

    out = asyncio.run(collect())
    assert out[-2:] == ["a", "b"] and out.count(PING) >= 3 and set(out[:-2]) == {PING}


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_slot_within_1s(server, stream):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # decoding, seconds of work left
                assert server.metric("jds41:num_requests_running") == 1
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=LONG, timeout=0.5)
    assert wait_idle(server, within=1.0) < 1.0
    assert server.metric("jds41:request_success_total", 'finished_reason="abort"') >= 1


@pytest.mark.slow
def test_abandoned_requests_then_fresh_one(server):
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss
    aborts_before = server.metric("jds41:request_success_total", 'finished_reason="abort"')

    async def abandon(c: httpx.AsyncClient, i: int) -> None:
        body = {**LONG, "stream": i % 2 == 0, "prompt": [5 + i % 50, 6, 7]}
        # A total deadline, as a client's request timeout is: httpx's own timeouts are per read, which a stream
        # that keeps sending never hits.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await c.post("/v1/completions", json=body)

    async def run() -> None:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as c:
            await asyncio.gather(*(abandon(c, i) for i in range(200)))

    asyncio.run(run())
    t0 = time.monotonic()
    fresh = httpx.post(server.url + "/v1/chat/completions", timeout=5,
                       json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 8})
    assert fresh.status_code == 200 and time.monotonic() - t0 < 5
    wait_idle(server, within=5.0)
    aborts = server.metric("jds41:request_success_total", 'finished_reason="abort"') - aborts_before
    assert aborts > 0  # how many reached the server before their client gave up depends on the machine's load
    assert proc.memory_info().rss - rss_before < 256 << 20


def test_metrics_exact_after_n_requests(server):
    def counters() -> dict:
        names = [("jds41:prompt_tokens_total", ""), ("jds41:generation_tokens_total", ""),
                 ("jds41:request_success_total", 'finished_reason="stop"'),
                 ("jds41:request_success_total", 'finished_reason="length"'),
                 ("jds41:time_to_first_token_seconds_count", ""), ("jds41:e2e_request_latency_seconds_count", ""),
                 ("jds41:request_queue_time_seconds_count", "")]
        return {f"{n}{{{lab}}}" if lab else n: server.metric(n, lab) for n, lab in names}

    before = counters()
    requests = [("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 5}),
                ("/v1/completions", {"prompt": "hello there", "max_tokens": 3, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 2,
                                          "stream": True})]
    usages, reasons = [], []
    for path, body in requests:
        body = {**body, "temperature": 0}
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            events = sse_events(httpx.post(server.url + path, json=body, timeout=60).text.splitlines())
            usages.append(events[-2]["usage"])
            reasons += [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]]
        else:
            res = httpx.post(server.url + path, json=body, timeout=60).json()
            usages.append(res["usage"])
            reasons.append(res["choices"][0]["finish_reason"])
    wait_idle(server, within=2.0)
    after = counters()
    delta = {k: after[k] - before[k] for k in before}
    n = len(requests)
    assert delta["jds41:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert delta["jds41:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert delta['jds41:request_success_total{finished_reason="stop"}'] == reasons.count("stop")
    assert delta['jds41:request_success_total{finished_reason="length"}'] == reasons.count("length")
    for hist in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert delta["jds41:" + hist] == n, hist
    text = httpx.get(server.url + "/metrics").text
    for name in ("kv_cache_usage_perc", "prefix_cache_queries_total", "spec_decode_num_draft_tokens_total",
                 'expert_lookups_total{model_name="tiny-l1",tier="ssd"}', "ssd_read_bytes_total",
                 "engram_rows_read_total", "prefetch_correct_total", "router_lean_swaps_total",
                 "inter_token_latency_seconds_bucket"):
        assert "jds41:" + name in text, name


# ---- processes that must not start ----------------------------------------------------------------------------
def run_cli(tmp_path_factory, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jds41.serve", *args, "--port", str(free_port())]
    return subprocess.run(cmd, cwd=REPO, env=server_env(tmp_path_factory), capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("damage", ["truncated", "misshapen"])
def test_broken_model_exits_nonzero_naming_the_tensor(tmp_path_factory, tmp_path, damage):
    valid = tiny_model(tmp_path_factory)
    data, header = valid.read_bytes(), read_header(valid)
    if damage == "truncated":
        broken, expect = data[:int(len(data) * 0.6)], "extends past the end of the file"
        tensor = None  # the first tensor past the cut, whichever that is
    else:
        t = next(t for t in header.tensors if t.name == "blk.0.attn_q_a_norm.weight")
        broken, expect, tensor = patch(data, tensor_field(header, t.name, "ne0"), "Q", t.ne[0] * 2), "shape", t.name
    path = write_bytes(tmp_path / f"{damage}.gguf", broken)
    res = run_cli(tmp_path_factory, str(path))
    assert res.returncode == 1, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("jds41.serve: error: cannot load the model:") and str(path) in line and expect in line
    assert "tensor '" in line and (tensor is None or tensor in line)
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args,message", [
    (["--profile", "nope"], "unknown profile 'nope'; shipped profiles:"),
    (["--profile", "/nonexistent/profile.json"], "/nonexistent/profile.json"),
    (["--draft", "/nonexistent/draft.gguf"], "draft file not found: /nonexistent/draft.gguf"),
    (["--slots", "0"], "--slots 0"),
    (["--decode-width", "0"], "--decode-width 0: expected an integer >= 1"),
    (["--prompt-width", "1"], "--prompt-width 1: expected 0"),
])
def test_unusable_arguments_exit_2(tmp_path_factory, args, message):
    res = run_cli(tmp_path_factory, str(tiny_model(tmp_path_factory)), *args, timeout=30)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    missing = run_cli(tmp_path_factory, "/nonexistent/model.gguf", timeout=30)
    assert missing.returncode == 2 and "model file not found" in missing.stderr
