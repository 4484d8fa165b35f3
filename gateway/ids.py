"""Unique ids without a syscall per request: a random 48-bit prefix per process (its `instance`), then a counter
(24 hex chars).

Unique across gateway replicas with overwhelming probability (the prefix), strictly unique within one (the counter);
costs one string format per id where uuid4 reads the OS random source each time. The instance also marks every
request the gateway sends (`x-kvgate-via`, `gateway.app`), so one that comes back to it is refused as a loop.
"""

from __future__ import annotations

import itertools
import os

REQUEST_ID_MAX = 128


def valid_request_id(value: str) -> bool:
    """Visible ASCII, at most `REQUEST_ID_MAX` characters: what every hop (engines, logs, headers) can carry."""
    return len(value) <= REQUEST_ID_MAX and value.isascii() and value.isprintable() and " " not in value


class IdSource:
    def __init__(self) -> None:
        self.instance = os.urandom(6).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self.instance}{next(self._counter):012x}"
