"""The access log: one line per request, plain or JSON, with the fields the README lists."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from gateway.accesslog import access_record, plain_line
from gateway.context import RequestContext
from simengine import SimConfig
from tests.conftest import gateway_over_sims

SIM = SimConfig(model="sim", instant=True)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"ttft_s": 0.0012345, "duration_s": 0.5, "prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 3},
        {"status": 499, "error": "upstream_timeout", "client_disconnected": True, "queue_wait_s": 1.25},
    ],
)
def test_the_plain_line_renders_every_field_of_the_record(fields: dict[str, object]) -> None:
    ctx = RequestContext("req-1", "chat", 0.0)
    for name, value in fields.items():
        setattr(ctx, name, value)
    expected = " ".join(f"{k}={'-' if v is None else v}" for k, v in access_record(ctx).items())
    assert plain_line(ctx) == expected


@pytest.mark.parametrize("fmt", ["plain", "json"])
async def test_one_line_per_request(fmt: str, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.access")
    async with gateway_over_sims([SIM], server={"access_log": fmt}) as (gw, _):
        body = {"model": "sim", "prompt": "hello", "max_tokens": 3}
        async with http.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "abc-1"}) as resp:
            assert resp.status == 200
        async with http.post(gw.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as resp:
            assert resp.status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
    assert len(lines) == 2
    if fmt == "json":
        ok, missing = (json.loads(line) for line in lines)
        assert ok["request_id"] == "abc-1" and ok["status"] == 200 and ok["completion_tokens"] == 3
        assert ok["ttft_ms"] is not None and ok["replica"] != "-"
        assert missing["status"] == 404 and missing["error"] == "model_not_found"
    else:
        assert lines[0].startswith("request_id=abc-1 tenant=anonymous endpoint=completions model=sim ")
        assert " status=200 " in lines[0] and " completion_tokens=3 " in lines[0]
        assert " status=404 " in lines[1] and " error=model_not_found " in lines[1]
