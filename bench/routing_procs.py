"""Processes of the routing benchmark: simulated engines and kvgate gateways as child processes, started in
parallel (every child is launched first, then waited for), each in its own session so a SIGTERM to its group
stops it and nothing else. Ports are picked free (`bench._procs.free_port`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import yaml

from bench._procs import free_port, sglang_argv, wait_http


@dataclass(frozen=True, slots=True)
class SimCosts:
    block_size: int = 16
    max_num_seqs: int = 16
    overhead_ms: float = 2.0
    prefill_us_per_token: float = 200.0
    decode_ms: float = 10.0
    decode_ms_per_seq: float = 0.5

    def flags(self, num_blocks: int) -> list[str]:
        return [
            "--block-size", str(self.block_size), "--num-blocks", str(num_blocks),
            "--max-num-seqs", str(self.max_num_seqs), "--overhead-ms", str(self.overhead_ms),
            "--prefill-us-per-token", str(self.prefill_us_per_token), "--decode-ms", str(self.decode_ms),
            "--decode-ms-per-seq", str(self.decode_ms_per_seq), "--max-model-len", "16384",
        ]  # fmt: skip


def _spawn(args: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """`args` = [python module, its arguments...], or a whole command line when its first word is an absolute path."""
    argv = args if os.path.isabs(args[0]) else [sys.executable, "-m", *args]
    return subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextmanager
def children(
    specs: Sequence[tuple[list[str], list[str]]], cpus: set[int] | None = None, timeout_s: float = 60
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start every (args, ready_urls) child at once (pinned to `cpus` when given), wait until all ready URLs answer
    200, stop them all on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    try:
        for args, _ in specs:
            logs.append(tempfile.TemporaryFile())
            procs.append(_spawn(args, logs[-1]))
            if cpus:
                os.sched_setaffinity(procs[-1].pid, cpus)
        for (args, urls), log in zip(specs, logs, strict=True):
            for url in urls:
                try:
                    wait_http(url, timeout_s=timeout_s)
                except TimeoutError as exc:
                    log.seek(0)
                    tail = log.read()[-2000:].decode(errors="replace")
                    raise TimeoutError(f"{exc}; kvgate {' '.join(args)} said:\n{tail}") from None
        yield procs
    finally:
        _stop(procs)
        for log in logs:
            log.close()


def split_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(gateway CPUs, everything else's CPUs): with `pin` and at least 2 CPUs, the gateway under test gets the last
    CPU to itself, as in a deployment where it does not share cores with engines; then no policy's own CPU cost
    (tokenizing, hashing) slows the simulated engines or the client. None, None: no pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


@contextmanager
def sim_pool(
    n: int,
    costs: SimCosts,
    num_blocks: int,
    model: str = "sim",
    cpus: set[int] | None = None,
    hide_cache_config: bool = False,
) -> Iterator[list[str]]:
    ports = [free_port() for _ in range(n)]
    hide = ["--hide-cache-config"] if hide_cache_config else []
    specs = [
        (
            ["simengine", "--port", str(p), "--model", model, *costs.flags(num_blocks), *hide],
            [f"http://127.0.0.1:{p}/health"],
        )
        for p in ports
    ]
    with children(specs, cpus):
        yield [f"http://127.0.0.1:{p}" for p in ports]


def gateway_yaml(
    engines: Sequence[str], policy: str, params: dict[str, Any], port: int, max_num_seqs: int | None = None
) -> dict[str, Any]:
    engine_extra = {"max_num_seqs": max_num_seqs} if max_num_seqs is not None else {}
    params = dict(params)
    routing = {"policy": policy, **params.pop("routing", {}), "params": params}  # a variant's other routing keys
    return {
        "server": {"port": port, "access_log": "off"},
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "metrics_interval_s": 0.25},
        "routing": routing,
        "cache": {"tokenizers": {"sim": "sim"}},
        "engines": [{"url": u, **engine_extra} for u in engines],
    }


SGLANG = "sglang-router"


@contextmanager
def gateways(
    engines: Sequence[str],
    policies: Sequence[tuple[str, dict[str, Any]]],
    max_num_seqs: int | None = None,
    cpus: set[int] | None = None,
) -> Iterator[list[tuple[str, int]]]:
    """One `kvgate serve` (uvloop) per (policy, params), all in front of the same engines (attached with their batch
    slots when `max_num_seqs` is given, as a user who knows their engines would); yields (base URL, pid) each.
    Policy `sglang-router` is sglang-router's cache_aware policy instead, from the Python `params["python"]`."""
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        specs: list[tuple[list[str], list[str]]] = []
        urls: list[str] = []
        for i, (policy, params) in enumerate(policies):
            port = free_port()
            if policy == SGLANG:
                specs.append((sglang_argv(params["python"], port, engines), [f"http://127.0.0.1:{port}/health"]))
                urls.append(f"http://127.0.0.1:{port}")
                continue
            path = os.path.join(tmp, f"gw{i}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(gateway_yaml(engines, policy, params, port, max_num_seqs), f)
            url = f"http://127.0.0.1:{port}"
            serve = ["kvgate", "serve", "--config", path, "--log-level", "WARNING"]
            specs.append((serve, [f"{url}/health", f"{url}/ready"]))
            urls.append(url)
        with children(specs, cpus) as procs:
            yield [(url, proc.pid) for url, proc in zip(urls, procs, strict=True)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
