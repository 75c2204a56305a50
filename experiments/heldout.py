"""Held-out evaluation text for the benchmarks: the shipped set (`checkpoints/*-heldout.jsonl.xz`, JSON Lines of
{"kind", "source", "text"}) or any text file with one document per line."""

from __future__ import annotations

import json
import lzma


def read_texts(path: str, kind: str | None = None) -> list[str]:
    """Documents of `path` (`.xz` read as such); with JSON Lines, `kind` keeps only that kind (code, prose)."""
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as fh:
        lines = [line for line in fh if line.strip()]
    if lines and lines[0].lstrip().startswith("{"):
        recs = [json.loads(line) for line in lines]
        return [r["text"] for r in recs if kind is None or r.get("kind") == kind]
    return [line.rstrip("\n") for line in lines]


def text_prompts(tokenizer, path: str, n: int, length: int, kind: str | None = "code") -> list[list[int]]:
    """The first `length` token ids of the first `n` documents at least that long (BOS first, as the engine's
    prompts are encoded)."""
    out = []
    for doc in read_texts(path, kind):
        ids = tokenizer.encode(doc)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out
