"""Helpers for benchmarks: start kvgate / simulated engines as child processes and read their CPU time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s} s")
        time.sleep(0.1)


@contextmanager
def process(
    argv: list[str], ready_url: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Any server as a child process in its own session: ready when `ready_url` answers 200, stopped with SIGTERM
    (SIGKILL after 10 s)."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    try:
        wait_http(ready_url)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def child(
    args: list[str], ready_url: str, env: dict[str, str] | None = None, source: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvgate <args>` as a child process, from `source` (another checkout, e.g. the previous release) if given."""
    # a checkout from before the `kvgate` package had its command line in gateway.cli
    entry = "gateway.cli" if source is not None and not (source / "kvgate").is_dir() else "kvgate"
    extra_env = {**(env or {}), **({"PYTHONPATH": str(source)} if source else {})}
    with process([sys.executable, "-m", entry, *args], ready_url, extra_env, source) as proc:
        yield proc


@contextmanager
def sim_engine_processes(n: int, *extra: str, model: str = "sim") -> Iterator[list[tuple[str, int]]]:
    """n simulated engines as child processes: [(base URL, pid)]."""
    ports = [free_port() for _ in range(n)]
    specs = [
        (["sim-engine", "--port", str(p), "--model", model, *extra], f"http://127.0.0.1:{p}/health") for p in ports
    ]
    with _stack(specs) as pids:
        yield [(f"http://127.0.0.1:{p}", pid) for p, pid in zip(ports, pids, strict=True)]


@contextmanager
def sim_engines(n: int, *extra: str, model: str = "sim") -> Iterator[list[str]]:
    with sim_engine_processes(n, *extra, model=model) as engines:
        yield [url for url, _ in engines]


@contextmanager
def _stack(specs: list[tuple[list[str], str]]) -> Iterator[list[int]]:
    if not specs:
        yield []
        return
    (args, url), rest = specs[0], specs[1:]
    with child(args, url) as proc, _stack(rest) as pids:
        yield [proc.pid, *pids]


@contextmanager
def kvgate(
    engines: list[str], *extra: str, source: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    port = free_port()
    args = ["serve", "--port", str(port), *[a for e in engines for a in ("--engine", e)], *extra]
    with child(args, f"http://127.0.0.1:{port}/health", env=env, source=source) as proc:
        wait_http(f"http://127.0.0.1:{port}/ready")
        yield f"http://127.0.0.1:{port}", proc.pid


def sglang_argv(python: str, port: int, engines: Sequence[str]) -> list[str]:
    """sglang-router (Rust, `pip install sglang-router`) with its cache_aware policy in front of `engines`."""
    argv = [os.path.abspath(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    return [*argv, "--worker-urls", *engines, "--policy", "cache_aware", "--log-level", "warn"]
