"""Training data selection (experiments/train/data.py) and the evaluation's chunking and subset rules."""

from __future__ import annotations

import os

from experiments.train import data
from experiments.train.evaluate import chunks, skew

PROSE = ("This package helps you read and write files in a simple way. " * 40).strip()


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _tree(tmp_path):
    std = tmp_path / "lib"
    site = std / "site-packages"
    _write(std / "json" / "decoder.py", "def decode(s):\n    return s\n")
    _write(std / "email" / "parser.py", "class Parser:\n    pass\n")
    _write(std / "copy_of_decoder.py", "def decode(s):\n    return s\n")  # same bytes as json/decoder.py
    _write(std / "gen.py", "x = [" + "1, " * 600 + "]\n")  # generated-looking: one 1800-char line
    _write(std / "__pycache__" / "skip.py", "a = 1\n")
    _write(site / "tqdm" / "std.py", "def tqdm(it):\n    return it\n")
    _write(site / "pkg" / "mod.py", "def f():\n    return 1\n")
    _write(site / "pkg-1.0.dist-info" / "METADATA", "Name: pkg\nVersion: 1.0\n\n" + PROSE)
    _write(site / "pkg" / "README.md", "short")
    return [("stdlib", str(std)), ("site", str(site))]


def test_code_selection_dedupes_skips_and_holds_out_whole_packages(tmp_path):
    roots = _tree(tmp_path)
    got = data.collect_code(held_out_packages=("tqdm", "stdlib/email"), roots_=roots)
    train = {rel: pkg for pkg, rel, _ in got["train"]}
    held = {rel: pkg for pkg, rel, _ in got["heldout"]}
    assert held == {"stdlib/email/parser.py": "stdlib/email", "site/tqdm/std.py": "tqdm"}
    # the duplicate pair keeps the file met first in walk order (a directory's own files before its subfolders)
    assert train == {"stdlib/copy_of_decoder.py": "stdlib/copy_of_decoder", "site/pkg/mod.py": "pkg"}
    assert got["stats"]["duplicates"] == 1 and got["stats"]["skipped_generated"] == 1
    assert data.collect_code(held_out_packages=("tqdm", "stdlib/email"), roots_=roots)["train"] == got["train"]


def test_prose_comes_from_metadata_bodies_and_long_english_docs(tmp_path):
    prose = data.collect_prose(roots_=_tree(tmp_path)[1:])
    assert prose == [("site/pkg-1.0.dist-info/METADATA", PROSE)]


def test_hash_rule_holds_out_about_one_percent():
    share = sum(data.path_held_out(f"site/p/m{i}.py") for i in range(20_000)) / 20_000
    assert 0.007 < share < 0.013


def test_chunks_predict_every_token_once_and_subset_is_a_prefix_per_kind():
    ids = list(range(100, 130))
    pairs = chunks(ids, 8)
    targets = [t for _, t in pairs]
    assert sum(targets, []) == ids[1:]
    assert all(inp[1:] == t[:-1] for inp, t in pairs) and all(len(inp) <= 8 for inp, _ in pairs)
    docs = [{"kind": "code", "text": "a" * 5}, {"kind": "prose", "text": "b" * 9}, {"kind": "code", "text": "c" * 5},
            {"kind": "code", "text": "d" * 2}]
    assert [d["text"][0] for d in data.subset(docs, 10)] == ["a", "b", "c"]
    assert data.subset(docs, None) == docs
    assert skew([10, 0, 0, 0, 0, 0, 0, 0, 0, 0]) == 1.0 and abs(skew([1] * 20) - 0.1) < 1e-9
