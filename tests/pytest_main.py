"""Entry point of every Bazel `py_test` target (see BUILD): runs pytest on the test files given as arguments.

Bazel runs a py_test as a plain script with the runfiles tree as working directory; test files hold pytest
functions and no `__main__` block, so each target names this file as `main` and its own test file in `args`.
"""

from __future__ import annotations

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
