"""Helpers of the serve tests: a real `python -m jds41.serve` process on a free loopback port, and SSE parsing.

Every server of the suite serves the same one-layer tiny deepseek4 file with the same context and slot count, and
all of them share one persistent XLA compilation cache (in pytest's session temp dir): only the first server of a
session compiles, the others start in seconds. The subprocess runs from the repository root with it on
PYTHONPATH, so it imports this checkout whatever an editable install points at.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
CTX = 4096  # the tiny preset's full context: long generations (seconds) for the cancellation tests
SLOTS = 2
START_TIMEOUT_S = 180  # first compile of a session on 2 slow cores


def tiny_model(tmp_path_factory) -> Path:
    """The one-layer tiny deepseek4 (f32) every serve test uses, written once per session."""
    from jds41.checkpoints.presets import preset
    from jds41.checkpoints.synth import write_synthetic

    path = tmp_path_factory.getbasetemp() / "serve-models" / "tiny-l1.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp, preset("deepseek4", "tiny", layers=1), quant="f32", progress=False)
        tmp.rename(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.getbasetemp() / "serve-jax-cache"
    cache.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu"}


class Server:
    """`python -m jds41.serve MODEL --port P ARGS...`; stdout and stderr go to a log file."""

    def __init__(self, model: Path, args: list[str], env: dict[str, str], log: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log
        cmd = [sys.executable, "-m", "jds41.serve", str(model), "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log, "wb")  # noqa: SIM115 - open as long as the process runs
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_bound(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError(f"server did not bind in {timeout} s:\n{self.log()}")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log()}")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("jds41:request_success_total", 'finished_reason="stop"')."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{{{labels}}} not in /metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def start_server(tmp_path_factory, name: str, *args: str, api_key: str | None = None, ready: bool = True) -> Server:
    model = tiny_model(tmp_path_factory)
    log = tmp_path_factory.getbasetemp() / f"serve-{name}.log"
    srv = Server(model, ["--ctx", str(CTX), "--slots", str(SLOTS), *args], server_env(tmp_path_factory), log,
                 api_key)
    try:
        if ready:
            srv.wait_ready()
        else:
            srv.wait_bound()
    except BaseException:
        srv.stop()
        raise
    return srv


def sse_events(lines) -> list:
    """`data:` payloads of an SSE stream in order: parsed JSON objects, and the string "[DONE]". Comments
    (`: ping`) and blank lines are skipped; any other line is an error."""
    out = []
    for line in lines:
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_error_shape(resp: httpx.Response, status: int, type_: str | None = None) -> dict:
    """`resp` has `status` and an OpenAI error body; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str), err
    assert "param" in err and "code" in err, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err
