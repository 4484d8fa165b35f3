"""The fast lane: a non-streamed request on the fast path answered without a task or a coroutine.

`dispatch` takes a parsed request through `CompletionService.begin_now` (identify, validate, admit, route, send on
an idle kept-alive connection: all synchronous in the common case) and then waits for the engine with a callback on
the upstream response (`UpstreamResponse.on_settled`) instead of a task. When the engine's whole answer is in and
it is a success, `Lane.settled` writes it to the client and ends the request right there, inside the upstream
socket's read callback. Everything else goes to `CompletionService.handle` in a task, which takes over from where
`begin_now` or the lane stopped: an invalid request from the start; cache-aware routing at its prefix info; the
queue or a remote quota store at admission; a stream, no idle connection, an admission refusal or no replica after
them; an engine error, a timeout or a body still arriving after the headers from the first attempt on (retries
included).
Saves per request, against `handle` in a task: the task and its scheduling (one loop iteration before anything
is sent upstream), five coroutines, and the loop iteration between the engine's answer and the reply.
The client leaving cancels the lane like a task: the engine request is aborted at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from gateway.completion import Begun, CompletionService
from gateway.errors import GatewayError, render_error
from gateway.proxy import usage_of
from gateway.request_parse import Endpoint
from gateway.responder import FastResponder

log = logging.getLogger("kvgate.lane")

Handler = Coroutine[Any, Any, None]


class LaneHost(Protocol):
    """What a lane needs of its connection (gateway.fastpath.FastPathProtocol)."""

    def run_handler(self, handler: Handler, out: FastResponder) -> None:
        """Go on in a task (the request leaves the lane)."""
        ...

    def lane_done(self, out: FastResponder) -> None:
        """The lane answered the request."""
        ...


class Lane:
    __slots__ = ("begun", "ended", "headers", "host", "out", "service")

    def __init__(
        self, service: CompletionService, begun: Begun, out: FastResponder, host: LaneHost, headers: Mapping[str, str]
    ) -> None:
        self.service = service
        self.begun = begun
        self.out = out
        self.host = host
        self.headers = headers
        self.ended = False

    def settled(self) -> None:
        """The engine's headers arrived or the attempt failed: answer now, or let `handle` go on in a task."""
        if self.ended:
            return
        begun, out = self.begun, self.out
        first = begun.first
        assert first is not None and first.upstream is not None and begun.ticket is not None
        upstream = first.upstream
        if not (upstream.complete and upstream.error is None and upstream.status < 400):
            self.ended = True
            self.host.run_handler(self._handler(), out)
            return
        self.ended = True
        service, ctx, replica = self.service, begun.ctx, first.replica
        try:
            raw = upstream.body_now()
            try:  # the answer first: the bookkeeping below is off its path
                out.send_now(upstream.status, service.proxy.answer_headers(replica, first.decision, ctx), raw)
                ctx.status, ctx.delivered = upstream.status, True
            except ConnectionResetError:
                service.client_left(ctx)
            ctx.set_usage(usage_of(raw))
        except Exception:  # a bug: answer 500 if nothing went out yet, as `handle` does
            log.exception("fast lane: request %s failed", out.request_id)
            self._internal_error()
        finally:
            upstream.release()
            replica.end(first.started)
            self._finish()

    def cancel(self) -> None:
        """The client left (or shutdown): abort the engine request and end the request as a task would."""
        if self.ended:
            return
        self.ended = True
        first = self.begun.first
        assert first is not None and first.upstream is not None
        first.upstream.close()  # the engine sees its client leave and stops generating
        first.replica.end(first.started)
        self.service.client_left(self.begun.ctx)
        self._finish()

    def _internal_error(self) -> None:
        out, ctx = self.out, self.begun.ctx
        if out.started:
            out.complete = False  # the connection closes: the client sees a truncated answer, not a hang
            return
        err = GatewayError("internal gateway error")
        ctx.status, ctx.error = err.status, err.code
        status, headers, body = render_error(err, request_id=ctx.request_id)
        with contextlib.suppress(ConnectionResetError):
            out.send_now(status, headers, body)

    def _finish(self) -> None:
        """Release the admission ticket, record the request, and give the connection its next request; the
        connection moves on even if the bookkeeping fails."""
        begun, service = self.begun, self.service
        assert begun.ticket is not None
        try:
            finished = service.admission.finish_now(begun.ticket, begun.ctx)
            assert finished, "a lane's ticket holds no remote lease (admit_now hands out none)"
            service.done(begun.ctx, begun.info)
        finally:
            self.host.lane_done(self.out)

    def _handler(self) -> Handler:
        begun = self.begun
        return self.service.handle(
            begun.parsed.endpoint, self.headers, begun.raw, begun.ctx.request_id, self.out, begun
        )


def dispatch(
    service: CompletionService,
    endpoint: Endpoint,
    headers: Mapping[str, str],
    body: bytes,
    request_id: str,
    out: FastResponder,
    host: LaneHost,
) -> Lane | Handler:
    """The lane answering the request (in flight), or the handler to run in a task."""
    begun = service.begin_now(endpoint, headers, body, request_id)
    if begun is None:
        return service.handle(endpoint, headers, body, request_id, out)
    first = begun.first
    if first is None or first.upstream is None or begun.parsed.stream:  # streams relay in a task
        return service.handle(endpoint, headers, body, request_id, out, begun)
    lane = Lane(service, begun, out, host, headers)
    first.upstream.on_settled = lane.settled
    return lane
