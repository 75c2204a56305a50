"""The synthetic tokenizer: a deterministic byte-level BPE with DeepSeek-V4-style special tokens, and its GGUF fields.

`build_tokenizer(vocab_size, compressed_vocab)` trains a BPE with the `tokenizers` library on text generated here
from a fixed seed, then extends it with merges of existing token pairs until it has exactly `vocab_size` tokens
whose Engram token map (engram_hash.compressed_token_map) has exactly `compressed_vocab` classes. Both counts
are fixed by the presets (the Engram multipliers depend on the second), and the full size reproduces the real V4
tokenizer's 129280 / 99092. Every added token is the concatenation of two existing tokens and comes with that
merge, so the result stays a valid BPE that llama.cpp's `gpt2` vocab loader accepts.

`gguf_fields(tok)` gives the `tokenizer.ggml.*` keys llama.cpp reads plus `tokenizer.huggingface.json`, so the
engine can rebuild the exact tokenizer (pre-tokenizer regexes included) from the file.
"""

from __future__ import annotations

import functools
import json

import numpy as np

# Fixed ids 0..7 in every size: bos 0 / eos 1 / pad 2 as in the real V4 vocab (Engram pad_id 2), then chat roles,
# thinking tags and the DSpark noise token of the tiny and small presets.
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>", "<｜noise｜>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# DeepSeek V3/V4 chat mode: bos, system text, user turns, assistant turns closed by eos; `</think>` after the
# assistant tag selects the non-thinking mode.
CHAT_TEMPLATE = (
    "{% if add_generation_prompt is not defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜></think>' + message['content'] + "
    "'<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜></think>' }}{% endif %}"
)

# DeepSeek V3's pre-tokenizer (llama.cpp pre type "deepseek-v3"): digits in groups of up to 3, CJK runs, then
# the word / punctuation / whitespace split; byte-level mapping without its own regex.
_PRE_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
     r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
)
GGUF_PRE = "deepseek-v3"

_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this",
    "are", "from", "at", "or", "an", "have", "not", "which", "but", "all", "they", "were", "can", "there", "been",
    "one", "has", "more", "their", "when", "will", "would", "what", "about", "so", "if", "out", "up", "some", "into",
    "time", "only", "new", "other", "could", "these", "two", "may", "first", "then", "do", "any", "like", "my",
    "now", "over", "such", "our", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before",
    "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each",
    "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own",
    "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same",
    "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against",
    "go", "came", "right", "used", "take", "three", "memory", "expert", "layer", "token", "model", "cache", "graph",
    "tensor", "decode", "prefill", "router")
_ACCENTED = ("café", "naïve", "résumé", "Zürich", "façade", "coöperate", "jalapeño", "Ångström", "über", "déjà",
    "señor", "crème")
_FOREIGN = ("東京", "日本語", "こんにちは", "カタカナ", "数据", "模型", "αβγ", "Ελληνικά", "русский", "текст")
_CODE = ("def f(x):\n    return x + 1\n", "for i in range(10):\n\tprint(i)\n", "if (a != b) { c = a * 2; }\n",
         "x = [1, 2, 3]  # list\n", "SELECT name FROM users WHERE id = 42;\n", "{\"key\": \"value\", \"n\": 3.14}\n")


def corpus(n_chars: int, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-English training text: Zipf-distributed real and invented words, capitals, accents,
    numbers, a little CJK / Greek / Cyrillic, code lines and varied whitespace, as lines of about 300 chars."""
    rng = np.random.default_rng(seed)
    cons, vows = list("bcdfghjklmnprstvwz") + ["th", "sh", "ch", "st", "tr"], list("aeiou") + ["ea", "ou", "io"]
    invented = ["".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.integers(1, 4))) for _ in range(3000)]
    lexicon = list(_WORDS) + invented
    cdf = np.cumsum(1.0 / np.arange(1, len(lexicon) + 1) ** 1.1)
    cdf /= cdf[-1]
    lines, total = [], 0
    while total < n_chars:
        n = int(rng.integers(20, 60))
        idx = np.minimum(np.searchsorted(cdf, rng.random(n)), len(lexicon) - 1)
        r, punct = rng.random(n), rng.random(n)
        words = []
        for j in range(n):
            w = lexicon[idx[j]]
            if j == 0 or r[j] < 0.05:
                w = w.capitalize()
            elif r[j] < 0.06:
                w = w.upper()
            elif r[j] < 0.08:
                w = str(int(r[j] * 1e7) % 100000) if punct[j] < 0.7 else f"{punct[j] * 100:.2f}"
            elif r[j] < 0.085:
                w = _ACCENTED[idx[j] % len(_ACCENTED)]
            elif r[j] < 0.088:
                w = _FOREIGN[idx[j] % len(_FOREIGN)]
            if punct[j] < 0.08:
                w += ",.;:!?"[int(punct[j] * 75) % 6]
            words.append(w)
        extra = rng.random(3)
        line = " ".join(words) + "." + ("\n\n" if extra[0] < 0.2 else "\n")
        if extra[1] < 0.1:
            line += _CODE[int(extra[1] * 1000) % len(_CODE)]
        if extra[2] < 0.05:
            line = line.replace(" ", "  ", 1)
        lines.append(line)
        total += len(line)
    return lines


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte -> printable-char table the ByteLevel pre-tokenizer uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decode_piece(piece: str) -> str:
    dec = _byte_decoder()
    return bytes(dec[c] for c in piece).decode("utf-8", errors="replace")


def _train(base_vocab: int, n_chars: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base_vocab, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(n_chars), trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int, compressed_vocab: int):
    """A `tokenizers.Tokenizer` with exactly `vocab_size` ids and `compressed_vocab` Engram token-map classes."""
    from tokenizers import Tokenizer

    from jds41.engram_hash import _normalizer, tokenizer_token_map

    # Train to ~70% of the target (corpus permitting) so the extension below has room to set the class count.
    base = max(len(SPECIAL_TOKENS) + 257, min(int(vocab_size * 0.7), 16384))
    tok = _train(base, n_chars=min(4_000_000, 400 * base))
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    pieces = sorted(vocab, key=vocab.get)
    norm = _normalizer()

    def key(piece: str) -> str:
        text = _decode_piece(piece)
        return piece if "\ufffd" in text else (norm.normalize_str(text) or text)

    keys = {key(p) if p not in SPECIAL_TOKENS else norm.normalize_str(p) for p in pieces}
    need_new = compressed_vocab - len(keys)
    if need_new < 0 or need_new > vocab_size - len(pieces):
        raise ValueError(f"cannot build {vocab_size} tokens / {compressed_vocab} classes from a base of "
                         f"{len(pieces)} tokens / {len(keys)} classes")

    def add(a: str, b: str) -> None:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        pieces.append(a + b)

    # New classes: concatenations of two word-like tokens, drawn deterministically.
    words = [p for p in pieces if p not in SPECIAL_TOKENS and "\ufffd" not in _decode_piece(p) and len(p) > 1]
    rng = np.random.default_rng(7)
    while need_new:
        a, b = words[int(rng.integers(len(words)))], words[int(rng.integers(len(words)))]
        if b.startswith("Ġ") or a + b in vocab or len(a + b) > 24:
            continue
        k = key(a + b)
        if k not in keys:
            keys.add(k)
            add(a, b)
            words.append(a + b)
            need_new -= 1
    # Fill the remaining ids with tokens of existing classes: a space or newline prefix is stripped by the Engram
    # normalizer, so "Ġ"+t falls into t's class.
    for prefix in ("Ġ", "Ċ", "ĉ", "ĠĠ", "ĊĊ"):
        if prefix not in vocab:
            continue
        for t in list(words):
            if len(vocab) >= vocab_size:
                break
            if t[0] in "ĠĊĉ" or prefix + t in vocab or key(prefix + t) not in keys:
                continue
            add(prefix, t)
    if len(vocab) != vocab_size:
        raise ValueError(f"synthetic tokenizer ran out of filler merges at {len(vocab)} of {vocab_size} tokens")
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = [list(m) for m in merges]
    out = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    n_classes = tokenizer_token_map(out)[1]
    if out.get_vocab_size(with_added_tokens=True) != vocab_size or n_classes != compressed_vocab:
        raise AssertionError(f"synthetic tokenizer: {out.get_vocab_size()} tokens / {n_classes} classes")
    return out


def gguf_fields(tok) -> list[tuple[str, object, str]]:
    """(key, value, type) of the tokenizer metadata llama.cpp's `gpt2` vocab loader reads, plus the HF JSON."""
    spec = json.loads(tok.to_str())
    n = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(n)]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return [
        ("tokenizer.ggml.model", "gpt2", "str"), ("tokenizer.ggml.pre", GGUF_PRE, "str"),
        ("tokenizer.ggml.tokens", tokens, "str[]"), ("tokenizer.ggml.token_type", types, "i32[]"),
        ("tokenizer.ggml.merges", merges, "str[]"),
        ("tokenizer.ggml.bos_token_id", BOS_ID, "u32"), ("tokenizer.ggml.eos_token_id", EOS_ID, "u32"),
        ("tokenizer.ggml.padding_token_id", PAD_ID, "u32"),
        ("tokenizer.ggml.add_bos_token", True, "bool"), ("tokenizer.ggml.add_eos_token", False, "bool"),
        ("tokenizer.chat_template", CHAT_TEMPLATE, "str"),
        ("tokenizer.huggingface.json", tok.to_str(), "str"),
    ]
