"""Reload of the whole configuration without a restart (SIGHUP, or `POST /admin/reload` with an empty body).

The file (and the environment) is read and validated whole first, in a thread; an invalid one changes nothing and
the error says where (path-qualified, as at start-up). A valid one is compared with the running configuration,
section by section, and what can change under traffic is applied:
- `admission`: tenants, keys, limits, queue bounds (`AdmissionController.reload`; in-flight and queued requests
  keep their leases);
- `engines` given by `url`: a new one joins through the health probe; a removed one drains (takes no new request,
  its in-flight ones finish, up to `_DRAIN_S`) and leaves; one whose gate or batch slots (`max_concurrency`,
  `max_num_seqs`) changed keeps serving with the new values; one with any other change is replaced: it drains, then
  rejoins with its new settings. What a drain does when it ends is decided then, by the configuration running at
  that moment (an engine put back while it drained stays, a second change is the one applied), one drain per engine;
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
    engines_removed: list[str] = field(default_factory=list)  # drained: removed, or replaced with a changed entry
    engines_changed: list[str] = field(default_factory=list)  # a new gate or batch slots, in place


class ConfigReloader:
    """Holds the configuration in effect (`running`) and swaps what can be swapped."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.running: GatewayConfig = app[CONFIG]
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drains: dict[str, tuple[asyncio.Task[None], EngineConfig]] = {}  # by replica id: the task, its entry

    # --- triggers ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvgate:reload")

    async def close(self) -> None:
        tasks = [t for t in [self._task, *(task for task, _ in self._drains.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def draining(self) -> list[str]:
        """The engines a reload removed or replaced whose drain has not ended."""
        return list(self._drains)

    def request_reload(self) -> None:
        """Signal-handler safe: only records the request; the reload task acts on it."""
        self._wanted.set()

    async def _loop(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                await self.reload_file()
            except Exception as exc:  # logged by reload_file; the running config stays
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
        try:
            return await self.apply(new)
        except Exception:
            log.exception("config reload failed while applying it")
            raise

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
            await self.app[CACHE_SWITCH].route_with(self.app[ROUTER], policy, new.routing)
        if new.models != old.models:
            self.app[COMPLETIONS].set_models(new.models)
        result.applied = [s for s in _APPLIED if getattr(old, s) != getattr(new, s)]
        self._apply_engines(old, new, result)
        if result.engines_added or result.engines_removed or result.engines_changed:
            result.applied.append("engines")
        # what now runs: the new values of applied sections, the old ones of the rest
        self.running = new.model_copy(
            update={s: getattr(old, s) for s in _RESTART}
            | {"engines": [e for e in new.engines if not e.dns] + [e for e in old.engines if e.dns]}
        )
        log.info(
            "config reloaded: applied %s; engines +%s -%s ~%s; needing a restart: %s", result.applied or "nothing",
            result.engines_added, result.engines_removed, result.engines_changed, result.restart_needed or "none",
        )  # fmt: skip
        return result

    def _apply_engines(self, old: GatewayConfig, new: GatewayConfig, result: ReloadResult) -> None:
        before, after = _attached(old), _attached(new)
        replicas = self.app[REPLICAS]
        for rid, engine in before.items():
            wanted = after.get(rid)
            replica = replicas.get(rid)
            if wanted == engine or replica is None or replica.managed:
                continue
            if wanted is not None and _gates_only(engine, wanted):
                self._set_gates(replica, wanted)
                result.engines_changed.append(rid)
            else:
                result.engines_removed.append(rid)
                self._drain(replica, engine)
        for rid, engine in after.items():
            if rid in before:
                continue
            result.engines_added.append(rid)
            draining = self._drains.get(rid)
            if draining is None:
                replicas.add(attached_replica(engine))
            elif draining[1] == engine and (replica := replicas.get(rid)) is not None:
                replicas.set_draining(replica, False)  # put back as it was while it drained: it stays
            # else: the drain, when it ends, replaces it with this entry (the running configuration's)

    def _set_gates(self, replica: Replica, engine: EngineConfig) -> None:
        self.app[REPLICAS].set_gates(replica, engine.max_concurrency, engine.max_num_seqs)
        for r in (replica, *replica.ranks):
            self.app[ADMISSION].capacity_gate.reconfigured(r)

    def _drain(self, replica: Replica, engine: EngineConfig) -> None:
        """Drain the replica built from `engine`, then do what the configuration running then asks of its id."""
        replicas = self.app[REPLICAS]
        replicas.set_draining(replica, True)
        if replica.id in self._drains:
            return  # its drain is under way: it decides when it ends

        async def drain() -> None:
            try:
                if not await replica.wait_idle(_DRAIN_S):
                    log.warning("engine %s still had requests after %.0f s; removing it", replica.id, _DRAIN_S)
                wanted = _attached(self.running).get(replica.id)
                if wanted == engine:
                    replicas.set_draining(replica, False)
                    return
                await replicas.remove(replica.id)
                if wanted is not None:
                    replicas.add(attached_replica(wanted))
            finally:
                self._drains.pop(replica.id, None)

        task = asyncio.get_running_loop().create_task(drain(), name=f"reload:drain:{replica.id}")
        self._drains[replica.id] = (task, engine)


def _attached(cfg: GatewayConfig) -> dict[str, EngineConfig]:
    """The engines given by `url`, by replica id."""
    return {attached_replica(e).id: e for e in cfg.engines if e.url is not None}


_GATES = {"max_concurrency", "max_num_seqs"}


def _gates_only(old: EngineConfig, new: EngineConfig) -> bool:
    """The two entries differ only in the settings a running replica takes in place."""
    return old.model_copy(update={k: getattr(new, k) for k in _GATES}) == new


RELOADER = web.AppKey("reloader", ConfigReloader)
