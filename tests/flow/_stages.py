"""Module-level functions for process-pool stages (they must pickle)."""

from __future__ import annotations

import os


def pid_of(x: int) -> tuple[int, int]:
    return x, os.getpid()


def square_or_fail(x: int) -> int:
    if x == 7:
        raise ArithmeticError("seven")
    return x * x
