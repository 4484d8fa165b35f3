"""Runs one load setting: a workload under an arrival process, with tenants, session ordering and progress.

Arrival processes:
- closed: at most `concurrency` requests in flight; a free slot takes the next ready request at once.
- poisson: new sessions arrive with gaps of mean 1 / rate (seeded), gamma-distributed with shape `burstiness`
  (scale 1 / (rate * burstiness)): 1 is a Poisson process (exponential gaps), below 1 burstier (more short gaps and
  long lulls, same mean), above 1 more regular; in flight is capped by `max_inflight` (arrivals past the cap wait
  for a slot). The workload's first spec is pulled before the clock
  starts, so a generator that builds its whole workload up front does not turn the first arrivals into a burst.
- trace: new sessions arrive at their spec's `arrival_s` (trace replay), same cap.

Sessions: turn k+1 of a session is ready only `think_s` after turn k's answer arrived; its messages are the
session's history (earlier messages and answers) followed by the new ones. Ready continuation turns go before new
sessions, ordered by session start (a heap keyed (session order, turn)), so a closed loop keeps sessions moving
instead of starting every session first. A failed turn still continues its session, with an empty answer.
A session's tenant (API key) is drawn once, by weight, from a seeded RNG.

Stopping: after `max_requests` sends (default MAX_REQUESTS, which bounds the results kept), at `duration_s`
(no new sends; in-flight requests finish, pending think timers are cancelled), or when the workload is exhausted.
With a duration the workload factory is called again with seed + epoch when it runs out, session ids prefixed
`e<epoch>-`. Memory: one result per request sent, plus the history of the sessions in progress.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TextIO

import aiohttp

from loadgen.client import Message, RequestResult, RequestSpec, Target, send_request

WorkloadFactory = Callable[[int], Iterator[RequestSpec]]
MAX_REQUESTS = 1_000_000  # per setting when no cap is given: bounds the kept results


@dataclass(frozen=True, slots=True)
class Tenant:
    key: str
    weight: float = 1.0

    @property
    def label(self) -> str:
        """Keys are secrets: reports show a shortened form."""
        return self.key if len(self.key) <= 8 else f"{self.key[:4]}...{self.key[-2:]}"


def parse_tenant(text: str) -> Tenant:
    """`KEY:weight` or `KEY` (weight 1)."""
    key, sep, weight = text.rpartition(":")
    if not sep:
        return Tenant(text)
    try:
        w = float(weight)
    except ValueError as exc:
        raise ValueError(f"tenant {text!r}: weight {weight!r} is not a number") from exc
    if not key or w <= 0:
        raise ValueError(f"tenant {text!r}: expected KEY:weight with a positive weight")
    return Tenant(key, w)


@dataclass(frozen=True, slots=True)
class Arrival:
    mode: Literal["closed", "poisson", "trace"] = "closed"
    concurrency: int = 1
    rate: float = 1.0  # requests (new sessions) per second, poisson
    burstiness: float = 1.0  # shape of the gamma-distributed gaps: 1 = Poisson
    max_inflight: int = 1024

    @property
    def cap(self) -> int:
        return self.concurrency if self.mode == "closed" else self.max_inflight

    @property
    def load(self) -> float:
        return float(self.concurrency) if self.mode == "closed" else self.rate


@dataclass(slots=True)
class SettingResult:
    arrival: Arrival
    results: list[RequestResult]
    wall_s: float
    started_at: float  # time.time() of the first send


class Progress:
    """Live progress, refreshed at most every `interval_s`. On a terminal (`bar`): a rich progress bar of requests
    done out of `total` (or of seconds out of `duration_s` for a timed run; a pulse when neither is known) with
    failures, in flight and output tok/s beside it. Otherwise (`--progress` into a log): one status line rewritten
    in place."""

    def __init__(
        self,
        enabled: bool,
        label: str = "",
        stream: TextIO | None = None,
        interval_s: float = 0.2,
        *,
        bar: bool | None = None,
        total: int | None = None,
        duration_s: float | None = None,
    ) -> None:
        self.enabled = enabled
        self.label = label
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.bar = self.stream.isatty() if bar is None else bar
        self.total, self.duration_s = total, duration_s
        self._last = 0.0
        self._shown = False
        self._rich: Any = None
        self._task: Any = None

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        console = Console(file=self.stream, force_terminal=True)
        self._rich = RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console, auto_refresh=False,
        )  # fmt: skip
        total = self.duration_s if self.duration_s is not None else self.total
        self._task = self._rich.add_task(self.label, total=total, status="")
        self._rich.start()

    def update(self, done: int, failed: int, inflight: int, elapsed: float, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        rate = tokens / elapsed if elapsed > 0 else 0.0
        status = f"{done} done, {failed} failed, {inflight} in flight, {rate:8.1f} tok/s"
        self._shown = True
        if not self.bar:
            self.stream.write(f"\r[{self.label}] {status}, {elapsed:6.1f} s")
            self.stream.flush()
            return
        if self._rich is None:
            self._start_bar()
        completed = min(elapsed, self.duration_s) if self.duration_s is not None else done
        self._rich.update(self._task, completed=completed, status=status)
        self._rich.refresh()

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elif self._shown:
            self.stream.write("\n")
            self.stream.flush()
        self._shown = False


@dataclass(slots=True)
class _Session:
    order: int
    tenant: Tenant | None
    history: list[Message] = field(default_factory=list)
    busy: bool = False  # a turn is in flight, thinking or ready
    backlog: deque[RequestSpec] = field(default_factory=deque)


class _Run:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        factory: WorkloadFactory,
        arrival: Arrival,
        *,
        seed: int,
        max_requests: int | None,
        duration_s: float | None,
        tenants: Sequence[Tenant],
        api_key: str | None,
        progress: Progress,
    ) -> None:
        self.http, self.target, self.factory, self.arrival = http, target, factory, arrival
        self.seed, self.max_requests, self.duration_s = seed, max_requests, duration_s
        self.tenants, self.api_key, self.progress = list(tenants), api_key, progress
        self.rng = random.Random(seed ^ 0x5EED)
        self.epoch = 0
        self.it: Iterator[RequestSpec] | None = _primed(factory(seed))  # built before the clock starts
        self.sessions: dict[str, _Session] = {}
        self.ready: list[tuple[int, int, int, RequestSpec]] = []
        self.counter = itertools.count()
        self.session_order = itertools.count()
        self.pending: RequestSpec | None = None
        self.pending_due = 0.0
        self.next_poisson = 0.0
        self.inflight = 0
        self.sent = 0
        self.failed = 0
        self.tokens = 0
        self.results: list[RequestResult] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.timers: set[asyncio.Task[None]] = set()
        self.wake = asyncio.Event()
        self.t0 = 0.0

    # --- workload intake -------------------------------------------------------------------------------------
    def _next_spec(self) -> RequestSpec | None:
        while self.it is not None:
            spec = next(self.it, None)
            if spec is not None:
                if self.epoch:
                    spec = replace(spec, session_id=f"e{self.epoch}-{spec.session_id}")
                return spec
            if self.duration_s is None:
                self.it = None
            else:
                self.epoch += 1
                self.it = _primed(self.factory(self.seed + self.epoch))
        return None

    def _peek_new(self) -> RequestSpec | None:
        """The next spec that starts a session; continuation turns met on the way join their session."""
        while self.pending is None:
            spec = self._next_spec()
            if spec is None:
                return None
            sess = self.sessions.get(spec.session_id)
            if sess is None:
                self.pending = spec
                if self.arrival.mode == "poisson":
                    shape = self.arrival.burstiness
                    self.next_poisson += self.rng.gammavariate(shape, 1.0 / (self.arrival.rate * shape))
                    self.pending_due = self.t0 + self.next_poisson
                elif self.arrival.mode == "trace" and spec.arrival_s is not None:
                    self.pending_due = self.t0 + spec.arrival_s
                else:
                    self.pending_due = self.t0
            elif sess.busy:
                sess.backlog.append(spec)
            else:
                self._schedule(sess, spec)
        return self.pending

    def _schedule(self, sess: _Session, spec: RequestSpec) -> None:
        sess.busy = True
        if spec.think_s > 0:
            task = asyncio.create_task(self._think(sess, spec))
            self.timers.add(task)
            task.add_done_callback(self.timers.discard)
        else:
            heapq.heappush(self.ready, (sess.order, spec.turn, next(self.counter), spec))

    async def _think(self, sess: _Session, spec: RequestSpec) -> None:
        await asyncio.sleep(spec.think_s)
        heapq.heappush(self.ready, (sess.order, spec.turn, next(self.counter), spec))
        self.wake.set()

    # --- sending ---------------------------------------------------------------------------------------------
    def _dispatch(self, spec: RequestSpec) -> None:
        sess = self.sessions.get(spec.session_id)
        if sess is None:
            tenant = None
            if self.tenants:
                tenant = self.rng.choices(self.tenants, weights=[t.weight for t in self.tenants])[0]
            sess = _Session(order=next(self.session_order), tenant=tenant, busy=True)
            self.sessions[spec.session_id] = sess
        self.inflight += 1
        self.sent += 1
        task = asyncio.create_task(self._one(sess, spec))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _one(self, sess: _Session, spec: RequestSpec) -> None:
        key = sess.tenant.key if sess.tenant else self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        start = time.perf_counter() - self.t0
        msgs = (*sess.history, *spec.messages)
        try:
            res = await send_request(
                self.http,
                self.target,
                spec,
                msgs,
                headers=headers,
                tenant=sess.tenant.label if sess.tenant else "",
                start_s=start,
            )
        finally:
            self.inflight -= 1
            self.wake.set()
        self.results.append(res)
        self.failed += not res.ok
        self.tokens += res.completion_tokens if res.ok else 0
        if spec.final:
            self.sessions.pop(spec.session_id, None)
        else:
            sess.history.extend(spec.messages)
            sess.history.append(("assistant", res.text))
            if sess.backlog:
                self._schedule(sess, sess.backlog.popleft())
            else:
                sess.busy = False
        self.progress.update(len(self.results), self.failed, self.inflight, start + res.e2e_s, self.tokens)

    def _stopping(self, now: float) -> bool:
        if self.max_requests is not None and self.sent >= self.max_requests:
            return True
        return self.duration_s is not None and now - self.t0 >= self.duration_s

    async def run(self) -> SettingResult:
        self.t0 = time.perf_counter()
        started_at = time.time()
        cap = self.arrival.cap
        while True:
            now = time.perf_counter()
            timeout: float | None = None
            stopping = self._stopping(now)
            while not stopping and self.ready and self.inflight < cap:
                self._dispatch(heapq.heappop(self.ready)[3])
                stopping = self._stopping(now)
            while not stopping and self.inflight < cap:
                spec = self._peek_new()
                if spec is None:
                    break
                if self.pending_due > now:
                    timeout = self.pending_due - now
                    break
                self.pending = None
                self._dispatch(spec)
                stopping = self._stopping(now)
            if not stopping and self.ready and self.inflight < cap:
                continue  # the scan for new sessions scheduled a session's next turn: send it before waiting
            if self.duration_s is not None and not stopping:
                left = self.t0 + self.duration_s - now
                timeout = left if timeout is None else min(timeout, left)
            idle = not self.ready and not self.timers and self.pending is None and self.it is None
            if self.inflight == 0 and (stopping or idle):
                break
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except TimeoutError:
                pass
        for t in list(self.timers):
            t.cancel()
        await asyncio.gather(*self.timers, return_exceptions=True)
        wall = time.perf_counter() - self.t0
        self.progress.update(len(self.results), self.failed, 0, wall, self.tokens, force=True)
        self.progress.close()
        return SettingResult(self.arrival, self.results, wall, started_at)


def _primed(specs: Iterator[RequestSpec]) -> Iterator[RequestSpec]:
    """Pull the first spec now: generators that build (and shuffle) the whole workload do it on the first `next`,
    which must not happen after the clock started (it would delay the first Poisson arrivals into a burst)."""
    first = next(specs, None)
    return iter(()) if first is None else itertools.chain((first,), specs)


async def run_setting(
    http: aiohttp.ClientSession,
    target: Target,
    factory: WorkloadFactory,
    arrival: Arrival,
    *,
    seed: int = 0,
    max_requests: int | None = None,
    duration_s: float | None = None,
    tenants: Sequence[Tenant] = (),
    api_key: str | None = None,
    progress: Progress | None = None,
) -> SettingResult:
    """Runs the workload under `arrival` until done (module header); returns every request's result."""
    if max_requests is None:
        max_requests = MAX_REQUESTS
    if arrival.mode == "closed" and arrival.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if arrival.mode == "poisson" and (arrival.rate <= 0 or arrival.burstiness <= 0):
        raise ValueError("rate and burstiness must be > 0")
    run = _Run(
        http,
        target,
        factory,
        arrival,
        seed=seed,
        max_requests=max_requests,
        duration_s=duration_s,
        tenants=tenants,
        api_key=api_key,
        progress=progress or Progress(False),
    )
    return await run.run()
