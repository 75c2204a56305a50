"""Generated ids -> text pieces a client may see, and the Server-Sent Events framing they travel in.

`TextAssembler` is shared by the streaming and the non-streaming paths, so both give the same text by construction:
- ids become text through the tokenizer's StreamDecoder, which holds the bytes of an unfinished UTF-8 character,
  so no piece ever ends inside one (special tokens such as EOS or role markers are dropped from the text);
- stop strings are matched on text, not tokens (a stop string rarely lines up with token edges): text that could
  still turn out to be the start of a stop string is held back until it cannot, so the stop string itself never
  reaches the client, even when it arrives split over several tokens.

`with_pings` interleaves `: ping` comments into an event stream while nothing arrives (a long prompt, a full queue),
because clients and proxies drop connections that stay silent for tens of seconds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from starlette.responses import StreamingResponse

PING = object()  # what with_pings yields when the interval passed without an event
PING_BYTES = b": ping\n\n"
DONE_BYTES = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _top_pairs(top: Any) -> list[tuple[int, float]]:
    """A Token's `top` as (id, logprob) pairs, whatever container the scheduler used."""
    if top is None:
        return []
    if isinstance(top, dict):
        return [(int(k), float(v)) for k, v in top.items()]
    return [(int(k), float(v)) for k, v in top]


class TextAssembler:
    """Feed generated ids in order; get the text that may be sent now. One per request."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), n_logprobs: int = -1):
        self._tok = tokenizer
        self._dec = tokenizer.stream(skip_special=True)
        self._stops = [s for s in stops if s]
        self._n_logprobs = n_logprobs
        self._held = ""  # text that may be the start of a stop string
        self._logprobs: list[dict] = []  # entries of tokens whose text has not been handed out yet
        self.n_tokens = 0
        self.stopped = False  # a stop string matched: the caller cancels generation

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._tok.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _entry(self, token_id: int, logprob: float | None, top: Any) -> dict:
        text, raw = self._piece(token_id)
        entry = {"id": token_id, "token": text, "bytes": raw, "logprob": float(logprob or 0.0), "top": []}
        for tid, lp in _top_pairs(top)[:max(self._n_logprobs, 0)]:
            t_text, t_raw = self._piece(tid)
            entry["top"].append({"id": tid, "token": t_text, "bytes": t_raw, "logprob": lp})
        return entry

    def feed(self, token_id: int, logprob: float | None = None, top: Any = None) -> str:
        """Text released by this token ("" while held back). After a stop string matched, feeding is a no-op."""
        if self.stopped:
            return ""
        self.n_tokens += 1
        if self._n_logprobs >= 0:
            self._logprobs.append(self._entry(token_id, logprob, top))
        return self._scan(self._dec.feed(token_id))

    def finish(self) -> str:
        """End of generation: everything still held (no stop string can complete any more)."""
        if self.stopped:
            return ""
        out = self._scan(self._dec.flush())
        if not self.stopped:
            out, self._held = out + self._held, ""
        return out

    def take_logprobs(self) -> list[dict]:
        out, self._logprobs = self._logprobs, []
        return out

    def _scan(self, piece: str) -> str:
        if not self._stops:
            return piece
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)]
        keep = self._hold_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def chat_logprobs(entries: Iterable[dict]) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                                          for t in e["top"]]} for e in entries]}


def completion_logprobs(entries: Sequence[dict], offset: int) -> dict:
    """OpenAI legacy completions `logprobs`: parallel lists; `offset` is the text length before these tokens."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": offsets}


async def with_pings(events: AsyncIterator, interval: float) -> AsyncIterator:
    """Items of `events`, with PING yielded each time `interval` seconds pass without one.

    The pending `anext` is a task awaited with a timeout instead of `asyncio.wait_for`: a timeout must not cancel
    it, since cancelling an async generator's step closes the generator."""
    it = aiter(events)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield PING
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that runs `on_close` however it ends. The body generator's own `finally`
    is not enough: a generator that never started (the client left before the first chunk) never runs it."""

    def __init__(self, content: AsyncIterator[bytes], on_close, headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
