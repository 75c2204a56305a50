"""The project's own exceptions.

Every failure caused by a model file or a request ends in one of these, never in an interpreter abort: the
server turns them into clean exits or 4xx answers, and tests assert on them. Model-file errors always name
the file (or shard) and, when one is involved, the tensor or key.
"""

from __future__ import annotations


class Jds41Error(Exception):
    """Base class of every error jds41 raises on purpose."""


class ModelFileError(Jds41Error):
    """A GGUF (or Orbax) model file is unreadable, inconsistent or not a model jds41 can run.

    `path` is the file or shard, `tensor` the tensor (or metadata key) at fault when there is one.
    """

    def __init__(self, path: str, message: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        self.detail = message
        where = f"{self.path}: tensor {tensor!r}: " if tensor else f"{self.path}: "
        super().__init__(where + message)


class ConfigError(ModelFileError):
    """Metadata is missing, mistyped or describes a model jds41 does not support (names the key)."""

    def __init__(self, path: str, key: str, message: str):
        self.key = key
        super().__init__(path, f"metadata key {key!r}: {message}")
