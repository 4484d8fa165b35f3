"""Tracing along the request path, received by an OTLP/HTTP receiver on loopback (the protocol's own protobuf
messages, decoded with opentelemetry-proto): a request with a client `traceparent` yields one span per stage in the
client's trace, parented as the docs say, the engine receives a `traceparent` naming the upstream span, and a
request without one starts its own trace; with tracing off the client's traceparent reaches the engine as sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.admission.config import hash_key
from simengine import SimConfig
from tests.conftest import gateway_over_sims, serving, wait_for

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
STAGES = ["kvgate.request", "kvgate.admission", "kvgate.route", "kvgate.upstream", "kvgate.relay"]


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[str, list[Any]]]:
    """POST /v1/traces, as an OpenTelemetry collector's OTLP/HTTP receiver takes it: every span received."""
    spans: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    async with serving(app) as url:
        yield f"{url}/v1/traces", spans


async def chat(http: aiohttp.ClientSession, url: str, headers: dict[str, str], stream: bool) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4,
            "stream": stream}  # fmt: skip
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()


async def test_a_traced_request_yields_a_span_per_stage_in_the_clients_trace(http: aiohttp.ClientSession) -> None:
    async with otlp_receiver() as (endpoint, spans):
        tracing = {"otlp_endpoint": endpoint}
        async with gateway_over_sims([SimConfig()], tracing=tracing, routing={"policy": "cache-aware"}) as (gw, sims):
            await chat(http, gw.url, {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01", "tracestate": "v=1"}, stream=True)
            await chat(http, gw.url, {}, stream=False)  # no traceparent: a trace of its own (sample_ratio 1)
            unsampled = f"00-{TRACE}-{CLIENT_SPAN}-00"
            await chat(http, gw.url, {"traceparent": unsampled, "tracestate": "v=2"}, stream=False)
        # the gateway flushed its spans on shutdown
        traced = [s for s in spans if s.trace_id.hex() == TRACE]
        by_name = {s.name: s for s in traced}
        assert sorted(by_name) == sorted(STAGES)
        request = by_name["kvgate.request"]
        assert request.parent_span_id.hex() == CLIENT_SPAN
        assert all(by_name[n].parent_span_id == request.span_id for n in STAGES[1:])
        for earlier, later in [("kvgate.admission", "kvgate.route"), ("kvgate.route", "kvgate.upstream"),
                               ("kvgate.upstream", "kvgate.relay")]:  # fmt: skip
            assert by_name[earlier].end_time_unix_nano <= by_name[later].end_time_unix_nano
        assert request.start_time_unix_nano <= by_name["kvgate.admission"].start_time_unix_nano
        assert by_name["kvgate.relay"].end_time_unix_nano <= request.end_time_unix_nano
        route = {a.key: a.value for a in by_name["kvgate.route"].attributes}
        assert route["kvgate.route_reason"].string_value == "cold-least-load"
        # the engine got the trace context naming kvgate's upstream span: its own spans join the trace there
        upstream = by_name["kvgate.upstream"].span_id.hex()
        assert sims[0].engine.traceparents[0] == f"00-{TRACE}-{upstream}-01"
        others = [s for s in spans if s.trace_id.hex() != TRACE]
        assert len({s.trace_id for s in others}) == 1  # the request without a traceparent; the unsampled one: none
        # the second request's prompt was cached where it went: its route span says what the index predicted
        own_route = next(s for s in others if s.name == "kvgate.route")
        predicted = {a.key: a.value for a in own_route.attributes}["kvgate.predicted_cached_tokens"].int_value
        assert predicted > 0
        # not traced here, the unsampled request's context still reaches the engine as the client sent it, and each
        # request's tracestate with its traceparent
        assert len(sims[0].engine.traceparents) == 3 and sims[0].engine.traceparents[2] == unsampled
        assert list(sims[0].engine.tracestates) == ["v=1", "v=2"]


async def test_a_refused_request_has_an_admission_span_ending_at_its_refusal(http: aiohttp.ClientSession) -> None:
    """A wrong key (401) and a tenant over its request rate (429): each request's trace has its admission span,
    naming the refusal, and no route or upstream span (the engine never saw them)."""
    admission = {"auth": True, "tenants": {"acme": {"keys": [hash_key("sk-acme")],
                                                    "limits": {"requests_per_minute": 1}}}}  # fmt: skip
    traces = {"wrong key": "1" * 32, "first": "2" * 32, "over the rate": "3" * 32}
    async with otlp_receiver() as (endpoint, spans):
        tracing = {"otlp_endpoint": endpoint}
        async with gateway_over_sims([SimConfig()], tracing=tracing, admission=admission) as (gw, _):
            for what, key, status in (("wrong key", "sk-nobody", 401), ("first", "sk-acme", 200),
                                      ("over the rate", "sk-acme", 429)):  # fmt: skip
                headers = {"traceparent": f"00-{traces[what]}-{CLIENT_SPAN}-01", "Authorization": f"Bearer {key}"}
                body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
                    assert resp.status == status, await resp.text()
    for what, code in (("wrong key", "invalid_api_key"), ("over the rate", "rate_limit_exceeded")):
        by_name = {s.name: s for s in spans if s.trace_id.hex() == traces[what]}
        assert sorted(by_name) == ["kvgate.admission", "kvgate.request"], what
        refused = {a.key: a.value.string_value for a in by_name["kvgate.admission"].attributes}["kvgate.refused"]
        assert refused == code
        assert by_name["kvgate.admission"].end_time_unix_nano <= by_name["kvgate.request"].end_time_unix_nano
    admitted = {s.name: s for s in spans if s.trace_id.hex() == traces["first"]}
    assert sorted(admitted) == sorted(STAGES) and "kvgate.refused" not in {
        a.key for a in admitted["kvgate.admission"].attributes
    }


async def test_with_tracing_off_the_clients_trace_context_reaches_the_engine(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SimConfig()]) as (gw, sims):
        sent = f"00-{TRACE}-{CLIENT_SPAN}-01"
        await chat(http, gw.url, {"traceparent": sent}, stream=True)
        await chat(http, gw.url, {"traceparent": "00-not-a-trace-context"}, stream=True)  # not passed on
        await wait_for(lambda: sims[0].engine.stats.completed == 2, what="the requests completed")
        assert list(sims[0].engine.traceparents) == [sent]


def test_the_pool_turns_on_vllms_own_tracing() -> None:
    from engine_pool.spec import PoolConfig
    from engine_pool.vllm_command import EngineLaunchSpec, vllm_argv

    cfg = PoolConfig.model_validate(
        {"models": [{"name": "m", "kind": "sim", "otlp_traces_endpoint": "http://collector:4317"}]}
    )
    argv = vllm_argv(
        EngineLaunchSpec(model="/models/m", port=1, otlp_traces_endpoint=cfg.models[0].otlp_traces_endpoint)
    )
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
    assert "--otlp-traces-endpoint" not in vllm_argv(EngineLaunchSpec(model="/models/m", port=1))
