"""Chat templates: OpenAI-style messages -> the prompt text a model was trained on.

Owns the Jinja side of the tokenizer: the template a GGUF carries in `tokenizer.chat_template` (rendered the way
Hugging Face `apply_chat_template` and llama.cpp's Jinja path render it), and the DeepSeek V4 format written here
for files that carry none. `Tokenizer` (tokenizer.py) builds one `ChatTemplate` per model; the server reports
`origin` in /props so a client can tell a file's own template from the fallback.

Templates come from model files, i.e. from strangers: they run in Jinja's immutable sandbox, are compiled once at
load (a syntax error is a bad model file, reported with the key), and a template that rejects a conversation
(`raise_exception`) or fails while rendering raises `ChatTemplateError`, which the server answers with a 400.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jds41.errors import ConfigError, Jds41Error

TEMPLATE_KEY = "tokenizer.chat_template"
ORIGIN_GGUF = "gguf"
ORIGIN_DEFAULT = "default-deepseek-v4"

# The DeepSeek V4 conversation format, for files without a template of their own:
#   <BOS>{system}<｜User｜>{user}<｜Assistant｜>{assistant}<EOS><｜User｜>...<｜Assistant｜>
# System messages wherever they appear are joined (blank line between) into the prefix after BOS, as DeepSeek's own
# templates do. A finished assistant turn ends with EOS; a trailing assistant message while a generation prompt is
# asked for is a prefill and stays open, so the model continues it instead of starting a new turn.
DEEPSEEK_V4_TEMPLATE = """\
{%- set ns = namespace(system='', seen=false) -%}
{%- for m in messages if m.role == 'system' -%}
  {%- set ns.system = (ns.system ~ '\\n\\n' if ns.seen else '') ~ (m.content or '') -%}
  {%- set ns.seen = true -%}
{%- endfor -%}
{{- bos_token ~ ns.system -}}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {{- '<｜User｜>' ~ (m.content or '') -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<｜Assistant｜>' ~ (m.content or '') -}}
    {%- if not (loop.last and add_generation_prompt) -%}{{- eos_token -}}{%- endif -%}
  {%- elif m.role != 'system' -%}
    {{- raise_exception('unsupported message role ' ~ (m.role | tojson)) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and (not messages or messages[-1].role != 'assistant') -%}
  {{- '<｜Assistant｜>' -}}
{%- endif -%}
"""


class ChatTemplateError(Jds41Error, ValueError):
    """The messages were malformed, or the template refused or failed to render them (a 400, not a 500)."""


class _TemplateRaised(Exception):
    """Carries a template's own `raise_exception` message out of Jinja untouched."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ' (it is meant for HTML pages); chat templates embed tool
    # schemas in prompt text, where those escapes would change what the model sees. This mirrors transformers.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks / lstrip_blocks and loop controls are what Hugging Face templates are written against; without
    # them most published templates emit stray newlines.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(content: Any, index: int) -> Any:
    """OpenAI content parts [{"type": "text", "text": ...}, ...] -> one string, joined by newlines as llama.cpp
    does for templates that expect plain strings; strings and None pass through (templates test for None)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"messages[{index}].content: expected a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate the shape every template relies on and return plain dict copies with string contents."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages: expected a list of message objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}]: expected an object")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role: expected a string")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), i)
        out.append(msg)
    return out


class ChatTemplate:
    """One compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, origin: str, bos_token: str, eos_token: str, path: str = "<metadata>"):
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            # Only a file's template can be broken; the built-in one is covered by tests.
            raise ConfigError(path, TEMPLATE_KEY, f"template does not compile: {e.message} (line {e.lineno})") from e

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], bos_token: str, eos_token: str,
                      path: str = "<metadata>") -> ChatTemplate:
        """The file's template when it has a non-empty one, else the built-in DeepSeek V4 format."""
        source = meta.get(TEMPLATE_KEY)
        if source is not None and not isinstance(source, str):
            raise ConfigError(path, TEMPLATE_KEY, f"expected a string, got {type(source).__name__}")
        if source and source.strip():
            return cls(source, ORIGIN_GGUF, bos_token, eos_token, path)
        return cls(DEEPSEEK_V4_TEMPLATE, ORIGIN_DEFAULT, bos_token, eos_token, path)

    def render(self, messages: Any, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for `messages`; `extra` (tools, enable_thinking, ...) is passed to the template as is."""
        msgs = normalize_messages(messages)
        variables = {**extra, "messages": msgs, "add_generation_prompt": bool(add_generation_prompt),
                     "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            return self._template.render(**variables)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # A template written for other inputs (or a sandbox violation) must not become a server error.
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
