"""Repository hygiene: the README's commands are real, and CI runs exactly the README's test command.

- `.ci/run` must contain the README's test command as a line of its own (it "runs exactly that"), keep bash's
  strict mode and treat pytest's exit 5 (no tests collected) as handled;
- every `python -m MODULE` in the README's code blocks (outside comments) must name a module of the tree.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
CI_RUN = (REPO / ".ci" / "run").read_text()


def _code_blocks(text: str) -> list[list[str]]:
    return [b.strip("\n").splitlines() for b in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]


def readme_test_command() -> str:
    section = README.split("## Tests", 1)[1]
    return _code_blocks(section)[0][0].strip()


def test_ci_runs_exactly_the_readme_test_command():
    cmd = readme_test_command()
    assert cmd.startswith("python -m pytest"), cmd
    ci_lines = [ln.strip() for ln in CI_RUN.splitlines()]
    assert cmd in ci_lines, f".ci/run does not run the README's test command {cmd!r} on a line of its own"
    assert "set -euo pipefail" in ci_lines
    assert re.search(r'"\$rc" -eq 5', CI_RUN), ".ci/run must handle pytest's exit 5 (no tests collected)"


def test_readme_commands_name_existing_modules():
    missing = []
    for block in _code_blocks(README):
        for line in block:
            if line.lstrip().startswith("#"):
                continue
            for mod in re.findall(r"python3? -m ([\w.]+)", line):
                if not mod.startswith("jds41"):
                    continue
                base = REPO / Path(*mod.split("."))
                if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                    missing.append(mod)
    assert not missing, f"README names modules that do not exist: {missing}"
