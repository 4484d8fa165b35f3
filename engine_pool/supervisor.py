"""The supervising loop: one task owns every managed replica's state and acts on one queue of commands.

Signals, admin calls, probe results and process exits only enqueue a command; `Supervisor._run` applies them one at
a time, so no two actors ever race on a replica. Anything that waits (readiness, liveness, drain, stop, backoff) runs
in a per-replica helper task that enqueues its outcome, tagged with the launch generation so stale outcomes of an
earlier process are ignored.

Replica lifecycle (`SlotState`):
    stopped/backoff --launch--> starting --/health 200 + warm-up completion--> ready
    starting --deadline passed / exited--> (failure)          ready --exited / `failures` failed probes--> (failure)
    (failure): kill the process group, then `failed` if `crash_loop_limit` failures fell inside
               `crash_loop_window_s`, else `backoff` for min(base * 2**(k-1), max) seconds, k = failures since the
               last time the replica was ready; then launch again.
    ready/starting --stop(drain)--> draining (out of routing; wait for in-flight up to the grace) --> stopping -->
               stopped | relaunched (restart) | removed (scale down)
A failed liveness probe takes the replica out of routing at once; readiness (`warm`) is only set after a real
completion succeeded, so nothing is routed to an engine that has not served one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine_pool.http_client import UpstreamClient
from engine_pool.launcher import EngineProcess, LaunchCommand, StallWatch
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from engine_pool.slots import After, PoolError, PoolMetrics, Slot, SlotState
from engine_pool.spec import PoolConfig
from kvcommon.backoff import backoff_delay

log = logging.getLogger("kvgate.pool")
# which of two intents for a stopping replica wins: a removal over a stop over a restart over a crash's back-off
_STRENGTH = {"backoff": 0, "restart": 1, "stop": 2, "remove": 3}

CommandFn = Callable[["Slot"], LaunchCommand]
ReplicaFactory = Callable[["Slot"], Replica]


# --- commands ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Cmd:
    slot_id: str


@dataclass(slots=True)
class _Launch(_Cmd):
    gen: int | None = None  # None: an explicit (admin/start) launch; else a backoff timer of that generation


@dataclass(slots=True)
class _Stop(_Cmd):
    drain: bool = True
    after: After = "stop"
    reason: str = "admin"


@dataclass(slots=True)
class _Outcome(_Cmd):
    gen: int
    kind: Literal["ready", "start_failed", "hung", "drained", "exited"]
    detail: str = ""


class Supervisor:
    def __init__(
        self,
        config: PoolConfig,
        replicas: ReplicaSet,
        client: UpstreamClient,
        metrics: PoolMetrics,
        command_for: CommandFn,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.client = client
        self.metrics = metrics
        self.command_for = command_for
        self.slots: dict[str, Slot] = {}
        self._queue: asyncio.Queue[_Cmd] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()  # replaced after being set on every state change (for waiters)
        self.quiet = False  # the gateway is shutting down: nothing is launched any more (`quiesce`)

    # --- public: everything only enqueues -------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pool-supervisor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for slot in self.slots.values():
            for task in list(slot.tasks):
                task.cancel()
            if slot.process is not None:
                slot.process.kill()
                await slot.process.wait()

    def add(self, slot: Slot) -> None:
        """Register a new (stopped) replica; it joins the routing set, not yet warm. Launch it with `launch`."""
        if slot.id in self.slots:
            raise PoolError(f"replica {slot.id!r} already exists")
        self.slots[slot.id] = slot
        self.replicas.add(slot.replica)

    def launch(self, slot_id: str) -> None:
        self._queue.put_nowait(_Launch(slot_id))

    def quiesce(self) -> None:
        """Launch nothing from now on (the gateway is draining before it stops the pool): a replica that fails or
        hangs is stopped, not relaunched, and neither a restart nor a scale-up starts an engine."""
        self.quiet = True

    def stop(self, slot_id: str, *, drain: bool, after: After = "stop", reason: str = "admin") -> None:
        self._queue.put_nowait(_Stop(slot_id, drain, after, reason))

    async def wait_for(
        self,
        slot_id: str,
        states: set[SlotState],
        *,
        newer_than: int = -1,
        timeout_s: float | None = None,
    ) -> SlotState:
        """Wait until the replica is in one of `states` with a launch generation above `newer_than` (REMOVED always
        ends the wait); raises TimeoutError after timeout_s."""
        slot = self.slots.get(slot_id)
        if slot is None:
            return SlotState.REMOVED
        if slot.state in states and slot.gen > newer_than:
            return slot.state
        fut: asyncio.Future[SlotState] = asyncio.get_running_loop().create_future()
        slot.waiters.append((frozenset(states | {SlotState.REMOVED}), newer_than, fut))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            slot.waiters = [w for w in slot.waiters if w[2] is not fut]

    # --- the loop ----------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            cmd = await self._queue.get()
            try:
                await self._apply(cmd)
            except Exception:
                log.exception("supervisor failed to apply %r", cmd)

    async def _apply(self, cmd: _Cmd) -> None:
        slot = self.slots.get(cmd.slot_id)
        if slot is None:
            return
        if isinstance(cmd, _Launch):
            await self._on_launch(slot, cmd)
        elif isinstance(cmd, _Stop):
            self._on_stop(slot, cmd)
        elif isinstance(cmd, _Outcome) and cmd.gen == slot.gen:
            await self._on_outcome(slot, cmd)

    def _set_state(self, slot: Slot, state: SlotState, note: str = "", *, settled: bool = False) -> None:
        """`settled`: a stop nothing follows (FAILED always is one): it ends every wait on the replica, whatever
        state the wait was for, so no operation waits on a replica another command stopped."""
        slot.state = state
        slot.events.append((time.time(), f"{state.value}{': ' + note if note else ''}"))
        self.changed.set()
        self.changed = asyncio.Event()
        settled = settled or state is SlotState.FAILED
        for states, newer_than, fut in slot.waiters:
            wanted = state in states and (slot.gen > newer_than or state is SlotState.REMOVED)
            if (wanted or settled) and not fut.done():
                fut.set_result(state)

    def _spawn(self, slot: Slot, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"{name}:{slot.id}")
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)

    def _cancel_tasks(self, slot: Slot) -> None:
        for task in list(slot.tasks):
            if task is not asyncio.current_task():
                task.cancel()

    def _out_of_routing(self, slot: Slot) -> None:
        self.replicas.set_warm(slot.replica, False)
        self.replicas.set_health(slot.replica, False)

    # --- handlers ----------------------------------------------------------------------------------------------
    async def _on_launch(self, slot: Slot, cmd: _Launch) -> None:
        if cmd.gen is not None and (cmd.gen != slot.gen or slot.state is not SlotState.BACKOFF):
            return  # a stale backoff timer
        if slot.state not in (SlotState.STOPPED, SlotState.BACKOFF, SlotState.FAILED):
            return  # already running or on its way
        if self.quiet:
            self._set_state(slot, SlotState.STOPPED, "not launched: the gateway is shutting down", settled=True)
            return
        if cmd.gen is None:
            slot.failures.clear()
            slot.attempts = 0
        slot.gen += 1
        self.replicas.set_draining(slot.replica, False)
        command = self.command_for(slot)
        log_path = Path(self.config.log_dir) / f"{slot.id}.log"
        slot.started_at = time.monotonic()
        try:
            slot.process = await EngineProcess.start(
                command.argv,
                command.env,
                log_path,
                max_bytes=self.config.log_max_bytes,
                backups=self.config.log_backups,
                name=slot.id,
                cpus=command.cpus,
            )
        except OSError as exc:
            slot.process = None
            self._failure(slot, "launch", f"cannot start: {exc}")
            self._after_exit(slot)
            return
        self._set_state(slot, SlotState.STARTING, f"pid {slot.process.pid}")
        gen, proc = slot.gen, slot.process
        self._spawn(slot, self._watch_exit(slot, gen, proc), "exit")
        self._spawn(slot, self._readiness(slot, gen, proc), "ready")

    def _on_stop(self, slot: Slot, cmd: _Stop) -> None:
        if slot.state in (SlotState.STOPPED, SlotState.FAILED, SlotState.BACKOFF):
            self._cancel_tasks(slot)
            if cmd.after == "restart":  # a stopped or failed replica revived: a restart too
                slot.restarts += 1
                self.metrics.restarts.labels(slot.id, slot.model.name, cmd.reason).inc()
                slot.state = SlotState.STOPPED
                self.launch(slot.id)
            elif cmd.after == "remove":
                self._remove(slot)
            else:
                self._set_state(slot, SlotState.STOPPED, cmd.reason, settled=True)
            return
        if slot.state in (SlotState.DRAINING, SlotState.STOPPING):
            if _STRENGTH[cmd.after] > _STRENGTH.get(slot.after, 0):
                slot.after = cmd.after  # the stronger intent wins: remove over stop over restart
            if not cmd.drain and slot.state is SlotState.DRAINING:
                self._begin_stopping(slot)
            return
        slot.after, slot.drain = cmd.after, cmd.drain
        if cmd.after == "restart":
            slot.restarts += 1
            self.metrics.restarts.labels(slot.id, slot.model.name, cmd.reason).inc()
        self.replicas.set_draining(slot.replica, True)  # wakes waiters: routability changed
        self._set_state(slot, SlotState.DRAINING, cmd.reason)
        self._spawn(slot, self._drain(slot, slot.gen, cmd.drain), "drain")

    async def _on_outcome(self, slot: Slot, cmd: _Outcome) -> None:
        if cmd.kind == "ready" and slot.state is SlotState.STARTING:
            slot.attempts, slot.last_error, slot.ready_at = 0, None, time.monotonic()
            self.metrics.startup.labels(slot.model.name).observe(slot.ready_at - slot.started_at)
            self.replicas.set_health(slot.replica, True)
            self.replicas.set_warm(slot.replica, True)
            self._set_state(slot, SlotState.READY, cmd.detail)
            self._spawn(slot, self._liveness(slot, slot.gen), "live")
        elif cmd.kind in ("start_failed", "hung") and slot.state in (SlotState.STARTING, SlotState.READY):
            self._failure(slot, "startup" if cmd.kind == "start_failed" else "hung", cmd.detail)
            self._begin_stopping(slot, kill=True)
        elif cmd.kind == "drained" and slot.state is SlotState.DRAINING:
            self._begin_stopping(slot)
        elif cmd.kind == "exited":
            if slot.state in (SlotState.STARTING, SlotState.READY):  # an exit before ready: it could not start
                self._failure(slot, "crash" if slot.state is SlotState.READY else "startup", cmd.detail)
            self._cancel_tasks(slot)
            self._out_of_routing(slot)
            slot.process = None
            self._after_exit(slot)

    def _failure(self, slot: Slot, reason: str, detail: str) -> None:
        """Record an unplanned failure; the caller stops the process, `_after_exit` decides backoff or failed."""
        now = time.monotonic()
        self._out_of_routing(slot)
        slot.last_error = f"{reason}: {detail}"
        slot.after = "backoff"
        slot.attempts += 1
        slot.failures.append(now)
        window = slot.model.restart.crash_loop_window_s
        while slot.failures and now - slot.failures[0] > window:
            slot.failures.popleft()
        slot.failure_reason = reason  # counted as a restart's reason when `_after_exit` restarts it
        log.warning("replica %s failed (%s): %s", slot.id, reason, detail)

    def _begin_stopping(self, slot: Slot, *, kill: bool = False) -> None:
        self._out_of_routing(slot)
        self._set_state(slot, SlotState.STOPPING)
        proc = slot.process
        if proc is None:
            self._after_exit(slot)
        elif kill:
            proc.kill()
        else:
            self._spawn(slot, self._stop_process(proc, slot.model.stop_timeout_s), "stop")

    def _after_exit(self, slot: Slot) -> None:
        self.replicas.set_draining(slot.replica, False)
        if self.quiet and slot.after in ("backoff", "restart"):
            self._set_state(slot, SlotState.STOPPED, "not relaunched: the gateway is shutting down", settled=True)
        elif slot.after == "backoff":
            limit = slot.model.restart.crash_loop_limit
            if len(slot.failures) >= limit:
                self.metrics.crash_loops.labels(slot.id, slot.model.name).inc()
                log.error(
                    "replica %s is crash-looping (%d failures in %.0f s); not restarting it: %s",
                    slot.id,
                    len(slot.failures),
                    slot.model.restart.crash_loop_window_s,
                    slot.last_error,
                )
                self._set_state(slot, SlotState.FAILED, f"crash loop: {slot.last_error}")
                return
            r = slot.model.restart
            delay = backoff_delay(slot.attempts, r.backoff_base_s, r.backoff_max_s)
            self._set_state(slot, SlotState.BACKOFF, f"restart in {delay:.1f} s after {slot.last_error}")
            slot.restarts += 1
            self.metrics.restarts.labels(slot.id, slot.model.name, slot.failure_reason).inc()
            self._spawn(slot, self._timer(slot, slot.gen, delay), "backoff")
        elif slot.after == "restart":
            self._set_state(slot, SlotState.STOPPED, "restarting")
            self.launch(slot.id)
        elif slot.after == "remove":
            self._remove(slot)
        else:
            self._set_state(slot, SlotState.STOPPED, settled=True)

    def _remove(self, slot: Slot) -> None:
        self._cancel_tasks(slot)
        self.slots.pop(slot.id, None)
        self._set_state(slot, SlotState.REMOVED)
        for series in (self.metrics.restarts, self.metrics.crash_loops):  # its series go with it (ids are not reused)
            series.forget("replica", slot.id)
        task = asyncio.create_task(self.replicas.remove(slot.id), name=f"remove:{slot.id}")
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    # --- helper tasks (they only wait, then enqueue) ------------------------------------------------------------
    def _post(
        self,
        slot: Slot,
        gen: int,
        kind: Literal["ready", "start_failed", "hung", "drained", "exited"],
        detail: str = "",
    ) -> None:
        self._queue.put_nowait(_Outcome(slot.id, gen, kind, detail))

    async def _watch_exit(self, slot: Slot, gen: int, proc: EngineProcess) -> None:
        rc = await proc.wait()
        said = proc.last_line
        self._post(slot, gen, "exited", f"exit status {rc}" + (f": {said}" if said else ""))

    async def _timer(self, slot: Slot, gen: int, delay: float) -> None:
        await asyncio.sleep(delay)
        self._queue.put_nowait(_Launch(slot.id, gen))

    async def _stop_process(self, proc: EngineProcess, timeout_s: float) -> None:
        await proc.stop(timeout_s)  # the exit watcher reports the exit

    async def _drain(self, slot: Slot, gen: int, drain: bool) -> None:
        if drain:
            await slot.replica.wait_idle(slot.model.drain_grace_s)
        self._post(slot, gen, "drained")

    async def _get_ok(self, url: str, timeout_s: float) -> bool:
        try:
            status, _ = await self.client.fetch("GET", url, timeout_s=timeout_s)
        except (ConnectionError, TimeoutError):
            return False
        return status == 200

    async def _warm_up(self, slot: Slot, timeout_s: float) -> str | None:
        """One real inference (a completion, or the pooling model's own request); None on success, else why not."""
        m = slot.model
        return await self.replicas.warm_up(
            slot.replica, m.served, m.warmup_prompt, m.warmup_max_tokens, timeout_s, path=m.warmup_path
        )

    async def _readiness(self, slot: Slot, gen: int, proc: EngineProcess) -> None:
        deadline = slot.started_at + slot.model.startup_deadline_s
        probe_timeout = slot.model.liveness.timeout_s
        why = "no /health answer"
        stall = StallWatch(slot.model.startup_stall_s, proc.cpu_seconds)
        while (left := deadline - time.monotonic()) > 0:
            if stall.stalled():
                self._post(slot, gen, "start_failed", f"start-up stalled: {stall.describe()}")
                return
            if await self._get_ok(f"{slot.replica.url}/health", min(probe_timeout, left)):
                left = deadline - time.monotonic()
                error = await self._warm_up(slot, max(0.1, left))
                if error is None:
                    self._post(slot, gen, "ready", f"{time.monotonic() - slot.started_at:.1f} s after launch")
                    return
                why = error
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        self._post(slot, gen, "start_failed", f"not ready within {slot.model.startup_deadline_s:.0f} s ({why})")

    async def _liveness(self, slot: Slot, gen: int) -> None:
        cfg = slot.model.liveness
        failed = 0
        while True:
            await asyncio.sleep(cfg.interval_s)
            if await self._get_ok(f"{slot.replica.url}/health", cfg.timeout_s):
                failed = 0
                continue
            failed += 1
            self.replicas.set_health(slot.replica, False)  # out of routing at once
            if failed >= cfg.failures:
                self._post(slot, gen, "hung", f"{failed} liveness probes failed")
                return
