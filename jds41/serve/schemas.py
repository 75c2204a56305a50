"""Request bodies of the HTTP API as pydantic models (OpenAI field names; llama.cpp/vLLM extras where useful).

Validation is strict: a string where a number belongs, a bool for an int, NaN or infinity, or a null for a required
field is a 400 naming the field, never a coercion and never a 500 later in the engine. Unknown fields are ignored,
because agent clients send many (`user`, `metadata`, `parallel_tool_calls`, ...). Fields named by SERVING.md as
"later" (tools, tool_calls, reasoning_content, response_format) are accepted in their OpenAI shapes so the schemas
leave room; `response_format` other than text is refused until it is implemented.

This module must not import jax or the engine: tools and tests import it on machines without an accelerator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MAX_STOP = 16  # stop strings per request; each is searched in every piece of text
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
SEED_LIMIT = 2**64

StopString = Annotated[str, StringConstraints(min_length=1, max_length=512)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ContentPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported (text only)")
        if self.text is None:
            raise ValueError("a text content part needs a string 'text'")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: a plain dict with string content (developer -> system)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both generation endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off (llama.cpp and vLLM spell "off" differently)
    seed: int | None = Field(None, ge=-1, lt=SEED_LIMIT)  # -1: random, as in llama.cpp
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    # Accepted so clients that always send them work; not applied (no penalties in the sampler yet).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def seed_value(self) -> int | None:
        return None if self.seed is None or self.seed < 0 else self.seed


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise ValueError(f"response_format {fmt!r} is not supported yet (only 'text')")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def n_logprobs(self) -> int:
        """-1: none; 0: the chosen token's only; k: with the top k."""
        return (self.top_logprobs or 0) if self.logprobs else -1


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) != 1:
            raise ValueError("prompt: batched prompts are not supported (send one prompt per request)")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p

    def token_limit(self) -> int | None:
        return self.max_tokens

    def n_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs


class TokenizeRequest(_Strict):
    """llama.cpp's `content` or vLLM's `prompt` (text), or vLLM's `messages` (rendered by the chat template)."""

    model: str | None = None
    content: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special: bool = True  # follow the file's add_bos; false never adds BOS
    add_generation_prompt: bool = True
    with_pieces: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        given = [k for k in ("content", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'content', 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
