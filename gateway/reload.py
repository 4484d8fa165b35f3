"""Reload of the whole configuration without a restart (SIGHUP, or `POST /admin/reload` with an empty body).

The file (and the environment) is read and validated whole first, in a thread; an invalid one changes nothing and
the error says where (path-qualified, as at start-up). A valid one is compared with the running configuration,
section by section, and what can change under traffic is applied:
- `admission`: tenants, keys, limits, queue bounds (`AdmissionController.reload`; in-flight and queued requests
  keep their leases);
- `engines` given by `url`: a new one joins through the health probe; a removed one drains (takes no new request,
  its in-flight ones finish, up to `_DRAIN_S`) and leaves; a changed one is replaced the same way;
- `routing`: the policy and its parameters, `max_candidates` (the next decision uses them); the prefix-cache
  state follows the policy (started on a switch to a policy that uses it, stopped when leaving one: cache_ctx);
- `models`: aliases and fallbacks.
Every other section that differs (server, health, timeouts, retry, cache, fleet, tracing, admin, pool, and
`engines` found by `dns`) is named in the answer and the log as needing a restart, and keeps its running value.
Signals only set an event; one task reloads, so reloads never overlap.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from engine_pool.replica import Replica
from gateway.attached import attached_replica
from gateway.cache_ctx import CACHE_SWITCH
from gateway.config import GatewayConfig
from gateway.engines_config import EngineConfig
from gateway.keys import ADMISSION, COMPLETIONS, CONFIG, CONFIG_SOURCE, REPLICAS, ROUTER
from policies.registry import build_policy

log = logging.getLogger("kvgate.reload")

_DRAIN_S = 60.0  # a removed engine's in-flight requests get this long before it is dropped
_APPLIED = ("admission", "routing", "models")
_RESTART = ("server", "health", "timeouts", "retry", "cache", "fleet", "tracing", "admin", "pool")


@dataclass
class ReloadResult:
    applied: list[str] = field(default_factory=list)  # sections whose new values are in effect
    restart_needed: list[str] = field(default_factory=list)  # sections that differ but keep their running values
    engines_added: list[str] = field(default_factory=list)
    engines_removed: list[str] = field(default_factory=list)


class ConfigReloader:
    """Holds the configuration in effect (`running`) and swaps what can be swapped."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.running: GatewayConfig = app[CONFIG]
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._draining: set[asyncio.Task[None]] = set()

    # --- triggers ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvgate:reload")

    async def close(self) -> None:
        for task in [self._task, *self._draining]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._draining] if t is not None), return_exceptions=True)

    def request_reload(self) -> None:
        """Signal-handler safe: only records the request; the reload task acts on it."""
        self._wanted.set()

    async def _loop(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                await self.reload_file()
            except ValueError as exc:  # logged by reload_file; the running config stays
                log.debug("reload refused: %s", exc)

    async def reload_file(self) -> ReloadResult:
        """Re-read the file the gateway was started with (then the environment and its command line's flags, as at
        start-up); ValueError (with the path-qualified reason) when it cannot be read or is invalid, and then nothing
        changed."""
        source = self.app.get(CONFIG_SOURCE)
        if source is None:
            log.warning("reload refused: the gateway was started without a config file (--config)")
            raise ValueError("the gateway was started without a config file: there is nothing to re-read")
        try:
            new = await asyncio.to_thread(source.load)
        except ValueError as exc:
            log.error("config reload failed, keeping the running config: %s", exc)
            raise
        return await self.apply(new)

    # --- applying ---------------------------------------------------------------------------------------------
    async def apply(self, new: GatewayConfig) -> ReloadResult:
        old, result = self.running, ReloadResult()
        for section in _RESTART:
            if getattr(old, section) != getattr(new, section):
                result.restart_needed.append(section)
        if [e for e in old.engines if e.dns] != [e for e in new.engines if e.dns]:
            result.restart_needed.append("engines (dns)")
        if old.admission.redis != new.admission.redis:  # the quota store is built at start-up
            result.restart_needed.append("admission.redis")
        if new.admission != old.admission:
            self.app[ADMISSION].reload(new.admission)
        if new.routing != old.routing:
            policy = build_policy(new.routing.policy, new.routing.params)  # the cache state follows it
            await self.app[CACHE_SWITCH].route_with(self.app[ROUTER], policy, new.routing.max_candidates)
        if new.models != old.models:
            self.app[COMPLETIONS].set_models(new.models)
        result.applied = [s for s in _APPLIED if getattr(old, s) != getattr(new, s)]
        self._apply_engines(old, new, result)
        if result.engines_added or result.engines_removed:
            result.applied.append("engines")
        # what now runs: the new values of applied sections, the old ones of the rest
        self.running = new.model_copy(
            update={s: getattr(old, s) for s in _RESTART}
            | {"engines": [e for e in new.engines if not e.dns] + [e for e in old.engines if e.dns]}
        )
        log.info(
            "config reloaded: applied %s; engines +%s -%s; needing a restart: %s",
            result.applied or "nothing", result.engines_added, result.engines_removed, result.restart_needed or "none",
        )  # fmt: skip
        return result

    def _apply_engines(self, old: GatewayConfig, new: GatewayConfig, result: ReloadResult) -> None:
        before = {attached_replica(e).id: e for e in old.engines if e.url is not None}
        after = {attached_replica(e).id: e for e in new.engines if e.url is not None}
        replicas = self.app[REPLICAS]
        for rid, engine in before.items():
            if after.get(rid) != engine:
                replica = replicas.get(rid)
                if replica is not None and not replica.managed:
                    result.engines_removed.append(rid)
                    self._drain_then_remove(replica, after.get(rid))
        for rid, engine in after.items():
            if rid not in before:
                replicas.add(attached_replica(engine))
                result.engines_added.append(rid)

    def _drain_then_remove(self, replica: Replica, replacement: EngineConfig | None) -> None:
        replicas = self.app[REPLICAS]
        replicas.set_draining(replica, True)

        async def drain() -> None:
            if not await replica.wait_idle(_DRAIN_S):
                log.warning("engine %s still had requests after %.0f s; removing it", replica.id, _DRAIN_S)
            await replicas.remove(replica.id)
            if replacement is not None:
                replicas.add(attached_replica(replacement))

        task = asyncio.get_running_loop().create_task(drain(), name=f"reload:drain:{replica.id}")
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)


RELOADER = web.AppKey("reloader", ConfigReloader)
