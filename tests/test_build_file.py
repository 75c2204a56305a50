"""Keeps BUILD in step with the tree, without Bazel: BUILD is parsed as Starlark-in-Python-syntax (ast).

Rules checked by `check_build` (each problem names the file or target and says what to do):
- every jds41/**/*.py is in the srcs of a py_library (a glob counts);
- every tests/**/test_*.py has its own py_test, named after the file, listing it EXPLICITLY in srcs (a glob does
  not count: a new test file must get a target), with `args` naming it when the pytest runner is the main;
- every other tests/**/*.py (helpers) is in some target's srcs;
- every path BUILD names exists, every glob matches something (unless allow_empty), every ":label" is defined.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RULES = ("py_library", "py_test", "py_binary")
FILE_ATTRS = ("srcs", "data", "args")  # attributes holding paths or labels (args: only *.py entries are paths)
SKIP_DIRS = {".git", ".venv", ".pytest_cache", ".ruff_cache", ".hypothesis", "__pycache__", "node_modules", "build",
             "dist", "tmp"}


@dataclasses.dataclass
class Files:
    """A label list: explicit paths plus globs (include patterns, exclude patterns, allow_empty)."""

    explicit: list[str] = dataclasses.field(default_factory=list)
    labels: list[str] = dataclasses.field(default_factory=list)
    globs: list[tuple[list[str], list[str], bool]] = dataclasses.field(default_factory=list)

    def __add__(self, other: Files) -> Files:
        return Files(self.explicit + other.explicit, self.labels + other.labels, self.globs + other.globs)

    def covers(self, path: str) -> bool:
        return path in self.explicit or any(
            any(glob_match(p, path) for p in inc) and not any(glob_match(p, path) for p in exc)
            for inc, exc, _ in self.globs)


@dataclasses.dataclass
class Target:
    rule: str
    name: str
    line: int
    attrs: dict[str, Files]
    strings: dict[str, object]


def glob_match(pattern: str, path: str) -> bool:
    """Bazel glob semantics: `**` spans any number of directories (also none), `*`/`?` stay within one."""

    def rec(ps: list[str], xs: list[str]) -> bool:
        if not ps:
            return not xs
        if ps[0] == "**":
            return any(rec(ps[1:], xs[i:]) for i in range(len(xs) + 1))
        return bool(xs) and fnmatch.fnmatchcase(xs[0], ps[0]) and rec(ps[1:], xs[1:])

    return rec(pattern.split("/"), path.split("/"))


def _eval(node: ast.expr, where: str) -> Files | str | bool | list:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bool, int)):
        return node.value
    if isinstance(node, ast.List):
        out = Files()
        for elt in node.elts:
            v = _eval(elt, where)
            if not isinstance(v, str):
                raise TypeError(f"{where}: only strings inside lists are understood")
            (out.labels if v.startswith((":", "//", "@")) else out.explicit).append(v)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _eval(node.left, where), _eval(node.right, where)
        if isinstance(a, Files) and isinstance(b, Files):
            return a + b
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "glob":
        kw = {k.arg: k.value for k in node.keywords}
        inc = _eval(node.args[0] if node.args else kw["include"], where)
        exc = _eval(kw["exclude"], where) if "exclude" in kw else Files()
        allow_empty = _eval(kw["allow_empty"], where) if "allow_empty" in kw else False
        return Files(globs=[(inc.explicit, exc.explicit, bool(allow_empty))])
    raise ValueError(f"{where}: expression not understood by tests/test_build_file.py: {ast.unparse(node)}")


def parse_build(text: str) -> list[Target]:
    targets = []
    for stmt in ast.parse(text, "BUILD").body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in RULES):
            continue
        attrs, strings = {}, {}
        for kw in call.keywords:
            v = _eval(kw.value, f"BUILD:{call.lineno} {kw.arg}")
            (attrs if isinstance(v, Files) else strings)[kw.arg] = v
        name = strings.get("name")
        if not isinstance(name, str):
            raise TypeError(f"BUILD:{call.lineno}: {call.func.id} without a name")
        targets.append(Target(call.func.id, name, call.lineno, attrs, strings))
    return targets


def check_build(text: str, files: set[str]) -> list[str]:
    """Problems of BUILD `text` against the repo's `files` (posix paths relative to the root); [] if in step."""
    targets = parse_build(text)
    problems = []
    names = [t.name for t in targets]
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"target name {n!r} is defined more than once")
    for t in targets:
        where = f"BUILD:{t.line} {t.rule}({t.name!r})"
        for attr, fs in t.attrs.items():
            for p in fs.explicit if attr in FILE_ATTRS else ():
                if p not in files and (attr != "args" or p.endswith(".py")):
                    problems.append(f"{where}: {attr} names {p!r}, which does not exist")
            for lab in fs.labels:
                if lab.startswith(":") and lab[1:] not in names:
                    problems.append(f"{where}: {attr} names {lab!r}, which is no target in BUILD")
            for inc, exc, allow_empty in fs.globs:
                if not allow_empty and not any(Files(globs=[(inc, exc, True)]).covers(f) for f in files):
                    problems.append(f"{where}: {attr} glob({inc}) matches no file")
        main = t.strings.get("main")
        if main is not None and main not in t.attrs.get("srcs", Files()).explicit:
            problems.append(f"{where}: main {main!r} is not among its srcs")

    def srcs(rules: tuple[str, ...]):
        return [(t, t.attrs.get("srcs", Files())) for t in targets if t.rule in rules]

    for f in sorted(files):
        if not f.endswith(".py"):
            continue
        stem = Path(f).stem
        if f.startswith("jds41/"):
            if not any(s.covers(f) for _, s in srcs(("py_library",))):
                problems.append(f"{f} is in no py_library's srcs: add it to (or glob it into) :jds41")
        elif f.startswith("tests/") and stem.startswith("test_"):
            owners = [t for t, s in srcs(("py_test",)) if f in s.explicit]
            if len(owners) > 1:
                problems.append(f"{f} is run by {len(owners)} py_test targets: keep one")
            if not owners:
                problems.append(f"{f} has no py_test target: add py_test(name = {stem!r}, srcs = [{f!r}, "
                                f"'tests/pytest_main.py'], main = 'tests/pytest_main.py', args = [{f!r}], "
                                f"deps = [':jds41', ':test_helpers'])")
            for t in owners:
                if t.name != stem:
                    problems.append(f"BUILD:{t.line} py_test({t.name!r}) runs {f}: name it {stem!r}")
                main, args = t.strings.get("main"), t.attrs.get("args", Files()).explicit
                if main is not None and main != f and f not in args:
                    problems.append(f"BUILD:{t.line} py_test({t.name!r}): args must name {f!r} for {main}")
        elif f.startswith("tests/") and not any(s.covers(f) for _, s in srcs(RULES)):
            problems.append(f"{f} (a test helper) is in no target's srcs: add it to :test_helpers")
    return problems


def repo_files(root: Path = REPO) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = Path(dirpath).relative_to(root)
        out.update((rel / f).as_posix() for f in filenames)
    return out


# ---- the real check -------------------------------------------------------------------------------------------


def test_build_file_is_in_step_with_the_tree():
    problems = check_build((REPO / "BUILD").read_text(), repo_files())
    assert not problems, "BUILD is out of step with the tree:\n  " + "\n  ".join(problems)


# ---- the checker itself catches what it should (synthetic trees) ------------------------------------------------

SYNTH_BUILD = """
load("@rules_python//python:defs.bzl", "py_library", "py_test")
py_library(name = "jds41", srcs = glob(["jds41/**/*.py"]), data = glob(["jds41/x/*.json"], allow_empty = True))
py_library(name = "test_helpers", testonly = True, srcs = glob(["tests/**/*.py"], exclude = ["tests/**/test_*.py"]),
           deps = [":jds41"])
py_test(name = "test_a", srcs = ["tests/test_a.py", "tests/pytest_main.py"], main = "tests/pytest_main.py",
        args = ["tests/test_a.py"], deps = [":test_helpers"])
"""
SYNTH_FILES = {"jds41/__init__.py", "jds41/sub/mod.py", "tests/pytest_main.py", "tests/helper.py", "tests/test_a.py"}


def test_checker_accepts_a_tree_in_step():
    assert check_build(SYNTH_BUILD, SYNTH_FILES) == []


def test_checker_fails_on_a_new_test_file_without_target():
    problems = check_build(SYNTH_BUILD, SYNTH_FILES | {"tests/test_new.py"})
    assert len(problems) == 1 and problems[0].startswith("tests/test_new.py has no py_test target")


def test_checker_does_not_count_a_glob_as_a_test_target():
    build = SYNTH_BUILD + 'py_test(name = "test_all", srcs = glob(["tests/test_*.py"]))\n'
    assert any(p.startswith("tests/test_new.py has no py_test") for p in check_build(build, SYNTH_FILES | {
        "tests/test_new.py"}))


def test_checker_fails_on_a_target_for_a_missing_file():
    build = SYNTH_BUILD + ('py_test(name = "test_gone", srcs = ["tests/test_gone.py", "tests/pytest_main.py"], '
                           'main = "tests/pytest_main.py", args = ["tests/test_gone.py"], deps = [":nope"])\n')
    problems = check_build(build, SYNTH_FILES)
    assert any("'tests/test_gone.py', which does not exist" in p for p in problems)
    assert any("':nope', which is no target" in p for p in problems)


def test_checker_fails_on_uncovered_library_and_helper_files():
    build = SYNTH_BUILD.replace('glob(["jds41/**/*.py"])', '["jds41/__init__.py", "jds41/sub/mod.py"]')
    build = build.replace('glob(["tests/**/*.py"], exclude = ["tests/**/test_*.py"])', '["tests/pytest_main.py"]')
    problems = check_build(build, SYNTH_FILES | {"jds41/new.py"})
    assert sorted(p.split()[0] for p in problems) == ["jds41/new.py", "tests/helper.py"]


def test_checker_fails_on_misnamed_or_miswired_test_and_empty_glob():
    build = SYNTH_BUILD.replace('name = "test_a"', 'name = "test_b"').replace('args = ["tests/test_a.py"], ', "")
    build = build.replace('"jds41/x/*.json"], allow_empty = True', '"jds41/x/*.json"]')
    problems = check_build(build, SYNTH_FILES)
    assert any("py_test('test_b') runs tests/test_a.py: name it 'test_a'" in p for p in problems)
    assert any("args must name 'tests/test_a.py'" in p for p in problems)
    assert any("matches no file" in p for p in problems)


@pytest.mark.parametrize("pattern,path,ok", [
    ("jds41/**/*.py", "jds41/a.py", True), ("jds41/**/*.py", "jds41/x/y/a.py", True),
    ("jds41/*.py", "jds41/x/a.py", False), ("tests/**/test_*.py", "tests/test_a.py", True),
    ("tests/**/test_*.py", "tests/helper.py", False), ("jds41/**", "jds41/p/q.json", True),
])
def test_glob_match(pattern, path, ok):
    assert glob_match(pattern, path) is ok
