"""The one error a malformed model file raises (pure Python; wherever a model is opened).

A model file is user input: whatever its bytes, opening it either works or raises
``ModelFileError`` naming the file and the field that is wrong, which a worker prints as one
line before exiting 2 (worker/process.py), never a traceback from deep inside a reader.
"""
from __future__ import annotations

from pathlib import Path


class ModelFileError(ValueError):
    """``path`` is not a model file Tandem can read: ``field`` is the part that is wrong."""

    def __init__(self, path: str | Path, field: str, problem: str, kind: str = "model") -> None:
        super().__init__(f"{path} is not a valid {kind} file: {field}: {problem}")
        self.path = str(path)
        self.field = field
