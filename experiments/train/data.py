"""Training and held-out data from the Python installation of the machine that runs the pipeline.

Code: every `.py` file under the interpreter's standard library and its site-packages (sysconfig paths),
walked in sorted order, skipping `__pycache__`, files over `max_file_bytes`, files that are not UTF-8, and
generated-looking files (a line over 1000 characters, or a mean line over 120); deduplicated by content hash
(the first file in walk order wins: a directory's files, sorted, before its sorted subdirectories).
Each file belongs to a package: the top-level directory under site-packages,
or `stdlib/<top module>`.

Held out (never trained on): whole packages (`HELD_OUT_PACKAGES`, those present) and every other file whose
path hash falls in 1% (sha1 of the path relative to its root, first 8 hex digits mod 100 == 0).

Prose (evaluation only): English long descriptions from `*.dist-info/METADATA` (the body after the headers) and
README / *.md / *.rst / *.txt files in site-packages, kept if at least 2000 characters, 97% ASCII and mostly
letters and spaces (so not tables, data or license boilerplate-heavy dumps); deduplicated by content hash.

Everything is deterministic given the installation; the manifest records the roots, counts and held-out names.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig

HELD_OUT_PACKAGES = ("optax", "tqdm", "stdlib/email")
_LICENSE = re.compile(r"\b(licen[cs]e|copyright|warranty|permission is hereby granted)\b", re.I)


def roots() -> list[tuple[str, str]]:
    """(kind, directory): the standard library and each distinct site-packages directory."""
    paths = sysconfig.get_paths()
    out = [("stdlib", os.path.realpath(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        p = os.path.realpath(paths[key])
        if os.path.isdir(p) and all(p != r for _, r in out):
            out.append(("site", p))
    return out


def _walk(root: str, skip: set[str]):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and os.path.join(dirpath, d) not in skip)
        for f in sorted(filenames):
            yield os.path.join(dirpath, f)


def _package(kind: str, rel: str) -> str:
    top = rel.split(os.sep)[0]
    if top.endswith(".py"):
        top = top[:-3]
    return f"stdlib/{top}" if kind == "stdlib" else top


def _looks_generated(text: str) -> bool:
    lines = text.split("\n")
    return max(map(len, lines)) > 1000 or len(text) / max(1, len(lines)) > 120


def path_held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100 == 0


def collect_code(max_file_bytes: int = 300_000, held_out_packages=HELD_OUT_PACKAGES, roots_=None) -> dict:
    """{"train": [(package, rel, text)], "heldout": [...], "stats": {...}}; `roots_` overrides `roots()`."""
    rs = roots() if roots_ is None else roots_
    site_dirs = {r for k, r in rs if k == "site"}
    seen: set[str] = set()
    train, heldout = [], []
    stats = {"files_seen": 0, "skipped_large": 0, "skipped_undecodable": 0, "skipped_generated": 0,
             "duplicates": 0, "roots": [r for _, r in rs]}
    for kind, root in rs:
        skip = site_dirs if kind == "stdlib" else set()
        for path in _walk(root, skip):
            if not path.endswith(".py"):
                continue
            stats["files_seen"] += 1
            try:
                if os.path.getsize(path) > max_file_bytes:
                    stats["skipped_large"] += 1
                    continue
                with open(path, "rb") as f:
                    raw = f.read()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                stats["skipped_undecodable"] += 1
                continue
            if not text.strip():
                continue
            if _looks_generated(text):
                stats["skipped_generated"] += 1
                continue
            digest = hashlib.sha1(raw).hexdigest()
            if digest in seen:
                stats["duplicates"] += 1
                continue
            seen.add(digest)
            rel = os.path.relpath(path, root)
            pkg = _package(kind, rel)
            held = pkg in held_out_packages or path_held_out(f"{kind}/{rel}")
            (heldout if held else train).append((pkg, f"{kind}/{rel}", text))
    stats.update(train_files=len(train), heldout_files=len(heldout),
                 train_bytes=sum(len(t[2].encode()) for t in train),
                 heldout_bytes=sum(len(t[2].encode()) for t in heldout),
                 held_out_packages=sorted({p for p, _, _ in heldout if p in held_out_packages}))
    return {"train": train, "heldout": heldout, "stats": stats}


def _metadata_body(text: str) -> str:
    """The long description of a METADATA file: everything after the first blank line (the RFC 822 headers)."""
    parts = text.split("\n\n", 1)
    return parts[1] if len(parts) == 2 else ""


def _english(text: str) -> bool:
    if len(text) < 2000:
        return False
    ascii_share = sum(c < "\x80" for c in text) / len(text)
    letters = sum(c.isalpha() or c == " " for c in text) / len(text)
    licensey = len(_LICENSE.findall(text)) > len(text) / 2000
    return ascii_share > 0.97 and letters > 0.75 and not licensey


def collect_prose(max_doc_chars: int = 40_000, roots_=None) -> list[tuple[str, str]]:
    """[(source, text)] English prose documents, sorted by source; `roots_` overrides `roots()`."""
    out, seen = [], set()
    for kind, root in roots() if roots_ is None else roots_:
        if kind != "site":
            continue
        for path in _walk(root, set()):
            name = os.path.basename(path)
            is_meta = name == "METADATA" and ".dist-info" in path
            is_doc = name.lower().startswith("readme") or name.endswith((".md", ".rst", ".txt"))
            if not (is_meta or is_doc) or name.lower().startswith(("license", "copying", "entry_points",
                                                                    "top_level", "requires", "sources")):
                continue
            try:
                if os.path.getsize(path) > 2_000_000:
                    continue
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            text = (_metadata_body(text) if is_meta else text).strip()[:max_doc_chars]
            if not _english(text):
                continue
            digest = hashlib.sha1(text.encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            out.append((f"site/{os.path.relpath(path, root)}", text))
    return out


def eval_documents(heldout_code: list, prose: list, code_bytes: int, prose_bytes: int) -> list[dict]:
    """The evaluation set: held-out code files and prose documents in hash order of their source (a spread over
    packages, not the alphabetically first ones), each kind up to its byte cap."""
    def pick(items, cap, kind):
        chosen, total = [], 0
        for src, text in sorted(items, key=lambda st: hashlib.sha1(st[0].encode()).hexdigest()):
            n = len(text.encode())
            if total + n > cap:
                continue
            chosen.append({"kind": kind, "source": src, "text": text})
            total += n
        return chosen

    return pick([(src, text) for _, src, text in heldout_code], code_bytes, "code") + pick(prose, prose_bytes, "prose")


def subset(docs: list[dict], max_bytes: int | None) -> list[dict]:
    """The first documents of each kind, in file order, up to `max_bytes` UTF-8 bytes per kind (all if None);
    evaluate.py and the GPU run use this same rule so their numbers refer to the same text."""
    if max_bytes is None:
        return list(docs)
    out, used = [], {}
    for d in docs:
        n = len(d["text"].encode())
        if used.get(d["kind"], 0) + n > max_bytes:
            continue
        used[d["kind"]] = used.get(d["kind"], 0) + n
        out.append(d)
    return out
