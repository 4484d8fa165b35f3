"""The replica set against a real simulated engine: probes, model discovery, listeners hearing the KV layout, and
scraped load that the gateway knows has finished since."""

from __future__ import annotations

import asyncio
import time
from contextlib import closing

import aiohttp

from engine_pool.http_client import UpstreamClient
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from simengine import SimConfig, run_sim_engine


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int | None, int | None]] = []

    def _add(self, kind: str, r: Replica) -> None:
        self.events.append((kind, r.id, r.metrics.block_size, r.metrics.num_blocks))

    def replica_up(self, replica: Replica) -> None:
        self._add("up", replica)

    def replica_down(self, replica: Replica) -> None:
        self._add("down", replica)

    def replica_removed(self, replica: Replica) -> None:
        self._add("removed", replica)


async def test_probe_discovers_model_and_listeners_hear_the_kv_layout() -> None:
    with closing(UpstreamClient()) as client:
        async with run_sim_engine(SimConfig(model="m", block_size=32, num_blocks=100)) as engine:
            replicas = ReplicaSet(client, interval_s=60, metrics_interval_s=60)
            rec = Recorder()
            replicas.add_listener(rec)
            replica = Replica("r", engine.url, None, managed=True)
            assert await replicas.probe_health(replica) and replica.model == "m" and replica.max_model_len
            replicas.set_health(replica, True)  # e.g. the supervisor after warm-up, before any metrics scrape
            assert await replicas.scrape_metrics(replica)
            assert await replicas.scrape_metrics(replica)  # unchanged layout: no second announcement
            replicas.set_health(replica, False)
            assert rec.events == [("up", "r", None, None), ("up", "r", 32, 100), ("down", "r", 32, 100)]


async def test_a_scraped_running_request_that_finished_stops_counting_before_the_next_scrape() -> None:
    with closing(UpstreamClient()) as client:
        async with run_sim_engine(SimConfig(model="m", decode_ms=20.0)) as engine, aiohttp.ClientSession() as session:
            replicas = ReplicaSet(client, interval_s=60, metrics_interval_s=60)
            replica = Replica("r", engine.url, "m")
            body = {"model": "m", "prompt": "hello there", "max_tokens": 15}

            started = replica.begin()
            request = asyncio.create_task(session.post(f"{engine.url}/v1/completions", json=body))
            await engine.engine.wait_until(lambda e: e.running == 1)
            assert await replicas.scrape_metrics(replica)
            assert replica.snapshot(time.monotonic()).running == 1  # the scrape saw it running
            late = replica.begin()  # sent after the scrape: the scraped count never included it
            replica.end(late)
            assert replica.snapshot(time.monotonic()).running == 1
            (await request).release()
            replica.end(started)
            assert replica.snapshot(time.monotonic()).running == 0  # finished since: no longer load, scrape or not
            assert replica.metrics.running == 1  # the scrape itself is kept as it was
            assert await replicas.scrape_metrics(replica)
            assert (replica.metrics.running, replica.snapshot(time.monotonic()).running) == (0, 0)
