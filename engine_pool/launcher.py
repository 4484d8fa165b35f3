"""Start one engine as a child process in its own process group, capture its output, stop it without orphans.

- The child runs in a new session (`start_new_session=True`), so its process group id is its pid and every process
  it forks (vLLM's EngineCore, tokenizer workers) is in that group; stopping signals the whole group.
- stdout and stderr go through one pipe to an asyncio reader task that writes them to `<log_dir>/<id>.log`, rotated
  by size (`log_max_bytes`, `log_backups` older files `<id>.log.1` ...). File writes and rotation run in a worker
  thread (`asyncio.to_thread`), never on the event loop; reads are at most 64 KiB at a time, so memory is bounded.
- Stop: SIGTERM to the group, wait `timeout_s`, then SIGKILL to the group. After the main process exits for any
  reason the group is SIGKILLed once more, so a child of a crashed engine cannot outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger("kvgate.pool.launcher")

_READ_CHUNK = 64 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


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


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class EngineProcess:
    """One launched engine process (and its process group)."""

    def __init__(self, proc: asyncio.subprocess.Process, log_file: RotatingLog, name: str) -> None:
        self._proc = proc
        self._log = log_file
        self.name = name
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session: the child leads its own group
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
            )
        except BaseException:  # OSError, or cancelled while starting: the log must not leak
            log_file.close()
            raise
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return cls(proc, log_file, name)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def _pump(self) -> None:
        stream = self._proc.stdout
        assert stream is not None
        try:
            while chunk := await stream.read(_READ_CHUNK):
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
