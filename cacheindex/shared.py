"""What several gateways share of their routing, as the cache-aware state sees it (the Redis side is gateway.fleet).

`SharedRouting` is the other gateways: where this one publishes its decisions and asks about sessions and cold
placements; `SharedDecisionSink` is where their decisions are learned. The composition root passes the first to
the state at construction and the state to the fleet's reader when it starts.
`EarlyDecisions` keeps the others' decisions for replicas this gateway has not registered yet (it is
starting and its engines are still being probed, or the engine is new), to apply when they register: bounded by
replicas (`_MAX_EARLY_REPLICAS`) and per replica (`_MAX_EARLY_DECISIONS`, the newest). A replica that was
registered and is away (down, removed) keeps nothing: its engine may come back empty. O(1) per decision.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

_MAX_EARLY_REPLICAS = 256
_MAX_EARLY_DECISIONS = 4096
_MAX_SEEN = 4096  # replica ids once registered


class SharedRouting(Protocol):
    """What several gateways share of their routing (gateway.fleet.RoutingShare, over Redis)."""

    def publish(self, replica: str, hashes: Sequence[int], session: bytes | None) -> None:
        """This gateway sent a request with these prompt blocks (and session digest) to `replica`."""

    def publish_awaited(self, replica: str, session: bytes, blocks: int) -> None:
        """This gateway relayed the session's answer on `replica`, and it ended in a tool call (its conversation
        holds `blocks` blocks there): the session is expected back."""

    async def session_replica(self, session: bytes) -> str | None:
        """The replica another gateway bound the session to, when this one may not have heard of it."""

    async def claim(self, first_block: int, replica: str) -> str:
        """The replica a cold prefix goes to: `replica`, or the one another gateway just placed it on."""


class SharedDecisionSink(Protocol):
    """Where the other gateways' decisions are learned (cacheindex.state.CacheAwareState)."""

    def apply_shared(self, replica: str, hashes: Sequence[int], session: bytes | None, *, past: bool = False) -> None:
        """Another gateway sent a request with these blocks (and session) to `replica`."""

    def apply_awaited(self, replica: str, session: bytes, blocks: int) -> None:
        """Another gateway's answer for the session on `replica` ended in a tool call."""


Decision = tuple[Sequence[int], bytes | None, bool]  # block hashes, session digest, from the history


class EarlyDecisions:
    def __init__(self) -> None:
        self._early: OrderedDict[str, deque[Decision]] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()

    def keep(self, replica: str, decision: Decision) -> None:
        """Another gateway's decision for a replica not registered here: kept unless the replica was."""
        if replica in self._seen:
            return
        early = self._early.get(replica)
        if early is None:
            early = self._early[replica] = deque(maxlen=_MAX_EARLY_DECISIONS)
            if len(self._early) > _MAX_EARLY_REPLICAS:
                self._early.popitem(last=False)
        early.append(decision)

    def registered(self, replica: str) -> list[Decision]:
        """The replica registered: the decisions kept for it, to apply now."""
        self._seen[replica] = None
        self._seen.move_to_end(replica)
        if len(self._seen) > _MAX_SEEN:
            self._seen.popitem(last=False)
        return list(self._early.pop(replica, ()))
