"""Routing state shared by several gateways through Redis, so that N gateways behind a balancer route as one.

What is shared is what a gateway learns from its own routing: the prompt blocks it sent to a replica (the
speculative inserts of the approximate index, which is all there is for engines without KV events), session
bindings, and which replica holds a stored response (`/v1/responses/{id}` goes there, whichever gateway the call
reaches). KV events need no sharing: every gateway subscribes to every engine.

The channel is a Redis stream (`channel`), capped at `history` decisions: a log every gateway reads, which
is also the history a gateway that starts (or comes back after losing Redis) rebuilds from.
- Publish: `publish` (called from `CacheAwareState.on_routed`) appends the decision to a bounded buffer (O(1));
  one task sends the buffer every `flush_ms` in one pipeline: an `XADD ... MAXLEN ~ history` per decision (fields:
  gateway id, replica, block hashes as packed little-endian u64, session digest) and a `SET ... EX ttl` of
  `<prefix>:session:<digest>` per session binding. A full buffer drops its oldest decision (counted).
- Agents expected back: `publish_awaited` (an answer of a session ended in a tool call, `CacheAwareState.on_finished`)
  goes into the same buffer, in order with the decisions, as an entry with the session digest, the awaited block
  count (`w`) and no hashes; the others mark the session awaited on that replica (`apply_awaited`) and clear it
  when they see its next turn's decision, so cold placements through any gateway spare it. Not applied from the
  history (a mark matters for seconds only).
- Apply: one task (started with the prefix-cache state as its `SharedDecisionSink`) reads the stream
  (`XREAD BLOCK`, from its start when the gateway starts, then from the last entry
  read, so an outage shorter than the history loses nothing) and hands the other gateways' decisions to
  `CacheAwareState.apply_shared` (O(prompt blocks) each); its own are skipped. The history is applied in slices of
  about `_SLICE_S` of CPU, the event loop served between them (a decision of a long prompt into a full replica
  costs milliseconds: a fixed count of entries blocked the loop for seconds); `kvgate_fleet_catching_up` is 1 until
  the history is applied.
- Stored responses: `publish_response` buffers `SET <prefix>:response:<id> replica EX response_ttl_s`, sent with
  the decisions; a gateway asked about a response it did not record looks it up (`GET`, bounded by `timeout_s`),
  and once more after `flush_ms` and a round trip when it is not there yet (its client asked at once).
- Cold placement (`claim`): the stream tells the others about a decision a few milliseconds late, so a burst of
  one new prefix through several gateways would be placed by each on its own choice. A gateway about to place a
  prefix no replica holds first claims its first block (`SET <prefix>:claim:<hash> replica NX GET PX claim_ms`):
  if another gateway claimed it, the request goes to that replica (reason `fleet-claim`). One round trip per cold
  placement, bounded by `timeout_s`; an error keeps the gateway's own choice.
- Sessions older than the history: while the gateway has not been reading for a whole session TTL, a local miss asks
  Redis (`GET`, bounded by `timeout_s`); after that every live binding came through the stream and a miss costs
  nothing.
- Close: what is still buffered (the last requests of a drain) is sent, within `timeout_s`.
- Failure: Redis errors never fail a request. Decisions that cannot be sent are dropped and counted; both tasks
  retry with exponential backoff up to `reconnect_max_s`.
Memory: the buffer (`max_pending` decisions) here; about `history` decisions in Redis, 8 bytes a prompt block each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from array import array
from collections import deque
from collections.abc import Sequence

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from cacheindex.shared import SharedDecisionSink
from gateway.admission.redis_store import REDIS_ERRORS
from gateway.config import FleetConfig
from gateway.errors import Overloaded
from kvcommon.backoff import Backoff
from kvcommon.fastmetrics import FastCounter, FastGauge

log = logging.getLogger("kvgate.fleet")

_MIN_BACKOFF_S = 0.05
_READ_BLOCK_MS = 1000
_MAX_RESPONSE_ID = 256
_READ_COUNT = 512  # stream entries per XREAD
_SLICE_S = 0.005  # the history is applied in slices of about this much CPU, the loop served between them
_PUBLISH_RTT_S = 0.02  # a record's way to Redis after its batch is sent (a lookup's second try waits it out)


_FAILURES_OFF = 2  # lookups failed in a row that turn the lookups off (`_lookups_off`) ...
_OFF_S = 1.0  # ... for this long


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = FastCounter(
            "kvgate_fleet_decisions",
            "Routing decisions shared with the other gateways: published (this gateway's, sent), applied (theirs, "
            "learned here), dropped (this gateway's, not sent: Redis down or the buffer full)",
            ["outcome"],
            registry,
        )
        self.connected = FastGauge("kvgate_fleet_connected", "1 while reading the shared routing stream", [], registry)
        self.connected.labels().set(0)
        self.catching_up = FastGauge(
            "kvgate_fleet_catching_up", "1 while applying the decisions made before this gateway read the stream", [],
            registry,
        )  # fmt: skip
        self.claims = FastCounter(
            "kvgate_fleet_claims",
            "Cold placements claimed in Redis: won (this gateway's choice stands), joined (another gateway's claim "
            "decided the replica), error (Redis did not answer: own choice), skipped (Redis failed to answer twice in "
            "a row within the last second: not asked, own choice)",
            ["outcome"],
            registry,
        )
        self.session_lookups = FastCounter(
            "kvgate_fleet_session_lookups",
            "Sessions unknown here looked up in Redis (found, missing, error; skipped: not asked, Redis failed to "
            "answer twice in a row within the last second)",
            ["outcome"],
            registry,
        )


class RoutingShare:
    def __init__(self, config: FleetConfig, url: str, registry: CollectorRegistry, *, session_ttl_s: float) -> None:
        """`session_ttl_s`: how long a session binding lives (cache.session_ttl_s), in Redis as here."""
        self.config = config
        self.metrics = FleetMetrics(registry)
        self.gateway_id = os.urandom(8).hex().encode()
        self._session_ttl = max(1, round(session_ttl_s))
        # (replica, block hashes, session digest, awaited blocks: None for a routing decision)
        self._pending: deque[tuple[str, Sequence[int], bytes | None, int | None]] = deque(maxlen=config.max_pending)
        self._responses: deque[tuple[str, str]] = deque(maxlen=config.max_pending)
        self._wake = asyncio.Event()
        timeout = config.timeout_s
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        # the reader blocks in XREAD up to _READ_BLOCK_MS: its connection's read timeout is longer than that
        self._reader = aioredis.Redis.from_url(
            url, socket_timeout=_READ_BLOCK_MS / 1000 + timeout, socket_connect_timeout=timeout
        )
        self._reading_since: float | None = None
        self._off_until = 0.0  # no lookup before then: they failed (`_lookups_off`)
        self._failures = 0  # lookups failed in a row
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []

    def _session_key(self, digest: bytes) -> str:
        return f"{self.config.key_prefix}:session:{digest.hex()}"

    def _response_key(self, response_id: str) -> str:
        return f"{self.config.key_prefix}:response:{response_id}"

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self, sink: SharedDecisionSink) -> None:
        """Send this gateway's decisions, and read the others' into `sink` (the prefix-cache state)."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._send_loop(), name="fleet:send"),
            loop.create_task(self._read_loop(sink), name="fleet:read"),
        ]

    async def close(self) -> None:
        # the loops end on the flag too: redis-py may turn a cancellation into one of its connection errors, which a
        # loop takes for an outage and waits on (the gateway's shutdown then hung)
        self._closed = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._pending or self._responses:  # what the last requests (a drain's) recorded: sent, within timeout_s
            with contextlib.suppress(TimeoutError, *REDIS_ERRORS):
                async with asyncio.timeout(self.config.timeout_s):
                    await self._flush()
        await self._client.aclose()
        await self._reader.aclose()

    # --- SharedRouting ----------------------------------------------------------------------------------------
    def publish(self, replica: str, hashes: Sequence[int], session: bytes | None) -> None:
        self._buffer((replica, hashes, session, None))

    def publish_awaited(self, replica: str, session: bytes, blocks: int) -> None:
        self._buffer((replica, (), session, blocks))

    def _buffer(self, entry: tuple[str, Sequence[int], bytes | None, int | None]) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.metrics.decisions.labels("dropped").inc()
        self._pending.append(entry)
        self._wake.set()

    def publish_response(self, response_id: str, replica: str) -> None:
        self._responses.append((response_id, replica))
        self._wake.set()

    async def response_replica(self, response_id: str) -> str | None:
        """The replica another gateway recorded as holding the stored response, or None. A miss is asked again once
        a record published as its client got the answer has had time to arrive (`flush_ms` and a round trip): a
        client that asks another gateway at once must not find nothing. Redis not answering is a 503 to retry
        (`fleet_unavailable`), not a 404 that says the response does not exist."""
        if len(response_id) > _MAX_RESPONSE_ID:  # a client's path: no engine makes ids that long
            return None
        key = self._response_key(response_id)
        found = await self._get(key)
        if found is None:
            await asyncio.sleep(self.config.flush_ms / 1000 + _PUBLISH_RTT_S)
            found = await self._get(key)
        return found

    async def _get(self, key: str) -> str | None:
        if not self._lookups_off():
            try:
                value = await self._client.get(key)
            except REDIS_ERRORS:
                self._lookup_failed()
            else:
                self._lookup_answered()
                return value.decode() if isinstance(value, bytes) else value
        raise Overloaded(
            "the record of which replica holds this response is in Redis, which does not answer: retry",
            retry_after_s=self.config.reconnect_max_s,
            code="fleet_unavailable",
        )

    def _lookups_off(self) -> bool:
        """Whether lookups failed `_FAILURES_OFF` times in a row within the last `_OFF_S`: then none is tried (each
        would wait `timeout_s` for a Redis that does not answer, on every request) and the gateway routes on its
        own knowledge. One slow answer on a busy machine is no outage: it turns nothing off."""
        return time.monotonic() < self._off_until

    def _lookup_failed(self) -> None:
        self._failures += 1
        if self._failures >= _FAILURES_OFF:
            self._off_until = time.monotonic() + _OFF_S

    def _lookup_answered(self) -> None:
        self._failures = 0

    async def claim(self, first_block: int, replica: str) -> str:
        """The replica a cold prefix starting with `first_block` goes to: `replica`, unless another gateway claimed
        the prefix within `claim_ms`."""
        if not self.config.claim_ms:
            return replica
        key = f"{self.config.key_prefix}:claim:{first_block:x}"
        if self._lookups_off():
            self.metrics.claims.labels("skipped").inc()
            return replica
        try:
            prior = await self._client.set(key, replica, nx=True, get=True, px=max(1, round(self.config.claim_ms)))
        except REDIS_ERRORS:
            self._lookup_failed()
            self.metrics.claims.labels("error").inc()
            return replica
        self._lookup_answered()
        if prior is None:
            self.metrics.claims.labels("won").inc()
            return replica
        self.metrics.claims.labels("joined").inc()
        return prior.decode() if isinstance(prior, bytes) else str(prior)

    async def session_replica(self, session: bytes) -> str | None:
        since = self._reading_since
        if since is not None and time.monotonic() - since > self._session_ttl:
            return None  # every live binding came through the stream
        if self._lookups_off():
            self.metrics.session_lookups.labels("skipped").inc()
            return None
        try:
            value = await self._client.get(self._session_key(session))
        except REDIS_ERRORS:
            self._lookup_failed()
            self.metrics.session_lookups.labels("error").inc()
            return None
        self._lookup_answered()
        self.metrics.session_lookups.labels("missing" if value is None else "found").inc()
        return value.decode() if isinstance(value, bytes) else value

    # --- tasks ------------------------------------------------------------------------------------------------
    async def _send_loop(self) -> None:
        cfg = self.config
        backoff = Backoff(_MIN_BACKOFF_S, cfg.reconnect_max_s)
        while not self._closed:
            await self._wake.wait()
            if cfg.flush_ms:
                await asyncio.sleep(cfg.flush_ms / 1000)
            self._wake.clear()
            try:
                await self._flush()
            except REDIS_ERRORS as exc:
                if not backoff.attempts:
                    log.warning("could not publish routing decisions to the other gateways: %r", exc)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()

    async def _flush(self) -> None:
        """Send what is buffered in one pipeline; what fails to go is dropped (counted) and the error raised."""
        cfg = self.config
        batch, responses = list(self._pending), list(self._responses)
        self._pending.clear()
        self._responses.clear()
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for response_id, replica in responses:
                    pipe.set(self._response_key(response_id), replica, ex=round(cfg.response_ttl_s))
                for replica, hashes, session, awaited in batch:
                    fields: dict[str, bytes | str] = {
                        "g": self.gateway_id, "r": replica, "h": array("Q", hashes).tobytes()
                    }  # fmt: skip
                    if awaited is not None:
                        fields["w"] = str(awaited)
                    if session is not None:
                        fields["s"] = session
                        if awaited is None:
                            pipe.set(self._session_key(session), replica, ex=self._session_ttl)
                    pipe.xadd(cfg.channel, fields, maxlen=cfg.history, approximate=False)  # type: ignore[arg-type]
                await pipe.execute()
        except BaseException:
            self.metrics.decisions.labels("dropped").inc(len(batch))
            raise
        if batch:
            self.metrics.decisions.labels("published").inc(len(batch))

    async def _read_loop(self, sink: SharedDecisionSink) -> None:
        last_id = b"0"  # from the start of the retained history
        catching_up = True  # reading decisions made before this gateway was reading: until a short read
        backoff = Backoff(_MIN_BACKOFF_S, self.config.reconnect_max_s)
        while not self._closed:
            try:
                reply: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] = await self._reader.xread(
                    {self.config.channel: last_id}, count=_READ_COUNT, block=_READ_BLOCK_MS
                )  # type: ignore[assignment]
            except REDIS_ERRORS as exc:
                if self._reading_since is not None or not backoff.attempts:
                    log.warning("lost the shared routing stream: %r", exc)
                self._reading_since = None
                catching_up = True
                self.metrics.connected.labels().set(0)
                await asyncio.sleep(backoff.next())
                continue
            if self._reading_since is None:
                self._reading_since = time.monotonic()
                self.metrics.connected.labels().set(1)
                if backoff.attempts:  # its loss was logged: so is its return
                    log.info("reading the shared routing stream again")
            backoff.reset()
            read = 0
            self.metrics.catching_up.labels().set(1 if catching_up else 0)
            slice_end = time.monotonic() + _SLICE_S
            for _, entries in reply:
                read += len(entries)
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._apply(sink, fields, catching_up)
                    if time.monotonic() > slice_end:  # a long prompt's decision costs ms: requests go between
                        await asyncio.sleep(0)
                        slice_end = time.monotonic() + _SLICE_S
            catching_up = catching_up and read == _READ_COUNT
            if not catching_up:
                self.metrics.catching_up.labels().set(0)

    def _apply(self, sink: SharedDecisionSink, fields: dict[bytes, bytes], past: bool) -> None:
        if fields.get(b"g") == self.gateway_id:
            return
        try:
            replica = fields[b"r"].decode()
            hashes = array("Q")
            hashes.frombytes(fields[b"h"])
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            log.debug("ignoring a malformed routing decision: %r", exc)
            return
        session, awaited = fields.get(b"s"), fields.get(b"w")
        if awaited is None:
            sink.apply_shared(replica, hashes, session, past=past)
        elif session is not None and awaited.isdigit():
            if past:  # a mark lives seconds: one from the history is over, not applied (nor counted)
                return
            sink.apply_awaited(replica, session, int(awaited))
        else:
            log.debug("ignoring a malformed awaited session: %r", fields)
            return
        self.metrics.decisions.labels("applied").inc()


def shared_redis_url(config: FleetConfig, admission_redis_url: str | None) -> str | None:
    """Where the routing state is shared, or None when it is not."""
    if not config.share_routing:
        return None
    return config.redis_url or admission_redis_url
