"""Engines found by DNS, with a real DNS server: dnsmasq (Debian's package) on a loopback port serves the engine
records, simulated engines listen on 127.0.0.2 and 127.0.0.3 (all of 127/8 is loopback). Adding a record brings the
engine in only after its warm-up completion; removing one drains it; a stream of requests through kvgate sees no
failure throughout. SRV records give each engine its own port."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import dns.rdatatype
import dns.resolver
import pytest

from engine_pool.discovery import DnsDiscovery, DnsTarget, resolve
from engine_pool.http_client import UpstreamClient
from engine_pool.replica_set import ReplicaSet
from gateway.embedded import running_gateway
from gateway.keys import DISCOVERY, REPLICAS
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import gateway_config, wait_for

DNSMASQ = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
needs_dnsmasq = pytest.mark.skipif(DNSMASQ is None, reason="needs dnsmasq (apt install dnsmasq-base)")


def _free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 at this moment (dnsmasq binds both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
            udp.bind(("127.0.0.1", 0))
            port: int = udp.getsockname()[1]
            try:
                tcp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Dnsmasq:
    """dnsmasq answering only from a hosts file (re-read on SIGHUP) and `extra` options, on a free loopback port.
    A port taken between the probe and dnsmasq's bind (another test's socket) is retried on a new port."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.hosts = tmp / "hosts"
        self.hosts.touch()
        for _ in range(5):
            err = self._start(extra)
            if err is None:
                return
            if b"Address already in use" not in err:
                break
        raise RuntimeError(f"dnsmasq did not start: {err!r}")

    def _start(self, extra: tuple[str, ...]) -> bytes | None:
        """None once dnsmasq accepts on its TCP port, else what it printed."""
        self.port = _free_port()
        argv = [str(DNSMASQ), "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                "--bind-interfaces", "--listen-address=127.0.0.1", f"--port={self.port}",
                f"--addn-hosts={self.hosts}", "--local-ttl=0", f"--user={getpass.getuser()}", "--pid-file=",
                "--local=/test/",  # authoritative for .test: a missing record is NODATA / NXDOMAIN, not REFUSED
                *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:  # up once it accepts on its TCP port
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else b""
                self.stop()
                return err or b"timed out"
            time.sleep(0.05)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_records(self, lines: list[str]) -> None:
        self.hosts.write_text("".join(f"{line}\n" for line in lines))
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@contextlib.contextmanager
def dnsmasq(tmp: Path, *extra: str) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp, *extra)
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def sims_on(hosts: list[str], port: int) -> AsyncIterator[list[SimServer]]:
    async with contextlib.AsyncExitStack() as stack:
        cfg = dict(model="sim-model", overhead_ms=1.0, decode_ms=2.0, decode_ms_per_seq=0.0, prefill_us_per_token=1.0)
        yield [await stack.enter_async_context(run_sim_engine(SimConfig(host=h, port=port, **cfg))) for h in hosts]


@needs_dnsmasq
async def test_records_come_and_go_engines_join_after_warm_up_and_drain_without_a_failed_request(
    tmp_path: Path,
) -> None:
    port = _free_port()
    with dnsmasq(tmp_path) as dns:
        dns.set_records(["127.0.0.2 pool.test"])
        async with sims_on(["127.0.0.2", "127.0.0.3"], port) as (a, b):
            target = {"name": "pool.test", "port": port, "nameserver": dns.nameserver, "interval_s": 0.2}
            cfg = gateway_config([], engines=[{"dns": target, "name": "pool"}])
            async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
                replicas = gw.app[REPLICAS]
                routable = lambda: sorted(r.id for r in replicas if r.routable(time.monotonic()))  # noqa: E731
                await wait_for(lambda: routable() == [f"pool-127.0.0.2:{port}"], what="the first engine")
                assert a.engine.stats.completed >= 1  # its warm-up completion came first

                results: list[tuple[int, str]] = []
                stop = asyncio.Event()

                async def load() -> None:  # a steady stream of streamed completions, 4 at a time
                    async def one(i: int) -> None:
                        body = {"model": "sim-model", "prompt": f"request {i} " * 20, "max_tokens": 30, "stream": True}
                        async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                            text = await resp.text()
                            results.append((resp.status, resp.headers.get("x-kvgate-replica", "")))
                            assert "[DONE]" in text, text

                    i = 0
                    while not stop.is_set():
                        await asyncio.gather(*(one(i + k) for k in range(4)))
                        i += 4

                task = asyncio.create_task(load())
                await wait_for(lambda: len(results) >= 8, what="load through the first engine")
                warmed_before = b.engine.stats.completed
                dns.set_records(["127.0.0.2 pool.test", "127.0.0.3 pool.test"])
                second = f"pool-127.0.0.3:{port}"
                await wait_for(lambda: second in routable(), what="the added engine")
                assert b.engine.stats.completed > warmed_before  # warmed up before it was routable
                await wait_for(lambda: any(rep == second for _, rep in results), what="requests on the added engine")
                dns.set_records(["127.0.0.3 pool.test"])  # the first engine's record goes: it drains
                await wait_for(lambda: replicas.get(f"pool-127.0.0.2:{port}") is None, what="the drained engine gone")
                drained_at = len(results)
                await wait_for(lambda: len(results) >= drained_at + 8, what="load after the drain")
                stop.set()
                await task
            assert results and all(status == 200 for status, _ in results), results
            assert {rep for _, rep in results[drained_at:]} == {second}
            assert a.engine.stats.cancelled == 0  # every request it held finished: drained, not cut


@needs_dnsmasq
async def test_srv_records_carry_ports_and_a_dns_outage_keeps_the_engines(tmp_path: Path) -> None:
    async with sims_on(["127.0.0.2", "127.0.0.2"], 0) as (a, b):
        srv = [f"--srv-host=_vllm._tcp.pool.test,engine.test,{s.port}" for s in (a, b)]
        with dnsmasq(tmp_path, "--host-record=engine.test,127.0.0.2", *srv) as dns:
            target = DnsTarget(id="pool", name="_vllm._tcp.pool.test", srv=True, nameserver=dns.nameserver)
            assert await resolve(target) == {("127.0.0.2", a.port), ("127.0.0.2", b.port)}
            entry = {"name": "_vllm._tcp.pool.test", "srv": True, "nameserver": dns.nameserver, "interval_s": 0.2,
                     "timeout_s": 0.3}  # fmt: skip
            async with running_gateway(gateway_config([], engines=[{"dns": entry}])) as gw:
                replicas = gw.app[REPLICAS]
                both = lambda: sum(r.routable(time.monotonic()) for r in replicas) == 2  # noqa: E731
                await wait_for(both, what="both engines")
                dns.stop()  # resolutions now time out: the engines stay (a DNS outage must not empty the pool)
                discovery = gw.app[DISCOVERY][0]
                await wait_for(lambda: discovery.failing >= 2, what="two failed resolutions")
                assert both()
                async with aiohttp.ClientSession() as http, http.get(f"{gw.url}/metrics") as resp:
                    text = await resp.text()
                assert 'kvgate_discovery_endpoints{target="_vllm._tcp.pool.test"} 2.0' in text
                assert 'kvgate_discovery_failing_resolutions{target="_vllm._tcp.pool.test"}' in text


async def test_a_record_back_while_its_engine_drains_during_warm_up_still_warms_it() -> None:
    # no DNS server needed: the answers are applied directly, vanished and back within one tick
    async with run_sim_engine(SimConfig(model="sim-model")) as sim:
        client = UpstreamClient()
        replicas = ReplicaSet(client, interval_s=0.1, timeout_s=1.0, metrics_interval_s=0.1)
        discovery = DnsDiscovery(DnsTarget(id="pool", name="unused", port=sim.port, interval_s=0.1), replicas)
        try:
            endpoint = ("127.0.0.1", sim.port)
            discovery.apply({endpoint})
            discovery.apply(set())  # gone before its warm-up finished: draining, the warm-up cancelled
            discovery.apply({endpoint})  # back: it serves again, and must still pass its warm-up
            (replica,) = list(replicas)
            await wait_for(lambda: replica.routable(time.monotonic()), what="the revived engine warm and routable")
            assert sim.engine.stats.completed >= 1 and not replica.draining
        finally:
            await discovery.close()
            await replicas.close()
            client.close()


async def test_the_connections_of_engines_gone_from_dns_go_with_them() -> None:
    """Pods come and go behind a DNS name: each endpoint that leaves takes its connection pool with it, so the
    gateway keeps pools for the engines it routes to, not for every address it ever saw."""
    async with run_sim_engine(SimConfig(model="sim-model")) as one, run_sim_engine(SimConfig(model="sim-model")) as two:
        client = UpstreamClient()
        replicas = ReplicaSet(client, interval_s=0.1, timeout_s=1.0, metrics_interval_s=0.1)
        discovery = DnsDiscovery(DnsTarget(id="pool", name="unused", port=one.port, interval_s=0.1), replicas)
        try:
            discovery.apply({("127.0.0.1", one.port), ("127.0.0.1", two.port)})
            await wait_for(lambda: len(client) == 2, what="both engines probed")
            discovery.apply({("127.0.0.1", two.port)})  # the first pod leaves
            await wait_for(lambda: len(list(replicas)) == 1, what="its replica removed")
            await wait_for(lambda: len(client) == 1, what="its connection pool gone")
        finally:
            await discovery.close()
            await replicas.close()
            client.close()


class _FlakyResolver:
    """A resolver whose first round fails as no resolver error does (the socket's OSError: a network unreachable),
    then answers the engine's address."""

    def __init__(self) -> None:
        self.calls = 0

    async def resolve(self, name: str, rdtype: object, search: bool = True) -> list[object]:
        self.calls += 1
        if self.calls == 1:
            raise OSError("network is unreachable")
        if rdtype == dns.rdatatype.AAAA:
            raise dns.resolver.NoAnswer
        return [SimpleNamespace(to_text=lambda: "127.0.0.1")]


async def test_a_round_that_fails_unexpectedly_does_not_end_discovery() -> None:
    async with run_sim_engine(SimConfig(model="sim-model")) as sim:
        client = UpstreamClient()
        replicas = ReplicaSet(client, interval_s=0.1, timeout_s=1.0, metrics_interval_s=0.1)
        discovery = DnsDiscovery(DnsTarget(id="pool", name="pool.test", port=sim.port, interval_s=0.05), replicas)
        discovery._resolver = _FlakyResolver()  # type: ignore[assignment]
        try:
            discovery.start()
            await wait_for(lambda: len(list(replicas)) == 1, what="the engine found after the failed round")
        finally:
            await discovery.close()
            await replicas.close()
            client.close()
