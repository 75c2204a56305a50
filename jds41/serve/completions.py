"""The generation endpoints: `POST /v1/chat/completions` and `POST /v1/completions`, streaming or not.

Everything a request can get wrong is checked before it reaches the scheduler and before the first byte of a
stream (token ids, an empty prompt, the context size), so a stream that starts is a stream that can finish.
`max_tokens` past the remaining context is clamped to it; such a request ends with finish_reason "length".

Both paths consume the scheduler's events through one `Generation`, so stream and non-stream produce the same
text. A client that goes away cancels its request at once: Starlette cancels a streaming body when the client
disconnects, and a non-streaming request watches the connection itself while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jds41.chat import ChatTemplateError
from jds41.serve.errors import APIError, context_exceeded, unavailable
from jds41.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from jds41.serve.streaming import (
    DONE_BYTES,
    PING,
    PING_BYTES,
    EventStreamResponse,
    TextAssembler,
    chat_logprobs,
    completion_logprobs,
    sse,
    with_pings,
)

log = logging.getLogger("jds41.serve")
router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def chat_prompt(tokenizer, messages: list[ChatMessage], tools: list | None = None, template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of a conversation. A trailing assistant message is a prefill: the conversation before it is
    rendered with the generation prompt and its text appended, so the model continues it under any template."""
    rendered = [m.for_template() for m in messages]
    prefill = ""
    if add_generation_prompt and rendered[-1]["role"] == "assistant":
        if messages[-1].tool_calls:
            raise APIError(400, "messages: a trailing assistant message with tool_calls cannot be continued as a "
                           "prefill; end the conversation with the tool results or a user message", param="messages")
        prefill = rendered.pop()["content"]
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    return tokenizer.encode(text + prefill)


class Generation:
    """One request's events -> text pieces, finish reason and usage; books the request's metrics exactly once."""

    def __init__(self, srv, handle, assembler: TextAssembler, trace, n_prompt: int):
        self.srv, self.handle, self.asm, self.trace, self.n_prompt = srv, handle, assembler, trace, n_prompt
        self.reason: str | None = None
        self.error: str | None = None
        self.queue_s: float | None = None
        self.drafts = (0, 0)  # (draft tokens, accepted) of a drafted request (serve --draft)
        self.completion_tokens: int | None = None  # the scheduler's count (stop token included) once finished
        self.timings: dict = {}

    async def pieces(self) -> AsyncIterator:
        """Text pieces (never empty) and PING markers, until the request ends; then `reason` or `error` is set."""
        from jds41.scheduler import Failed, Finished, Token

        async with contextlib.aclosing(with_pings(self.handle.events(), self.srv.options.ping_s)) as events:
            async for ev in events:
                if ev is PING:
                    yield PING
                elif isinstance(ev, Token):
                    self.trace.token()
                    text = self.asm.feed(ev.id, ev.logprob, ev.top)
                    if text:
                        yield text
                    if self.asm.stopped:  # a stop string: the scheduler need not run this request any longer
                        self.handle.cancel()
                        self._end("stop")
                        return
                elif isinstance(ev, Finished):
                    self.queue_s, self.completion_tokens = ev.queue_s, ev.completion_tokens
                    self.drafts = (ev.draft_tokens, ev.draft_accepted)
                    tail = self.asm.finish()
                    if tail:
                        yield tail
                    self._end("length" if ev.reason == "length" else "stop" if ev.reason == "stop" else "abort")
                    return
                elif isinstance(ev, Failed):
                    self.error = ev.message
                    self._end("abort")
                    return
        if self.reason is None and self.error is None:
            self.error = "the scheduler ended the request without a result"
            self._end("abort")

    def _end(self, reason: str) -> None:
        self.reason = None if reason == "abort" and self.error else reason
        self.timings = self.trace.finish(reason, self.completion_tokens, self.queue_s, self.drafts)

    def close(self) -> None:
        """The client went away or the handler failed: free the slot and book an abort (no-op after an end)."""
        if not self.trace.done:
            self.handle.cancel()
            self.trace.finish("abort", None, self.queue_s)

    def usage(self) -> dict:
        n = self.asm.n_tokens if self.completion_tokens is None else self.completion_tokens
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n,
                "prompt_tokens_details": {"cached_tokens": getattr(self.handle, "cached_tokens", 0)}}


def _check_prompt(srv, prompt: list[int], param: str) -> None:
    engine = srv.loader.engine
    if not prompt:
        raise APIError(400, f"{param}: the prompt is empty", param=param)
    bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary [0, {engine.vocab_size})",
                       param=param)
    if len(prompt) >= engine.max_ctx:
        raise context_exceeded(len(prompt), engine.max_ctx, param)


def _start(srv, body, prompt: list[int], param: str) -> Generation:
    from jds41.engine import RequestError, SamplingParams
    from jds41.scheduler import ContextTooLong, GenRequest, Unavailable

    _check_prompt(srv, prompt, param)
    engine, scheduler = srv.loader.engine, srv.loader.scheduler
    room = engine.max_ctx - len(prompt)
    limit = body.token_limit()
    max_new = room if limit is None else min(limit, room)  # the clamp /props documents
    eos = engine.tokenizer.eos_id
    n_lp = body.n_logprobs()
    sampling = SamplingParams(body.temperature, body.top_p, max(body.top_k, 0), body.seed_value())
    # The scheduler's logprobs=n gives the sampled token's logprob with the top n; n_lp = 0 wants the first only.
    req = GenRequest(prompt, max_new, sampling, () if eos is None else (eos,), logprobs=max(n_lp, 1) if n_lp >= 0
                     else 0)
    try:
        handle = scheduler.submit(req, loop=asyncio.get_running_loop())
    except Unavailable as e:  # QueueFull, or the scheduler is stopping
        raise unavailable(f"the server cannot take the request now: {e}", "queue_full") from None
    except ContextTooLong as e:
        raise context_exceeded(e.n_prompt_tokens, e.n_ctx, param) from None
    except RequestError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    return Generation(srv, handle, TextAssembler(engine.tokenizer, body.stop_list(), n_lp),
                      srv.metrics.trace(len(prompt)), len(prompt))


async def _until_disconnect(request: Request) -> None:
    # The body was read already, so the next message uvicorn gives is the disconnect (or the response's end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, gen: Generation) -> str | None:
    """All text of a non-streaming request, or None when the client disconnected first."""
    parts: list[str] = []

    async def consume() -> None:
        async for piece in gen.pieces():
            if piece is not PING:
                parts.append(piece)

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return None
        work.result()
        return "".join(parts)
    finally:
        for task in (work, watch):
            task.cancel()
        gen.close()


def _failure(gen: Generation) -> APIError:
    return APIError(500, f"generation failed: {gen.error}", "server_error")


def _meta(srv, kind: str) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": srv.model_id,
            "system_fingerprint": srv.fingerprint}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    srv = request.app.state.server
    srv.check_model(body.model)
    tok = srv.require_tokenizer()
    gen = _start(srv, body, chat_prompt(tok, body.messages, body.tools, body.chat_template_kwargs), "messages")
    meta = _meta(srv, "chatcmpl")
    if body.stream:
        return EventStreamResponse(_chat_stream(gen, meta, body), gen.close, SSE_HEADERS)
    text = await _collect(request, gen)
    if text is None:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    if gen.error:
        raise _failure(gen)
    lp = chat_logprobs(gen.asm.take_logprobs()) if body.logprobs else None
    return JSONResponse({**meta, "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
         "finish_reason": gen.reason}], "usage": gen.usage(), "timings": gen.timings})


async def _chat_stream(gen: Generation, meta: dict, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
    def chunk(delta: dict, finish: str | None = None, entries: list | None = None) -> bytes:
        return sse({**meta, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": chat_logprobs(entries) if entries else None,
             "finish_reason": finish}]})

    async def body_pieces() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        async for piece in gen.pieces():
            yield PING_BYTES if piece is PING else chunk({"content": piece}, entries=gen.asm.take_logprobs())
        if gen.error:
            raise RuntimeError(gen.error)
        rest = gen.asm.take_logprobs()
        if rest:
            yield chunk({"content": ""}, entries=rest)
        yield chunk({}, gen.reason)
        if body.include_usage():
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage(),
                       "timings": gen.timings})

    async for data in _guarded(gen, body_pieces()):
        yield data


async def _guarded(gen: Generation, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream's chunks; a fault after the first chunk becomes a `data: {"error": ...}` event, then [DONE]."""
    try:
        async with contextlib.aclosing(chunks):
            async for data in chunks:
                yield data
        yield DONE_BYTES
    except Exception as e:  # the status line is sent already; the error must travel in-band
        if not isinstance(e, RuntimeError) or gen.error is None:
            log.exception("stream failed")
        message = f"generation failed: {gen.error}" if gen.error else f"internal error: {type(e).__name__}"
        yield sse(APIError(500, message, "server_error").body())
        yield DONE_BYTES
    finally:
        gen.close()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    srv = request.app.state.server
    srv.check_model(body.model)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        prompt = srv.require_tokenizer().encode(prompt)
    else:
        srv.require_tokenizer()  # generated ids are returned as text
    gen = _start(srv, body, list(prompt), "prompt")
    meta = _meta(srv, "cmpl")
    if body.stream:
        return EventStreamResponse(_completion_stream(gen, meta, body), gen.close, SSE_HEADERS)
    text = await _collect(request, gen)
    if text is None:
        return Response(status_code=499)
    if gen.error:
        raise _failure(gen)
    lp = completion_logprobs(gen.asm.take_logprobs(), 0) if body.logprobs is not None else None
    return JSONResponse({**meta, "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": lp, "finish_reason": gen.reason}],
        "usage": gen.usage(), "timings": gen.timings})


async def _completion_stream(gen: Generation, meta: dict, body: CompletionRequest) -> AsyncIterator[bytes]:
    offset = 0

    def chunk(text: str, finish: str | None = None) -> bytes:
        nonlocal offset
        entries = gen.asm.take_logprobs() if body.logprobs is not None else []
        lp = completion_logprobs(entries, offset) if body.logprobs is not None else None
        offset += len(text)
        return sse({**meta, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]})

    async def body_pieces() -> AsyncIterator[bytes]:
        async for piece in gen.pieces():
            yield PING_BYTES if piece is PING else chunk(piece)
        if gen.error:
            raise RuntimeError(gen.error)
        yield chunk("", gen.reason)
        if body.include_usage():
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": gen.usage(),
                       "timings": gen.timings})

    async for data in _guarded(gen, body_pieces()):
        yield data
