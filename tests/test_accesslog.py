"""The access log: one line per request, plain or JSON, with the fields the README lists."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from engine_pool.launcher import free_port
from gateway.accesslog import access_record, plain_line
from gateway.context import RequestContext
from simengine import SimConfig, run_sim_engine
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


def test_a_clients_string_that_could_read_as_more_keys_is_quoted() -> None:
    """A request id or model name with a quote, `=` or a space is one quoted logfmt value: it cannot make the line
    say `status=200` for a request that got a 404."""
    ctx = RequestContext('inj1"status=200"error=-', "chat", 0.0, model="my model", status=404)
    line = plain_line(ctx)
    assert line.startswith('request_id="inj1\\"status=200\\"error=-" tenant=- endpoint=chat model="my model" ')
    assert " status=404 " in line and line.count("status=") == 2  # its own, and the one inside the quoted id


async def test_requests_refused_before_any_handler_get_their_line_and_their_count(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A repeated x-request-id (400), a body announced over the limit with `Expect` (413), a wrong admin key (401),
    a path no route takes (404) and a header line over the limit (431, refused as it arrived) are logged and counted
    in kvgate_requests_total like any request."""
    caplog.set_level(logging.INFO, logger="kvgate.access")
    async with gateway_over_sims(
        [SIM], server={"access_log": "json", "max_body_bytes": 1000}, admin={"key": "adm"}
    ) as (
        gw,
        _,
    ):
        twice = [("x-request-id", "a"), ("x-request-id", "b")]
        async with http.post(gw.url + "/v1/chat/completions", json={}, headers=twice) as resp:
            assert resp.status == 400
        big = {"Expect": "100-continue", "Content-Length": "5000", "Content-Type": "application/json"}
        async with http.post(gw.url + "/v1/completions", data=b"x" * 5000, headers=big) as resp:
            assert resp.status == 413
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 401
        async with http.get(gw.url + "/no/such/route") as resp:
            assert resp.status == 404
        async with http.get(gw.url + "/health", headers={"x-big": "a" * 9000}) as resp:  # over max_header_bytes
            assert resp.status == 431
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    seen = [(line["endpoint"], line["status"]) for line in lines]
    assert seen == [("chat", 400), ("completions", 413), ("admin", 401), ("unrouted", 404), ("unrouted", 431)]
    assert all(line["time"] and line["request_id"] for line in lines)
    for endpoint, status in seen:
        sample = f'kvgate_requests_total{{endpoint="{endpoint}",model="-",replica="-",status="{status}"}} 1.0'
        assert sample in metrics, sample


async def test_the_served_gateway_writes_json_lines_at_any_log_level(tmp_path: Path) -> None:
    """`kvgate serve --access-log json --log-level WARNING`: the access log still comes (`server.access_log` is its
    switch, not the log level), and each of its lines on stderr is one JSON object (no logging prefix before it)."""
    async with run_sim_engine(SIM) as sim, aiohttp.ClientSession() as http:
        port = free_port()
        log = tmp_path / "kvgate.log"
        argv = ["serve", "--engine", sim.url, "--port", str(port), "--access-log", "json", "--log-level", "WARNING"]
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvgate", *argv, stdout=out, stderr=out)
        try:

            async def ready() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{port}/ready") as resp:
                        return resp.status == 200
                return False

            deadline = asyncio.get_running_loop().time() + 60
            while not await ready():
                assert asyncio.get_running_loop().time() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.1)
            body = {"model": "sim", "prompt": "hello", "max_tokens": 2}
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 30)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [(r["endpoint"], r["status"]) for r in records] == [("completions", 200)]
    assert records[0]["time"].endswith("+00:00")
