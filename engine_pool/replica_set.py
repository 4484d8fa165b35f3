"""The set of replicas the gateway routes to, and the probe task it owns for each one.

Each replica gets one asyncio task that alternates a health probe (`GET /health`, every `interval_s`, deadline
`timeout_s`) with a metrics scrape (`GET metrics_url`, every `metrics_interval_s`). A failed probe marks the replica
unhealthy at once (out of routing); a passing one marks it healthy. Listeners hear when a replica comes up (healthy),
again when its KV layout (block size, capacity in blocks) first becomes known or changes, when it goes down, and when
it is removed (a scrape whose cumulative counters went down is an engine restarted between probes: up again, its
cache empty). Attached engines without a configured model name get it from `/v1/models`. `warm_up` is the one real
completion a new engine must answer before it is routed to (launched engines and engines found by DNS pass it).

A data-parallel engine is found by its first scrape (one `engine` label per rank): the replica becomes its first
rank and the set adds one replica per other rank (`Replica.for_rank`), removed, warmed and drained with it. Each
probes and scrapes on its own (the same pages; each reads its rank's series).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Protocol

from engine_pool.engine_metrics import parse_engine_metrics
from engine_pool.http_client import UpstreamClient
from engine_pool.kv_sources import kv_event_source
from engine_pool.replica import EngineMetrics, Replica, rank_headers

log = logging.getLogger("kvgate.replicas")
_JSON = {"Content-Type": "application/json"}
COMPLETIONS = "/v1/completions"  # the warm-up of a generating model
LOOP_DETECTED = 508  # a gateway's answer to a request it sent itself (`http_client.VIA`)


class ReplicaListener(Protocol):
    def replica_up(self, replica: Replica) -> None: ...

    def replica_down(self, replica: Replica) -> None: ...

    def replica_removed(self, replica: Replica) -> None: ...


class ReplicaSet:
    def __init__(
        self,
        client: UpstreamClient,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        metrics_interval_s: float = 1.0,
    ) -> None:
        self._client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.metrics_interval_s = metrics_interval_s
        self._replicas: dict[str, Replica] = {}
        self._warned: dict[str, str] = {}  # the reason a replica's failed probe was logged with (until one passes)
        self._by_model: dict[str, list[Replica]] = {}  # for_model's cache
        self._split: dict[str, bool] = {}  # disaggregated's cache, dropped with for_model's
        self._base: dict[str, str] = {}  # base_model's cache, dropped with for_model's
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[ReplicaListener] = []
        self.changed = asyncio.Event()  # set whenever routability may have changed (for waiters)

    # --- membership ------------------------------------------------------------------------------------------
    def add_listener(self, listener: ReplicaListener) -> None:
        self._listeners.append(listener)

    def add(self, replica: Replica) -> None:
        if replica.id in self._replicas:
            raise ValueError(f"replica {replica.id!r} already exists")
        self._replicas[replica.id] = replica
        self._forget_models()
        self._tasks[replica.id] = asyncio.create_task(self._probe_loop(replica), name=f"probe:{replica.id}")

    async def remove(self, replica_id: str) -> Replica | None:
        replica = self._replicas.pop(replica_id, None)
        self._warned.pop(replica_id, None)
        for rank in replica.ranks if replica is not None else ():
            await self.remove(rank.id)
        self._forget_models()
        task = self._tasks.pop(replica_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if replica is not None:
            if not any((r.host, r.port) == (replica.host, replica.port) for r in self._replicas.values()):
                self._client.drop(replica.host, replica.port)  # its connections go with it
            for listener in self._listeners:
                listener.replica_removed(replica)
            self._notify()
        return replica

    async def close(self) -> None:
        for replica_id in list(self._replicas):
            await self.remove(replica_id)

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def for_model(self, model: str) -> list[Replica]:
        """The replicas that serve `model`: a base model, or a LoRA adapter (only the replicas that have it loaded).
        A shared list (do not modify), cached per name served, several lookups per request; the cache is dropped
        whenever a replica is added or removed or learns its model or adapters. A name no replica serves (a client's
        typo, or megabytes of one) is looked up each time and kept nowhere: it is answered 404."""
        found = self._by_model.get(model)
        if found is None:
            found = [r for r in self._replicas.values() if r.model == model or model in r.adapters]
            if found and len(self._by_model) < 1024:
                self._by_model[model] = found
        return found

    def _forget_models(self) -> None:
        self._by_model.clear()
        self._split.clear()
        self._base.clear()

    def disaggregated(self, model: str) -> bool:
        """Some replica of `model` is a prefill replica (its requests may be split: `gateway.disagg`); cached like
        `for_model` (a replica's role is fixed when it is created), so a request asks it at no cost."""
        found = self._split.get(model)
        if found is None:
            replicas = self.for_model(model)
            found = any(r.role == "prefill" for r in replicas)
            if replicas and len(self._split) < 1024:
                self._split[model] = found
        return found

    def undiscovered(self) -> bool:
        """Some replica's model is not known yet (an attached engine that has not answered /v1/models)."""
        return any(r.model is None for r in self._replicas.values())

    def models(self) -> dict[str, list[Replica]]:
        """Every name served (base models and adapters) -> the replicas serving it."""
        out: dict[str, list[Replica]] = {}
        for r in self._replicas.values():
            if r.model:
                out.setdefault(r.model, []).append(r)
            for adapter in r.adapters:
                out.setdefault(adapter, []).append(r)
        return out

    def base_model(self, name: str) -> str:
        """The base model of a LoRA adapter (whose tokenizer and KV layout it uses); a base model is its own.
        Asked per request: cached like `for_model`, so it costs O(1), not O(pool)."""
        found = self._base.get(name)
        if found is None:
            found = next((r.model for r in self._replicas.values() if name in r.adapters and r.model), name)
            if self.for_model(name) and len(self._base) < 1024:
                self._base[name] = found
        return found

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # --- state changes (from probes, the supervisor, the proxy) -------------------------------------------------
    def set_health(self, replica: Replica, healthy: bool) -> None:
        if healthy == replica.healthy:
            return
        replica.healthy = healthy
        log.info("replica %s is %s", replica.id, "healthy" if healthy else "unhealthy")
        for listener in self._listeners:
            (listener.replica_up if healthy else listener.replica_down)(replica)
        self._notify()

    def set_warm(self, replica: Replica, warm: bool) -> None:
        """Warm (routable once healthy) or not; the engine's other data-parallel ranks with it."""
        if any(warm != r.warm for r in (replica, *replica.ranks)):
            for r in (replica, *replica.ranks):
                r.warm = warm
            self._notify()

    def set_gates(self, replica: Replica, max_concurrency: int | None, max_num_seqs: int | None) -> None:
        """The replica's gateway-side gate and its engine's batch slots, changed in place (a reload); the engine's
        other ranks with it."""
        for r in (replica, *replica.ranks):
            r.max_concurrency, r.max_num_seqs = max_concurrency, max_num_seqs
        self._notify()

    def set_draining(self, replica: Replica, draining: bool) -> None:
        """A draining replica takes no new requests; those in flight finish. The engine's other ranks with it."""
        if any(draining != r.draining for r in (replica, *replica.ranks)):
            for r in (replica, *replica.ranks):
                r.draining = draining
            self._notify()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until routability may have changed, or timeout_s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout_s)

    def breaker_changed(self) -> None:
        self._notify()

    # --- probing ---------------------------------------------------------------------------------------------
    async def warm_up(
        self, replica: Replica, model: str, prompt: str, max_tokens: int, timeout_s: float, *, path: str = COMPLETIONS
    ) -> str | None:
        """One real inference on the replica: a completion, or at `path` the pooling endpoint of a pooling model
        (`/v1/embeddings`, `/classify`, `/pooling`); None on success, else why it failed."""
        body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if path != COMPLETIONS:
            body = {"model": model, "input": [prompt] if path == "/classify" else prompt}
        try:
            status, raw = await self._client.fetch(
                "POST",
                f"{replica.url}{path}",
                json.dumps(body).encode(),
                rank_headers(replica, _JSON),
                timeout_s=timeout_s,
            )
            data = json.loads(raw)
        except (ConnectionError, TimeoutError, ValueError) as exc:
            return f"warm-up failed: {exc!r}"
        if status == 200 and isinstance(data, dict) and (data.get("choices") or data.get("data")):
            return None
        return f"warm-up answered HTTP {status}"

    # --- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, VLLM_ALLOW_RUNTIME_LORA_UPDATING) -----------
    async def load_adapter(self, replica: Replica, name: str, path: str, *, timeout_s: float) -> str | None:
        """Load adapter `name` from `path` on the replica; None when it holds it now (loaded, or already there),
        else the engine's reason. Routable for it at once, before the next probe lists it."""
        body = json.dumps({"lora_name": name, "lora_path": path}).encode()
        status, raw = await self._client.fetch(
            "POST", f"{replica.url}/v1/load_lora_adapter", body, _JSON, timeout_s=timeout_s
        )
        if status != 200 and not (status == 400 and b"already been loaded" in raw):
            return _engine_message(status, raw)
        if replica.adapters.get(name) != path:
            replica.adapters = {**replica.adapters, name: path}
            self._forget_models()
            self._notify()
        return None

    async def unload_adapter(self, replica: Replica, name: str, *, timeout_s: float) -> str | None:
        """Unload adapter `name` from the replica (requests already running with it finish); None on success or
        when it was not loaded, else the engine's reason."""
        body = json.dumps({"lora_name": name}).encode()
        status, raw = await self._client.fetch(
            "POST", f"{replica.url}/v1/unload_lora_adapter", body, _JSON, timeout_s=timeout_s
        )
        if status not in (200, 404):
            return _engine_message(status, raw)
        if name in replica.adapters:
            replica.adapters = {k: v for k, v in replica.adapters.items() if k != name}
            self._forget_models()
            self._notify()
        return None

    async def probe_health(self, replica: Replica) -> bool:
        """Whether the replica answers as the engine it is: its /health, and its /v1/models listing its model (a
        replica whose model is not known yet learns it there). A failed probe is logged with its reason (an
        address with nothing listening, another server, another model), once until the reason changes."""
        reason = await self._probe(replica)
        if reason is None:
            self._warned.pop(replica.id, None)
        elif self._warned.get(replica.id) != reason:  # once per reason, not per probe
            self._warned[replica.id] = reason  # (an engine kvgate launched: its supervisor reports its states)
            log.log(logging.DEBUG if replica.managed else logging.WARNING, "replica %s (%s) is not routed to: %s",
                    replica.id, replica.url, reason)  # fmt: skip
        return reason is None

    async def _probe(self, replica: Replica) -> str | None:
        """None when healthy, else why not."""
        try:
            status, _ = await self._client.fetch("GET", f"{replica.url}/health", timeout_s=self.timeout_s)
        except (ConnectionError, TimeoutError, ValueError) as exc:
            return f"GET /health failed: {str(exc) or type(exc).__name__}"
        if status == LOOP_DETECTED:
            return "its address answers as this gateway (508, loop detected): it leads back here"
        if status != 200:
            return f"GET /health answered {status}"
        try:  # every probe: adapters come and go (vLLM's /v1/load_lora_adapter)
            await self._discover_model(replica)
        except (ConnectionError, TimeoutError) as exc:
            if replica.model is None:  # nothing to route to yet; a model already known stays routable
                return f"GET /v1/models failed: {str(exc) or type(exc).__name__}"
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"GET /v1/models is not an OpenAI model list: {exc}"
        return None if replica.model is not None else "GET /v1/models lists no model"

    async def _discover_model(self, replica: Replica) -> None:
        """The replica's model (learned when not configured) and its adapters, from the engine's list; ValueError
        when the list does not name the replica's model (the address now serves another)."""
        status, raw = await self._client.fetch("GET", f"{replica.url}/v1/models", timeout_s=self.timeout_s)
        if status != 200:
            raise ValueError(f"HTTP {status}")
        entries = [e for e in json.loads(raw)["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]
        bases = [e for e in entries if not e.get("parent")]
        entry = next((e for e in bases if replica.model is None or e["id"] == replica.model), None)
        if entry is None and replica.model is not None:
            raise ValueError(f"it serves {sorted(e['id'] for e in bases)}, not {replica.model!r}")
        if entry is not None:
            if replica.model is None:
                replica.model = entry["id"]
                self._forget_models()
            if isinstance(entry.get("max_model_len"), int):
                replica.max_model_len = entry["max_model_len"]
        adapters = {e["id"]: str(e.get("root") or "") for e in entries if e.get("parent") == replica.model}
        if adapters != replica.adapters:
            replica.adapters = adapters
            self._forget_models()
            self._notify()

    async def discover_kv_events(self, replica: Replica) -> None:
        """The engine's KV-event publisher as it lists it (engine_pool/kv_sources.py), the replica's own rank's on
        a data-parallel engine; none when it lists none or does not answer the route (older vLLM, other engines)."""
        source = None
        try:
            status, raw = await self._client.fetch("GET", f"{replica.url}/kv_event_sources", timeout_s=self.timeout_s)
            if status == 200:
                answer = json.loads(raw)
                source = kv_event_source(answer, replica.host, replica.dp_rank)
                if replica.dp_rank is None and isinstance(answer, dict) and len(answer) > 1:
                    log.warning("replica %s: %d data-parallel ranks publish KV events behind one URL; routed as one "
                                "cache without them", replica.id, len(answer))  # fmt: skip
        except (ConnectionError, TimeoutError, ValueError):
            pass
        replica.kv_events_endpoint = source.endpoint if source else None
        replica.kv_events_replay_endpoint = source.replay_endpoint if source else None
        replica.kv_events_topic = source.topic if source else None

    async def split_ranks(self, replica: Replica) -> None:
        """A data-parallel engine's scrape showed several ranks (an engine core may report its first series after
        the engine answers /health, so any scrape may): this replica becomes the first one (its metrics read again
        for that rank alone, its KV events asked again for that rank, and, already up, told to the listeners again:
        its index starts over as one rank's) and a replica is added for each other rank."""
        first, *others = replica.metrics.ranks
        replica.dp_rank = first
        log.info("replica %s: data-parallel ranks %s behind one URL, one replica each", replica.id, [first, *others])
        await self.scrape_metrics(replica)
        if replica.discovers_kv_events:
            await self.discover_kv_events(replica)
        if replica.healthy:
            for listener in self._listeners:
                listener.replica_up(replica)
        for rank in others:
            replica.ranks.append(replica.for_rank(rank))
            self.add(replica.ranks[-1])

    async def _scrape_and_split(self, replica: Replica) -> None:
        await self.scrape_metrics(replica)
        if replica.dp_rank is None and len(replica.metrics.ranks) > 1:
            await self.split_ranks(replica)

    async def scrape_metrics(self, replica: Replica) -> bool:
        sent = time.monotonic()  # the engine's counts are as of about now
        try:
            status, raw = await self._client.fetch("GET", replica.metrics_url, timeout_s=self.timeout_s)
            if status != 200:
                return False
            text = raw.decode()
        except (ConnectionError, TimeoutError, UnicodeDecodeError):
            return False
        before = replica.metrics
        replica.set_metrics(after := parse_engine_metrics(text, now=sent, rank=replica.dp_rank))
        restarted = _restarted(before, after)
        if restarted:
            log.info("replica %s: its engine's counters went down, a restart between probes", replica.id)
        if replica.healthy and (
            restarted or (after.block_size, after.num_blocks) != (before.block_size, before.num_blocks)
        ):
            for listener in self._listeners:  # a new engine, or its KV layout became known: listeners re-register it
                listener.replica_up(replica)
        return True

    async def _probe_loop(self, replica: Replica) -> None:
        next_health = 0.0
        while True:
            now = time.monotonic()
            if now >= next_health:
                healthy = await self.probe_health(replica)
                if healthy and not replica.healthy:
                    await self._scrape_and_split(replica)  # block size / capacity known before the first request
                    if replica.discovers_kv_events:
                        await self.discover_kv_events(replica)
                self.set_health(replica, healthy)
                next_health = time.monotonic() + self.interval_s
            elif replica.healthy:
                await self._scrape_and_split(replica)
            await asyncio.sleep(min(self.metrics_interval_s, max(0.0, next_health - time.monotonic())))


def _restarted(before: EngineMetrics, after: EngineMetrics) -> bool:
    """Whether an engine restarted between two scrapes: a cumulative counter went down (a restart faster than the
    health probe's interval leaves no failed probe; the new engine's cache is empty)."""
    b, a = before.counters, after.counters
    return after.prefix_queries < before.prefix_queries or a.finished < b.finished or a.itl_count < b.itl_count


def _engine_message(status: int, raw: bytes) -> str:
    """An engine's error answer in a sentence: its OpenAI-shaped message, or the status and the start of the body."""
    try:
        message = json.loads(raw)["error"]["message"]
        if isinstance(message, str):
            return f"HTTP {status}: {message[:500]}"
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {status}: {raw[:200].decode(errors='replace')}"
