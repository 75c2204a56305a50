"""Text <-> token ids from the tokenizer a GGUF file carries, read the way llama.cpp reads it.

Owns `tokenizer.ggml.*`: `Tokenizer.from_metadata(meta)` builds a Hugging Face `tokenizers` BPE (vocab + merges,
byte-level pre-tokenizer and decoder) for `model == "gpt2"` and returns None for `model == "none"` (test files
that only have `{arch}.vocab_size`: callers then take and give token ids). `StreamDecoder` turns generated ids into
text pieces that never split a UTF-8 character. Chat templates live in chat.py.

Token types follow llama.cpp (`tokenizer.ggml.token_type`):
- NORMAL tokens are stored in GPT-2's byte-to-unicode form and stand for the bytes that form maps back to.
- CONTROL and UNKNOWN tokens are special: never split, matched in text only when `parse_special` (as llama.cpp's
  `parse_special`), and decode to their own text. USER_DEFINED tokens are stored as plain text and always matched
  whole, like llama.cpp. BYTE tokens `<0xAB>` stand for that byte (SentencePiece-style vocabs only).
"""

from __future__ import annotations

import codecs
import functools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jds41.chat import ChatTemplate
from jds41.errors import ConfigError, Jds41Error

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (UNKNOWN, CONTROL)
_TEXT_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)  # stored as their literal text, not byte-mapped

# `tokenizer.ggml.pre` -> the regex splits applied (in order, each to every piece the previous left) before the
# byte-level mapping. None means GPT-2's own regex, which the ByteLevel pre-tokenizer applies itself. The
# deepseek-v3 chain is what DeepSeek V3/V4 tokenizer.json files and llama.cpp's DEEPSEEK3_LLM use: digits in groups
# of at most three, CJK runs isolated, then a GPT-2-like split that keeps a leading punctuation mark on a word.
PRE_TOKENIZERS: dict[str, tuple[str, ...] | None] = {
    "gpt2": None,
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
         r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    ),
}


class InvalidTokenError(Jds41Error, ValueError):
    """A token id outside the vocabulary (a request error: the server answers 400)."""


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes map to themselves, the other 68
    (controls, space, NBSP, soft hyphen) to U+0100 onwards, so every byte string is a visible, splittable str."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def _normal_token_bytes(text: str) -> bytes:
    # A character outside the map cannot come from a byte-level vocab; keep its UTF-8 rather than fail, as the
    # tokenizers ByteLevel decoder does (llama.cpp prints a placeholder instead).
    inverse = _unicode_to_byte()
    out = bytearray()
    for ch in text:
        b = inverse.get(ch)
        out += ch.encode("utf-8") if b is None else bytes((b,))
    return bytes(out)


def _piece_bytes(text: str, kind: int) -> bytes:
    if kind in _TEXT_TYPES:
        return text.encode("utf-8")
    if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes((int(text[3:5], 16),))
    return _normal_token_bytes(text)


def _as_list(meta: Mapping[str, Any], key: str, path: str, item: type, required: bool = True) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise ConfigError(path, key, "required key not found")
        return None
    try:
        values = list(value)  # GGUF arrays may arrive as lists, tuples or numpy arrays
        if item is int:
            return [operator.index(v) for v in values]
    except TypeError:
        raise ConfigError(path, key, "expected an array of integers" if item is int else "expected an array") from None
    if any(not isinstance(v, str) for v in values):
        raise ConfigError(path, key, "expected an array of strings")
    return values


def _optional_id(meta: Mapping[str, Any], key: str, path: str, n: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    try:
        index = operator.index(value)
    except TypeError:
        raise ConfigError(path, key, f"expected an integer token id, got {type(value).__name__}") from None
    if isinstance(value, bool) or not 0 <= index < n:
        raise ConfigError(path, key, f"token id {value!r} outside the vocabulary [0, {n})")
    return index


def _pre_tokenizer(pre: str):
    splits = PRE_TOKENIZERS[pre]
    if splits is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in splits]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class Tokenizer:
    """A GGUF file's byte-level BPE tokenizer. Build with `from_metadata`; immutable afterwards, so one instance
    serves every request thread."""

    def __init__(self, backend: HFTokenizer, tokens: list[str], types: list[int], bos_id: int | None,
                 eos_id: int | None, pad_id: int | None, add_bos: bool, pre: str, chat: ChatTemplate):
        self.backend = backend  # the `tokenizers.Tokenizer`, for code that wants one (engram_hash.tokenizer_token_map)
        self._tokens, self._types = tokens, types
        self._pieces = [_piece_bytes(t, k) for t, k in zip(tokens, types, strict=True)]
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos, self.pre, self.chat = add_bos, pre, chat

    # ---- construction --------------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], path: str = "<metadata>") -> Tokenizer | None:
        """Tokenizer of a GGUF's metadata (plain key -> value), or None when the file has none (`model == "none"`).

        Raises ConfigError naming the key for a missing model key (llama.cpp refuses such files too), an
        unsupported tokenizer model or pre-tokenizer, inconsistent arrays or a broken chat template."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ConfigError(path, "tokenizer.ggml.model", "required key not found")
        if model == "none":
            return None
        if model != "gpt2":
            raise ConfigError(path, "tokenizer.ggml.model", f"unsupported tokenizer model {model!r} (need 'gpt2')")
        # A missing pre key means GPT-2 splitting; llama.cpp would warn and fall back to its own 'default' split.
        pre = meta.get("tokenizer.ggml.pre") or "gpt2"
        if pre not in PRE_TOKENIZERS:
            raise ConfigError(path, "tokenizer.ggml.pre", f"unsupported pre-tokenizer {pre!r} "
                              f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")

        tokens = _as_list(meta, "tokenizer.ggml.tokens", path, str)
        n = len(tokens)
        types = _as_list(meta, "tokenizer.ggml.token_type", path, int, required=False) or [NORMAL] * n
        if len(types) != n:
            raise ConfigError(path, "tokenizer.ggml.token_type", f"{len(types)} entries for {n} tokens")
        merges = []
        for m in _as_list(meta, "tokenizer.ggml.merges", path, str):
            # Split at the first space after the first character, as llama.cpp does: byte-level pieces never
            # hold a literal space (it is 'Ġ'), but the first piece may in other vocabs.
            cut = m.find(" ", 1)
            if cut < 0:
                raise ConfigError(path, "tokenizer.ggml.merges", f"merge {m!r} is not 'left right'")
            merges.append((m[:cut], m[cut + 1:]))

        # First occurrence wins for duplicated strings: the later id stays decodable through token_bytes.
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        try:
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        except Exception as e:  # tokenizers raises a bare Exception for merges naming unknown tokens
            raise ConfigError(path, "tokenizer.ggml.merges", f"BPE model rejected the vocab/merges: {e}") from e
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # The strings are already in vocab, so these keep their GGUF ids; registering them is what makes them
        # atomic (never reached by BPE merges, never split by the pre-tokenizer).
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types, strict=True) if k in _SPECIAL_TYPES])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])

        bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", path, n)
        eos_id = _optional_id(meta, "tokenizer.ggml.eos_token_id", path, n)
        pad_id = _optional_id(meta, "tokenizer.ggml.padding_token_id", path, n)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
        chat = ChatTemplate.from_metadata(meta, tokens[bos_id] if bos_id is not None else "",
                                          tokens[eos_id] if eos_id is not None else "", path)
        return cls(backend, tokens, types, bos_id, eos_id, pad_id, add_bos, pre, chat)

    @functools.cached_property
    def _literal_backend(self) -> HFTokenizer:
        # A second backend that reads special-token text as plain text (parse_special=False). Kept separate
        # because `encode_special_tokens` is mutable state on the shared object; built on first use only.
        other = HFTokenizer.from_str(self.backend.to_str())
        other.encode_special_tokens = True
        return other

    # ---- queries -------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def chat_template_source(self) -> str:
        """"gguf" when the file carries its template, "default-deepseek-v4" for the built-in one."""
        return self.chat.origin

    def _check(self, token_id: int) -> int:
        if isinstance(token_id, bool) or not 0 <= int(token_id) < len(self._tokens):
            raise InvalidTokenError(f"token id {token_id!r} outside the vocabulary [0, {len(self._tokens)})")
        return int(token_id)

    def is_special(self, token_id: int) -> bool:
        """Control (and unknown) tokens: BOS, EOS, role markers. They are matched in text only with
        parse_special and dropped by decode(skip_special=True)."""
        return self._types[self._check(token_id)] in _SPECIAL_TYPES

    def token_type(self, token_id: int) -> int:
        return self._types[self._check(token_id)]

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the file (byte-level form for normal tokens)."""
        return self._tokens[self._check(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for (control and user-defined tokens: their text as UTF-8). A byte
        token of a multi-byte character gives an incomplete UTF-8 sequence; use StreamDecoder to print."""
        return self._pieces[self._check(token_id)]

    # ---- text <-> ids --------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_bos None follows `tokenizer.ggml.add_bos_token`; no second BOS is added when
        the text already starts with the BOS token (chat templates usually write it themselves). parse_special
        False reads control-token text as plain text (user content that must not inject role markers)."""
        backend = self.backend if parse_special else self._literal_backend
        ids = backend.encode(text, add_special_tokens=False).ids
        wants_bos = (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None
        if wants_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 become U+FFFD (only at the edges of a cut stream)."""
        return self._join(ids, skip_special).decode("utf-8", errors="replace")

    def _join(self, ids: Iterable[int], skip_special: bool) -> bytes:
        pieces = self._pieces
        if skip_special:
            return b"".join(pieces[i] for i in map(self._check, ids) if self._types[i] not in _SPECIAL_TYPES)
        return b"".join(pieces[self._check(i)] for i in ids)

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Prompt text of an OpenAI-style conversation (the file's template, else the DeepSeek V4 default).
        Raises chat.ChatTemplateError for messages the template cannot or will not render."""
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt, **extra)


class StreamDecoder:
    """Incremental detokenization for streaming: `feed(id)` returns the text that is complete so far.

    Bytes of a UTF-8 sequence that a later token may still complete are held back, so no piece ever ends inside
    a character (a byte-level vocab splits rare characters and emoji across tokens). `flush()` ends the stream and
    gives what is held, with U+FFFD for a sequence that never completed. For ids whose bytes are valid UTF-8,
    the pieces joined equal `Tokenizer.decode(ids)`: Python's incremental UTF-8 decoder replaces invalid bytes
    exactly as a one-shot decode does, wherever the input is cut."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok, self._skip_special = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])

    def flush(self) -> str:
        """End of stream: the held bytes (as U+FFFD when incomplete); the decoder is then empty and reusable."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
