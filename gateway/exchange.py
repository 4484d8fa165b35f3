"""One client request on its way through the proxy: everything an attempt needs, in one place.

The completion service builds an `Exchange` once the request is parsed, admitted and its prompt hashed; the proxy
(`gateway.proxy`) hands it to every attempt: the first try, the retries on other replicas, the continuation of a
stream whose engine failed (`gateway.migration`) and the prefill step of a split model (`gateway.disagg`). What
changes from attempt to attempt is written back here: the body the engine gets (`data`), the replicas tried, what
the client has been sent (`relayed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_pool.replica import Replica
from gateway.context import RequestContext
from gateway.migration import Relayed
from gateway.request_parse import ParsedRequest
from gateway.responder import Responder
from policies.base import RequestInfo


@dataclass(slots=True)
class Exchange:
    out: Responder  # how the client is answered
    method: str
    path: str  # as the client sent it, query included
    parsed: ParsedRequest  # the body as read once (`gateway.request_parse`)
    info: RequestInfo  # what routing knows of the request (prefix hashes, session, tenant)
    ctx: RequestContext  # the record the access log, metrics and traces read
    data: bytes  # the body the engine gets: the client's bytes unless the gateway had to change a field
    deadline: float  # time.monotonic() by which the whole answer must be done (timeouts.total_s)
    pinned: Replica | None = None  # the only replica that may answer (it holds a stored response)
    relayed: Relayed | None = None  # a stream that can continue elsewhere: what its client got so far
    tried: list[str] = field(default_factory=list)  # replica ids, in the order they were tried
    refused: list[Replica] = field(default_factory=list)  # replicas that answered 5xx (see proxy.forward)
    forward: dict[str, str] = field(default_factory=dict)  # client headers the engine gets (Endpoint.forward_headers)
    gated: bool = True  # False: routed past the replicas' capacity gates (it computes no KV: Endpoint.computes_kv)
    # a stored response's id, told once a stream names it: which replica holds it is known while it runs
    on_answer_id: Callable[[str], None] | None = None

    @property
    def stream(self) -> bool:
        return self.parsed.stream
