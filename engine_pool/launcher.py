"""Start one engine as a child process in its own process group, capture its output, stop it without orphans.

- The child runs in a new session (`start_new_session=True`), so its process group id is its pid and every process
  it forks (vLLM's EngineCore, tokenizer workers) is in that group; stopping signals the whole group.
- stdout and stderr go through one pipe to an asyncio reader task that writes them to `<log_dir>/<id>.log`, rotated
  by size (`log_max_bytes`, `log_backups` older files `<id>.log.1` ...). File writes and rotation run in a worker
  thread (`asyncio.to_thread`), never on the event loop; reads are at most 64 KiB at a time, so memory is bounded.
- CPU placement: when the launch names CPUs (a CPU replica's `cpu_bind`), the child is pinned to them the moment it
  exists, before it has started a thread, so every process and thread of the engine inherits its own cores. vLLM's
  OpenMP binding (`OMP_PLACES` from `VLLM_CPU_OMP_THREADS_BIND`) is then a no-op instead of a migration off a core
  that another replica keeps busy (the likely reason a restarted replica was seen hanging in the kernel's
  `sched_setaffinity`; see docs/engine-pool.md).
- Progress: `cpu_seconds()` sums user+system time over the live processes of the group (from /proc), and
  `StallWatch` uses it to tell a slow start from a stalled one.
- Stop: SIGTERM to the group, wait `timeout_s`, then SIGKILL to the group. After the main process exits for any
  reason the group is SIGKILLed once more, so a child of a crashed engine cannot outlive it. An engine whose kvgate
  dies without stopping it (SIGKILL, a crash) gets SIGTERM from the kernel (`PR_SET_PDEATHSIG`, Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvgate.pool.launcher")

_READ_CHUNK = 64 * 1024
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_seconds(pgid: int) -> float | None:
    """User + system CPU seconds of the live processes in process group `pgid`; None where /proc is missing."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    total = 0
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        if len(fields) > 12 and int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / _CLOCK_TICKS


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", *, span: int = 1, avoid: Collection[int] = ()) -> int:
    """A port that was free a moment ago (with the `span - 1` above it), below the kernel's ephemeral range when it
    can: an engine binds its ports seconds after they are chosen (its KV-event sockets once the model is loaded),
    and a port of the ephemeral range may meanwhile become the source port of any outgoing connection on the machine
    (a health probe, a ZMQ subscriber's reconnect): the engine then fails with `Address already in use` and every
    restart with it. Never one of `avoid` (ports promised to another socket not bound yet: the gateway's own, whose
    listener binds after its start-up has launched the engines). 64 tries at random below the range, else bind to 0
    (a span of one)."""
    low = _ephemeral_low()
    if low > _LOWEST_PORT + 1000:
        for _ in range(64):
            port = _LOWEST_PORT + secrets.randbelow(low - _LOWEST_PORT - span)
            ports = range(port, port + span)
            if not any(p in avoid for p in ports) and all(port_is_free(host, p) for p in ports):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        chosen: int = s.getsockname()[1]
        return chosen


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class RotatingLog:
    """Size-rotated append-only file. Blocking: call from a worker thread."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("ab")
        self._size = self._fh.tell()

    def write(self, data: bytes) -> None:
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._fh.write(data)
        self._fh.flush()
        self._size += len(data)

    def _rotate(self) -> None:
        self._fh.close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
            self._fh = self.path.open("ab")
        else:
            self._fh = self.path.open("wb")
        self._size = 0

    def close(self) -> None:
        self._fh.close()


_STALL_MIN_CPU_S = 1.0  # a starting engine using less CPU than this over its stall window is stalled


class StallWatch:
    """Start-up progress: a starting engine that used less than `_STALL_MIN_CPU_S` of CPU over `window_s` (summed
    over its process group) is stalled, whatever its deadline says. A healthy start keeps at least one core busy
    (imports, weights, KV allocation, warm-up); a process blocked in the kernel does not."""

    def __init__(self, window_s: float | None, read_cpu: Callable[[], float | None]) -> None:
        self.window_s = window_s
        self.read_cpu = read_cpu
        self._mark_at = time.monotonic()
        self._mark_cpu = read_cpu() if window_s else None

    def stalled(self) -> bool:
        if not self.window_s or self._mark_cpu is None:
            return False
        cpu, now = self.read_cpu(), time.monotonic()
        if cpu is None:
            return False
        if cpu - self._mark_cpu >= _STALL_MIN_CPU_S:
            self._mark_at, self._mark_cpu = now, cpu
            return False
        return now - self._mark_at > self.window_s

    def describe(self) -> str:
        return f"less than {_STALL_MIN_CPU_S:.0f} CPU-second used in {self.window_s:.0f} s"


@dataclass(frozen=True, slots=True)
class LaunchCommand:
    """How to start one engine: argv, environment, and the CPUs to pin it to (None: not pinned)."""

    argv: list[str]
    env: dict[str, str]
    cpus: frozenset[int] | None = None


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


_TAIL_BYTES = 4096  # the end of an engine's output kept in memory for `last_line`
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal the process gets when its parent dies


def _die_with_parent() -> None:
    """In the engine's child, before exec: SIGTERM it when kvgate dies, however it dies (a SIGKILL gives kvgate no
    chance to stop its engines, which would go on holding their ports and devices). Linux only; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class EngineProcess:
    """One launched engine process (and its process group)."""

    def __init__(self, proc: asyncio.subprocess.Process, log_file: RotatingLog, name: str) -> None:
        self._proc = proc
        self._log = log_file
        self.name = name
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session: the child leads its own group
        self._tail = b""  # the end of its output so far (`last_line`)
        self._reader = asyncio.create_task(self._pump(), name=f"log:{name}")
        self._waiter = asyncio.create_task(self._wait(), name=f"wait:{name}")

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        max_bytes: int,
        backups: int,
        name: str,
        cwd: str | None = None,
        cpus: Collection[int] | None = None,
    ) -> EngineProcess:
        log_file = await asyncio.to_thread(RotatingLog, log_path, max_bytes, backups)
        header = f"=== kvgate: starting {name}: {' '.join(argv)}\n".encode()
        await asyncio.to_thread(log_file.write, header)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=dict(env),
                cwd=cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except BaseException:  # OSError, or cancelled while starting: the log must not leak
            log_file.close()
            raise
        if cpus:
            try:  # the child has just exec'd its interpreter: no thread of it exists yet to miss the mask
                os.sched_setaffinity(proc.pid, cpus)
            except OSError as exc:  # a CPU outside this process's cpuset: start unpinned, vLLM binds its threads
                log.warning("could not pin %s to CPUs %s: %s", name, sorted(cpus), exc)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return cls(proc, log_file, name)

    @property
    def last_line(self) -> str:
        """The last line it wrote (an engine that exits says why there: a bad flag, a port in use), at most 200
        characters; "" when it wrote nothing."""
        lines = [ln for ln in self._tail.decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip()[:200] if lines else ""

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def cpu_seconds(self) -> float | None:
        """CPU time used so far by the engine's live processes (None where it cannot be read)."""
        return group_cpu_seconds(self.pgid)

    async def _pump(self) -> None:
        stream = self._proc.stdout
        assert stream is not None
        try:
            while chunk := await stream.read(_READ_CHUNK):
                self._tail = (self._tail + chunk)[-_TAIL_BYTES:]
                await asyncio.to_thread(self._log.write, chunk)
        except OSError as exc:  # disk full etc.: keep draining the pipe so the child never blocks on it
            log.warning("log for %s failed: %s; discarding its output", self.name, exc)
            while await stream.read(_READ_CHUNK):
                pass
        finally:
            await asyncio.to_thread(self._log.close)

    async def _wait(self) -> int:
        rc = await self._proc.wait()
        _signal_group(self.pgid, signal.SIGKILL)  # leftovers of the group die with their leader
        return rc

    async def wait(self) -> int:
        """The exit status (negative: killed by that signal), once the process has exited and its log is flushed."""
        rc = await asyncio.shield(self._waiter)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._reader)
        return rc

    def kill(self) -> None:
        """SIGKILL the whole group now (no grace)."""
        _signal_group(self.pgid, signal.SIGKILL)

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM the group, wait up to timeout_s, then SIGKILL it; returns the exit status."""
        if self.returncode is None:
            _signal_group(self.pgid, signal.SIGTERM)
            try:
                return await asyncio.wait_for(self.wait(), timeout_s)
            except TimeoutError:
                log.warning("%s did not exit %.0f s after SIGTERM; killing its process group", self.name, timeout_s)
        self.kill()
        return await self.wait()
