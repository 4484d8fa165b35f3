"""Exponential back-off, the one formula for every retry loop: attempt k (1 = the first retry) waits
min(base x 2^(k-1), max). O(1); `Backoff` holds only the attempt count."""

from __future__ import annotations

_MAX_DOUBLINGS = 60  # 2**60 x any base is past any max: no float overflow however long a loop fails


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds before retry `attempt` (1 = the first)."""
    return min(base_s * 2 ** min(max(attempt - 1, 0), _MAX_DOUBLINGS), max_s)


class Backoff:
    """A retry loop's state: `next()` gives base, 2 x base, 4 x base ... up to max; `reset()` after a success."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.attempts = 0  # failures since the last success

    def next(self) -> float:
        self.attempts += 1
        return backoff_delay(self.attempts, self.base_s, self.max_s)

    def reset(self) -> None:
        self.attempts = 0
