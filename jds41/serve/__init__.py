"""`python -m jds41.serve`: an OpenAI-compatible HTTP server for one model (shared/docs/SERVING.md is the spec).

Layout, one concern per module:
- `__main__.py`: the command line; binds the port at once, exits non-zero when the model fails to load.
- `app.py`: `create_app(model_path, options)`, the FastAPI app with the small endpoints (health, models, props,
  metrics, tokenize); `completions.py`: the two generation endpoints.
- `loader.py`: loads the model in a background thread and reports progress for /health.
- `schemas.py`: pydantic request models (no jax import: a client tool may import them).
- `errors.py`: the OpenAI error shape and the exception handlers that keep bad input from ever becoming a 500.
- `streaming.py`: text assembly (UTF-8 safe, stop strings held back) and Server-Sent Events framing with pings.
- `metrics.py`: Prometheus text under the `jds41:` names.

This file holds only `ServeOptions`, so that importing any module of the package stays cheap.
"""

from __future__ import annotations

import dataclasses

DEFAULT_PROFILE = "all-hbm"  # every weight in device memory: the resident model, its slots batched in one step


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """Everything the command line decides; `create_app` takes it whole."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    ctx: int | None = None  # context per slot; None = min(model context, the engine's default)
    slots: int = 4
    max_queue: int = 64
    profile: str = DEFAULT_PROFILE
    draft: str | None = None
    ping_s: float = 15.0  # SSE comment interval while a request waits (clients and proxies time out idle streams)
    load_delay_s: float = 0.0  # test hook: hold the load this long so the loading state can be observed
    warmup: bool = True  # compile the model's programs before /health turns 200
    prefill_chunk: int = 4096  # tokens per layer-major prefill group (jds41/prefill.py); 0 = token-major only
    prefill_budget: int | None = None  # prompt tokens fed per scheduler iteration; None = default_prefill_budget
    decode_width: int = 1  # the engine's row width (jds41/block_step.py); --draft's block size + 1 verifies batched
    prompt_width: int = 0  # R >= 2: prompts read in R-row blocks with grouped experts (ModelPlan.prompt_width)
    prefix_cache_bytes: int = 0  # host-memory budget of the prefix cache (jds41/prefix_cache.py); 0 = off
    prefix_cache_dir: str | None = None  # keep prefix snapshots here too, across restarts
    compile_cache: str | None = None  # compiled programs kept across restarts (jds41/compile_cache.py); "off" = none
    numerics: str = "jds41"  # Engine.open's activation numerics (jds41/numerics.py)
