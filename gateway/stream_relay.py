"""One attempt's stream, from the engine's response to the client's: its windows, what it started, how it ended.

`StreamRelay.relay` reads the engine's chunks into SSE events (`gateway.relay.SseSplitter`), tells them to the client
(`gateway.relay.ClientEvents`) and classifies how the stream ended, within three windows on one timer:
- until the client's stream starts, the first token within `timeouts.first_byte_s` (a Responses stream's preamble,
  sent before the engine runs anything, is held and starts nothing); past it the replica failed and the request is
  tried elsewhere (`Retryable`): nothing of it reached the client;
- once started, at most `timeouts.stream_idle_s` between chunks (the window moved once per slack, not per chunk);
- all of it within the request's total deadline (`timeouts.total_s`).
The window closing while a write to the client waits is the client's stall (it takes nothing): its connection is
dropped and the engine is not blamed. A stream cut or stalled after it started ends with an error event in the
client's API shape, unless it may continue on another replica (`Migration`, `gateway.migration`); one cut when the
whole answer but its last event reached the client gets that event from the gateway (`ClientEvents.closing`).
Cost per chunk: one split, one take, one write; the window's reschedule once per slack.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from engine_pool.http_client import UpstreamConnectionError, UpstreamResponse
from engine_pool.replica import Replica
from gateway.config import TimeoutConfig
from gateway.errors import (
    GatewayError,
    Migration,
    Retryable,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_event,
)
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.relay import ClientEvents, SseSplitter, sequence_number

# A stream's idle window is moved out by stream_idle_s plus this share of it (at most _IDLE_SLACK_S) when it would
# close within stream_idle_s, not for every chunk (a timer's reschedule costs ~3 us, and a stream's chunks are its
# tokens): once per slack. A silent engine is found stream_idle_s to stream_idle_s + slack after its last chunk.
_IDLE_SLACK = 0.1
_IDLE_SLACK_S = 1.0

Headers = Callable[[UpstreamResponse], dict[str, str]]


def may_migrate(ex: Exchange) -> bool:
    """A stream whose every event is kept (`gateway.migration.Relayed`), within its deadline: it may continue
    elsewhere, or be closed when nothing is left to generate (`retry.max_migrations` bounds the former only)."""
    relayed = ex.relayed
    return relayed is not None and relayed.within_bound and time.monotonic() < ex.deadline


async def end_stream(ex: Exchange, failure: GatewayError | None, last: bytes = b"") -> int:
    """The stream's end, after `failure`'s error event (in the stream's shape; a Responses stream's numbered after
    its `last` event); returns the status to record."""
    if failure is not None:
        after = None
        if ex.parsed.records_id:
            found = sequence_number(last)
            after = -1 if found is None else found
        done = ex.parsed.kind in ("chat", "completions")
        await ex.out.write(error_event(failure, ex.parsed.api, responses_after=after, done=done))
    await ex.out.end()
    return 200 if failure is None else failure.status


class _Stream:
    """One attempt's stream as it is read: the client's side, what started, what is held back."""

    __slots__ = ("begin", "client", "preamble", "started", "writing")

    def __init__(self, client: ClientEvents, begin: Callable[[], Awaitable[None]]) -> None:
        self.client = client
        self.begin = begin
        self.started = False  # the client's response has begun: from here on never retried elsewhere
        self.writing = False  # a write to the client is waiting (its socket full)
        self.preamble: list[bytes] = []  # a Responses stream's first events, before the engine ran anything

    async def write(self, events: list[bytes]) -> bool:
        """Tell `events` to the client, starting its stream first when it has not; True when this started it."""
        first = not self.started
        if first:
            await self.begin()
            self.started = True
        self.writing = True
        await self.client.write(events, first=first)
        self.writing = False
        return first


class StreamRelay:
    def __init__(
        self, timeouts: TimeoutConfig, metrics: GatewayMetrics, count_failure: Callable[[Replica], None]
    ) -> None:
        self.timeouts = timeouts
        self.metrics = metrics
        self.count_failure = count_failure

    async def relay(self, ex: Exchange, upstream: UpstreamResponse, replica: Replica, headers: Headers) -> int:
        """Relay the SSE events; returns the status to record: 200, or 502/504 for a stream that was cut or
        stalled after it started (module header), unless it can continue elsewhere: then `Migration` is raised.
        `headers`: the client's response headers, for the engine's response."""
        client = ClientEvents(ex, self.metrics.model(ex.parsed.model).itl)

        async def begin() -> None:
            await client.start(upstream.status, headers(upstream))
            ex.ctx.batch_mark = replica.batch_mark()  # its decode begins

        stream = _Stream(client, begin)
        if not ex.out.started:  # a first try or a retry: the stored response is this replica's (held back until now)
            ex.ctx.answer_id = None
        failure = await self._read(ex, upstream, replica, stream)
        return await self._ended(ex, replica, stream, failure)

    async def _read(
        self, ex: Exchange, upstream: UpstreamResponse, replica: Replica, stream: _Stream
    ) -> GatewayError | None:
        """Read the engine's stream to its end within the windows; the failure that ended it after it started, if
        any (before it started: `Retryable`, or the total deadline's `UpstreamTimeout`)."""
        timeouts, splitter, client = self.timeouts, SseSplitter(), stream.client
        loop = asyncio.get_running_loop()
        end_at = loop.time() + (ex.deadline - time.monotonic())
        idle = timeouts.stream_idle_s
        extend = idle + min(_IDLE_SLACK_S, idle * _IDLE_SLACK)  # how far a chunk pushes the idle window out
        upstream.clear_timeout()  # the stream's own windows below also bound the writes to the client
        try:
            async with asyncio.timeout(min(timeouts.first_byte_s, ex.deadline - time.monotonic())) as window:
                closes = end_at  # where the idle window closes, once the stream started
                async for chunk in upstream.iter_chunks():
                    if stream.started and closes < end_at and closes - loop.time() < idle:
                        closes = min(end_at, loop.time() + extend)
                        window.reschedule(closes)
                    events = client.take(splitter.feed(chunk))
                    if not events:
                        continue
                    if not stream.started and client.preamble(events):  # held until the answer's first event
                        stream.preamble += events
                        continue
                    if stream.preamble:
                        events, stream.preamble = stream.preamble + events, []
                    if await stream.write(events):  # it started: the idle window from here on
                        closes = min(end_at, loop.time() + extend)
                        window.reschedule(closes)
                if held := stream.preamble + client.flush():  # the engine's stream ended: what was held back
                    await stream.write(held)
        except TimeoutError:
            return self._timed_out(ex, replica, stream, loop.time() < end_at - 0.01)
        except UpstreamConnectionError as exc:  # the engine failed mid-stream (after its end: not a failure)
            if not stream.started:
                raise Retryable("reset", UpstreamUnavailable(f"replica {replica.id} failed: {exc}")) from None
            if not client.done:
                ex.ctx.error = "upstream_reset"
                self.metrics.upstream_errors.labels(replica.id, "reset_mid_stream").inc()
                self.count_failure(replica)
                return UpstreamUnavailable(f"replica {replica.id} failed mid-stream: {exc}", code="upstream_reset")
        return None

    def _timed_out(self, ex: Exchange, replica: Replica, stream: _Stream, in_time: bool) -> GatewayError:
        """A window closed (`in_time`: before the total deadline): whose stall it was, and what follows."""
        if stream.writing:  # the client took nothing for the window: its connection closes, the engine not blamed
            ex.ctx.error = "client_stalled"
            ex.out.drop()
            raise ConnectionResetError("the client took none of its stream for timeouts.stream_idle_s") from None
        if not stream.started and in_time:  # first_byte_s: the replica's failure, tried elsewhere
            raise Retryable("timeout", UpstreamTimeout(f"replica {replica.id} sent no token in time")) from None
        if not stream.started:  # the request's own deadline: no time left for another replica, none to blame
            ex.ctx.error = "total_timeout"
            self.metrics.upstream_errors.labels(replica.id, "timeout_total").inc()
            raise UpstreamTimeout("no token within timeouts.total_s", code="total_timeout") from None
        if not in_time:
            ex.ctx.error = "total_timeout"
            return UpstreamTimeout("the stream did not finish within timeouts.total_s", code=ex.ctx.error)
        ex.ctx.error = "stream_idle_timeout"
        self.metrics.upstream_errors.labels(replica.id, "stall_mid_stream").inc()
        self.count_failure(replica)
        return UpstreamTimeout(
            f"replica {replica.id} sent nothing for {self.timeouts.stream_idle_s:g} s", code=ex.ctx.error
        )

    async def _ended(self, ex: Exchange, replica: Replica, stream: _Stream, failure: GatewayError | None) -> int:
        """How the engine's stream ended, told to the client: whole, closed by the gateway, cut (an error event, or
        `Migration`), or the engine's own error event."""
        client = stream.client
        if not stream.started:
            raise Retryable("empty", UpstreamUnavailable(f"replica {replica.id} closed the stream empty"))
        if held := client.flush():  # cut with a finish event held back: it is the client's
            await client.write(held, first=False)
        if client.failed:  # the engine's own error event ended it (then `[DONE]`): relayed as it came, not retried
            ex.ctx.error = "upstream_error_event"
            await ex.out.end()
            return 502
        if not client.done and (closing := client.closing()) is not None:  # whole but for its last event
            await ex.out.write(closing)
            client.done = ex.ctx.answered = True
        if client.done:  # the answer and its last event reached the client: a failure after them is not its
            failure = ex.ctx.error = None
        elif failure is None and client.end is None:  # a stream without an end event ends with the body
            ex.ctx.answered = True
        elif failure is None:  # cut short without its end event ([DONE], message_stop)
            ex.ctx.error = "upstream_truncated"
            failure = UpstreamUnavailable(f"replica {replica.id} ended the stream early", code="upstream_truncated")
        if failure is None:  # a stream that starts and then stalls or breaks is no success: the breaker can open
            replica.record_success()
        if failure is not None and may_migrate(ex):
            raise Migration(failure)  # (or closed there, when nothing is left to generate)
        return await end_stream(ex, failure, client.last)
