"""Unique ids without a syscall per request: a random 48-bit prefix per process, then a counter (24 hex chars).

Unique across gateway replicas with overwhelming probability (the prefix), strictly unique within one (the counter);
costs one string format per id where uuid4 reads the OS random source each time.
"""

from __future__ import annotations

import itertools
import os


class IdSource:
    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):012x}"
