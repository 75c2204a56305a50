"""`create_app(model_path, options)`: the FastAPI app of `python -m jds41.serve`.

The app answers from the moment it exists: the lifespan starts the model load in a background thread (loader.py)
and /health, /v1/models and /metrics report it; every endpoint that needs the model answers 503 with Retry-After
until it is ready. Owns the small endpoints (health, models, props, metrics, tokenize, detokenize) and the API key
check; the generation endpoints live in completions.py.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from jds41.serve import ServeOptions, errors
from jds41.serve.completions import chat_prompt
from jds41.serve.completions import router as completions_router
from jds41.serve.errors import APIError, unavailable
from jds41.serve.loader import ModelLoader
from jds41.serve.metrics import CONTENT_TYPE, ServerMetrics
from jds41.serve.schemas import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("jds41.serve")
PUBLIC_PATHS = ("/health",)  # load balancers and supervisors poll it without credentials
CLAMP_NOTE = ("max_tokens (or max_completion_tokens) past the remaining context (n_ctx - prompt tokens) is clamped "
              "to it; a request that reaches the clamp ends with finish_reason \"length\". Without max_tokens a "
              "request may use the whole remaining context.")


def _build_info() -> dict:
    try:
        version = metadata.version("jds41")
    except metadata.PackageNotFoundError:
        version = "unknown"
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], check=False, cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=2)
        commit = out.stdout.strip() or None
    return {"version": version, "commit": commit}


class ServerState:
    """What the handlers share: options, the loader (engine and scheduler once ready), metrics, names."""

    def __init__(self, model_path: str, options: ServeOptions, loader: ModelLoader):
        self.model_path, self.options, self.loader = model_path, options, loader
        path = Path(model_path)
        self.model_id = path.name.removesuffix(".gguf") if path.suffix == ".gguf" else path.name
        # Clients send what /v1/models lists, but also the file name or the path they started the server with.
        self.model_names = {self.model_id, path.name, str(model_path)}
        self.metrics = ServerMetrics(self.model_id, loader)
        self.build = _build_info()
        self.fingerprint = f"jds41-{self.build['version']}-{self.build['commit'] or 'nogit'}"

    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.model_id!r}",
                           "not_found_error", "model", "model_not_found")

    def require_ready(self) -> None:
        ld = self.loader
        if ld.phase == "failed":
            raise unavailable(f"the model failed to load: {ld.error}", "model_load_failed")
        if not ld.ready:
            p = ld.progress()
            raise unavailable(f"the model is loading (phase {p['phase']}, {100 * p['progress']:.0f}%); retry "
                              f"after a few seconds", "model_loading")

    def require_tokenizer(self):
        self.require_ready()
        tok = self.loader.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model file has no tokenizer (tokenizer.ggml.model = none): it cannot be "
                           "served over text endpoints")
        return tok


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but /health. Pure ASGI, so it checks before the body is read
    and never wraps (or buffers) a streaming response."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(model_path: str, options: ServeOptions | None = None,
               on_load_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The server app for one model. `on_load_failure(message)` runs (in the loader thread) when the model cannot
    be loaded; the command line uses it to end the process non-zero."""
    options = options or ServeOptions()
    loader = ModelLoader(str(model_path), options, on_load_failure)
    srv = ServerState(str(model_path), options, loader)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        loader.start()
        try:
            yield
        finally:
            loader.stop()

    app = FastAPI(title="jds41", version=srv.build["version"], lifespan=lifespan)
    app.state.server = srv
    errors.install(app)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    app.include_router(completions_router)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if loader.ready else loader.phase, "model": srv.model_id, "load": loader.progress()}
        if loader.ready:
            return JSONResponse(body)
        try:
            srv.require_ready()
        except APIError as e:
            return JSONResponse({**body, **e.body()}, status_code=503, headers=e.headers)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        eng = loader.engine
        status = "loaded" if loader.ready else "failed" if loader.phase == "failed" else "loading"
        ctx = eng.max_ctx if eng is not None else None
        return JSONResponse({"object": "list", "data": [{
            "id": srv.model_id, "object": "model", "created": int(loader.started_at), "owned_by": "jds41",
            "status": status, "context_length": ctx, "max_model_len": ctx, "load": loader.progress()}]})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/props")
    async def props() -> JSONResponse:
        srv.require_ready()
        import jax

        eng = loader.engine
        tok = eng.tokenizer
        total = sum(os.path.getsize(p) for p in {s.path for s in eng.gguf.shards})
        return JSONResponse({
            "model": srv.model_id, "model_path": srv.model_path, "n_ctx": eng.max_ctx,
            "n_ctx_train": eng.cfg.context_length, "total_slots": options.slots, "max_queue": options.max_queue,
            "vocab_size": eng.vocab_size,
            "chat_template": tok.chat.source if tok is not None else None,
            "chat_template_source": tok.chat_template_source if tok is not None else None,
            "profile": options.profile, "draft": options.draft, "tiers": _tier_bytes(eng, total),
            "decode_width": eng.plan.decode_width, "prompt_width": eng.plan.prompt_width,
            "max_tokens_clamping": CLAMP_NOTE,
            "build": {**srv.build, "jax": jax.__version__, "backend": jax.default_backend()},
            "load_seconds": round(loader.ready_at - loader.started_at, 3) if loader.ready_at else None,
            "default_generation_settings": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": None},
        })

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        srv.check_model(body.model)
        tok = srv.require_tokenizer()
        if body.messages is not None:
            ids = chat_prompt(tok, body.messages, add_generation_prompt=body.add_generation_prompt)
        else:
            text = body.content if body.content is not None else body.prompt
            ids = tok.encode(text, add_bos=None if body.add_special else False)
        tokens = [{"id": i, "piece": tok.token_bytes(i).decode("utf-8", "replace")} for i in ids] \
            if body.with_pieces else ids
        return JSONResponse({"tokens": tokens, "count": len(ids), "max_model_len": loader.engine.max_ctx})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        srv.check_model(body.model)
        tok = srv.require_tokenizer()
        bad = next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {tok.vocab_size})",
                           param="tokens")
        text = tok.decode(body.tokens)
        return JSONResponse({"content": text, "prompt": text})

    return app


def _tier_bytes(engine, file_bytes: int) -> dict:
    """Where the model's bytes are: the whole file in device memory for the resident all-hbm placement, else the
    routed experts' bytes per tier as the profile placed them (dense weights and shared experts sit in HBM)."""
    tiers = engine.tiers
    if tiers is None:
        return {"hbm_bytes": file_bytes, "host_bytes": 0, "ssd_bytes": 0,
                "note": "all weights resident in device memory"}
    hbm, host, ssd = (int(b) for b in tiers.placement.tier_bytes)
    return {"hbm_bytes": hbm, "host_bytes": host, "ssd_bytes": ssd, "profile": tiers.profile.name,
            "note": "routed expert bytes per tier; dense weights and shared experts are in device memory"}
