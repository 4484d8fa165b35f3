"""The floor of a Python proxy on this machine, next to kvgate: CPU per request (concurrency 64) of
(1) one instant simulated engine alone (a plain aiohttp server), (2) a minimal proxy in front of it (an httptools
server protocol + kvgate's upstream client, no routing, admission or metrics), (3) `kvgate serve` in front of it;
and for (2) and (3) the latency
they add at concurrency 1 (p50 of alternating direct / proxied requests, as `bench_gateway_overhead.py` measures).
Shows how much of kvgate's per-request cost is the HTTP server and its own logic rather than sockets and hops.
Rerun: `python bench/bench_proxy_floor.py [--repeat N] [--requests N] [--pairs N]` (3 rounds: about 3 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import cpu_seconds, free_port, kvgate, sim_engine_processes
from bench_gateway_overhead import latency


class _MinimalProxy(asyncio.Protocol):
    """Non-streaming POST relay, one request at a time per connection (enough for this measurement)."""

    def __init__(self, pool: object) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self._relay(body))

    async def _relay(self, body: bytes) -> None:
        resp = await self.pool.request(  # type: ignore[attr-defined]
            "POST", "/v1/completions", body, {"Content-Type": "application/json"}, connect_timeout_s=5
        )
        await resp.headers_ready
        data = await resp.read(1 << 28)  # the gateway's default server.max_answer_bytes
        resp.release()
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
        self.transport.write(head + data)  # type: ignore[attr-defined]


def serve_minimal_proxy(port: int, upstream_port: int) -> None:
    from engine_pool.http_client import UpstreamClient

    async def main() -> None:
        pool = UpstreamClient().pool("127.0.0.1", upstream_port)
        server = await asyncio.get_running_loop().create_server(lambda: _MinimalProxy(pool), "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


async def _load(url: str, n: int, concurrency: int) -> None:
    body = {"model": "sim", "prompt": "hello world " * 8, "max_tokens": 16}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def cpu_ms_per_request(url: str, pid: int, n: int, concurrency: int) -> float:
    asyncio.run(_load(url, 300, concurrency))
    c0 = cpu_seconds(pid)
    asyncio.run(_load(url, n, concurrency))
    return (cpu_seconds(pid) - c0) / n * 1000


def measure(direct: str, url: str, pid: int, args: argparse.Namespace) -> tuple[float, float | None]:
    """(CPU ms per request, added p50 ms at concurrency 1)."""
    added = asyncio.run(latency(direct, url, args.pairs, stream=False))["added_p50_ms"]
    return cpu_ms_per_request(url, pid, args.requests, args.concurrency), added


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve_minimal_proxy(int(sys.argv[2]), int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--pairs", type=int, default=1000, help="direct/proxied request pairs for the added latency")
    p.add_argument("--repeat", type=int, default=3, help="rounds, each measuring every process in turn")
    args = p.parse_args()
    rows: dict[str, list[tuple[float, float | None]]] = {}
    with sim_engine_processes(1, "--instant") as [(engine_url, engine_pid)], ExitStack() as stack:
        port = free_port()
        proxy = subprocess.Popen([sys.executable, __file__, "--serve", str(port), engine_url.rsplit(":", 1)[1]])
        stack.callback(proxy.wait)
        stack.callback(proxy.terminate)
        time.sleep(1.0)
        procs = [("minimal proxy (httptools server + kvgate upstream client)", f"http://127.0.0.1:{port}", proxy.pid)]
        gw, pid = stack.enter_context(
            kvgate([engine_url], "--policy", "least-load", "--access-log", "off", "--log-level", "WARNING")
        )
        procs.append(("kvgate serve (aiohttp server, least-load, admission defaults)", gw, pid))
        for _ in range(args.repeat):
            alone = cpu_ms_per_request(engine_url, engine_pid, args.requests, args.concurrency)
            rows.setdefault("engine alone (aiohttp server)", []).append((alone, None))
            for name, url, pid in procs:
                rows.setdefault(name, []).append(measure(engine_url, url, pid, args))
    print(f"medians (ranges) over {args.repeat} rounds, each measuring every process in turn")
    print("| process | CPU ms per request | added p50 ms |\n|---|---|---|")
    for name, values in rows.items():
        cpu = [c for c, _ in values]
        added = [a for _, a in values if a is not None]
        cells = [f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" if v else "" for v in (cpu, added)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
