"""Integer arithmetic the engine, the worker roles and the deploy tools all repeat (any process;
pure Python, imports nothing).
"""
from __future__ import annotations


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` in integers, exact at any size: e.g. the blocks ``n`` tokens take at ``d`` per block."""
    return -(-n // d)
