"""A loadgen sweep through a real kvgate in front of two simulated engines: the figures agree with the gateway's and
the engines' own counters, and a client that leaves right after the last event is not counted as a disconnect."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from loadgen import cli
from loadgen.promscrape import parse_metrics
from simengine import SimConfig
from tests.conftest import gateway_over_sims

SIM = SimConfig(model="sim", block_size=16, overhead_ms=1, prefill_us_per_token=20, decode_ms=2)


async def test_sweep_through_kvgate(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    cache_aware = {"routing": {"policy": "cache-aware"}, "cache": {"tokenizers": {"sim": "sim"}}}
    async with gateway_over_sims([SIM, SIM], **cache_aware) as (gw, sims):
        argv = ["sweep", "--url", gw.url, "--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "4",
                "--system-len", "256", "--question-len", "16", "--output-len", "8", "--concurrencies", "1,4",
                "--metrics-url", f"{gw.url}/metrics", *[a for s in sims for a in ("--metrics-url", f"{s.url}/metrics")],
                "--out", str(tmp_path), "--no-charts"]  # fmt: skip
        assert await cli.amain(argv) == 0
        doc = json.loads((tmp_path / "result.json").read_text())
        gateway_metrics = parse_metrics(await (await http.get(gw.url + "/metrics")).text())
    points = doc["points"]
    assert [p["load"] for p in points] == [1, 4]
    for p in points:
        s = p["summary"]
        assert s["requests"] == s["succeeded"] == 16
        assert sum(p["replica_load"].values()) == 16  # every request names the replica kvgate chose
        assert p["prefix_cache"]["queries"] == s["prompt_tokens"]  # the engines counted what usage reported
        assert p["prefix_cache"]["hits"] == s["cached_tokens"]
    assert {r for p in points for r in p["replica_load"]} == {s.url.split("://")[1] for s in sims}
    assert doc["recommendation"]["replicas"] == 2
    assert gateway_metrics.get("kvgate_client_disconnects_total", 0.0) == 0.0
    assert gateway_metrics["kvgate_requests_total"] == 32


async def test_a_sweep_counts_refusals_as_load_shed_not_as_failures(tmp_path: Path) -> None:
    """A gateway whose gate refuses at once (no queue): the refused requests are counted as such, and the sweep's
    knee and verdicts do not call a point where admission sheds load "failing"."""
    gated = {"admission": {"replica_max_concurrency": 1, "queue": {"max_queued": 0}}}
    slow = SimConfig(model="sim", block_size=16, overhead_ms=1, prefill_us_per_token=20, decode_ms=10)
    async with gateway_over_sims([slow, slow], **gated) as (gw, _):
        argv = ["sweep", "--url", gw.url, "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "6",
                "--system-len", "64", "--question-len", "16", "--output-len", "16", "--concurrencies", "1,6",
                "--out", str(tmp_path), "--no-charts"]  # fmt: skip
        assert await cli.amain(argv) == 0
    low, high = json.loads((tmp_path / "result.json").read_text())["points"]
    assert low["summary"]["refused"] == 0 and low["summary"]["succeeded"] == 12
    refused = high["summary"]["refused"]
    assert refused > 0 and high["summary"]["failed"] == refused  # every failure was a 503 with Retry-After
    assert high["verdict"] != "failing" and low["verdict"] != "failing"
    assert "refused %" in (tmp_path / "report.html").read_text()
