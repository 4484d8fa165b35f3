"""`EnginePool`: the engines kvgate launched, and the operations on them (start, stop, drain, restart, scale).

Every operation goes through the `Supervisor`'s command queue and then waits for the state it asked for.
- Rolling restart of a model: one replica at a time (a per-model lock serialises rolling restarts, degradation
  restarts and scaling), and a replica is only taken down once every other replica of the model is ready, so the
  model never has fewer than N-1 ready replicas. Each replica is drained (no new requests; in-flight ones finish,
  up to `drain_grace_s`), stopped, relaunched, and ready again (warm-up done) before the next one.
- Scale to n: new replicas get the next indices (device `devices[i % len]`) and fresh ports; removal takes the
  highest indices and drains them first.
- Stop: every replica gets SIGTERM at once (in-flight requests were drained by the HTTP server before), SIGKILL to
  its process group after `stop_timeout_s`; no child outlives the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from engine_pool.degradation import DegradationWatcher
from engine_pool.http_client import UpstreamClient
from engine_pool.launcher import LaunchCommand, free_port
from engine_pool.replica import Replica, ReplicaSettings, build_replica, tcp_endpoint
from engine_pool.replica_set import ReplicaSet
from engine_pool.slots import PoolError, PoolMetrics, Slot, SlotState, UnknownReplica
from engine_pool.spec import ModelPoolConfig, PoolConfig, parse_cpu_list
from engine_pool.supervisor import Supervisor
from engine_pool.vllm_command import Device, EngineLaunchSpec, detect_device, vllm_argv, vllm_env

log = logging.getLogger("kvgate.pool")

_SETTLED = {SlotState.READY, SlotState.FAILED, SlotState.STOPPED}
# how much a replica serves now, for choosing which a scale-down removes (least first)
_SERVING = {SlotState.STARTING: 1, SlotState.DRAINING: 1, SlotState.READY: 2}


def _tiny_model(out: Path) -> Path:
    """Build (or reuse) the tiny model; blocking, run in a thread. Imported lazily: it needs transformers."""
    from engine_pool.tiny_model import build_tiny_model

    return build_tiny_model(out).resolve()


class EnginePool:
    def __init__(
        self,
        config: PoolConfig,
        replicas: ReplicaSet,
        client: UpstreamClient,
        registry: CollectorRegistry,
        *,
        base_env: Mapping[str, str] | None = None,
        on_replica: Callable[[Replica], None] | None = None,
        reserved_ports: Collection[int] = (),
    ) -> None:
        self.config = config
        self.reserved_ports = frozenset(reserved_ports)  # never given to an engine (the gateway's own port)
        self.replicas = replicas
        self.metrics = PoolMetrics(registry, lambda: self.supervisor.slots.values())
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.supervisor = Supervisor(config, replicas, client, self.metrics, self._command)
        self.watcher = DegradationWatcher(self)
        self.models: dict[str, ModelPoolConfig] = {m.name: m for m in config.models}
        self._model_paths: dict[str, str] = {}
        self._devices: dict[str, Device] = {}
        self._locks: dict[str, asyncio.Lock] = {name: asyncio.Lock() for name in self.models}
        self._next_index: dict[str, int] = dict.fromkeys(self.models, 0)
        self._on_replica = on_replica
        self._started = False

    # --- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve model paths and devices, then launch every replica; returns at once (readiness comes later)."""
        await self._prepare()
        self.supervisor.start()
        self._started = True
        for model in self.models.values():
            for _ in range(model.replicas):
                self.supervisor.launch(self._new_slot(model).id)
        self.watcher.start()

    async def _prepare(self) -> None:
        for m in self.models.values():
            if m.kind == "vllm":
                self._devices[m.name] = (
                    await asyncio.to_thread(detect_device, self.base_env) if m.device == "auto" else m.device
                )
            if m.kind == "vllm" and m.model is None:
                path = await asyncio.to_thread(_tiny_model, Path(self.config.model_dir))
                self._model_paths[m.name] = str(path)
            else:
                self._model_paths[m.name] = m.model or m.name

    def quiesce(self) -> None:
        """The gateway is draining: no engine is launched or relaunched from now on (`Supervisor.quiesce`); the
        running ones serve the drain and are stopped by `stop`."""
        self.supervisor.quiesce()

    async def stop(self) -> None:
        """Stop every replica (SIGTERM, then SIGKILL of the group) and the supervisor; idempotent."""
        if not self._started:
            return
        self._started = False
        await self.watcher.close()
        slots = list(self.supervisor.slots.values())
        for slot in slots:
            self.supervisor.stop(slot.id, drain=False, after="stop", reason="shutdown")
        timeout = max((s.model.stop_timeout_s for s in slots), default=0.0) + 10.0
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self.supervisor.wait_for(s.id, {SlotState.STOPPED, SlotState.FAILED}) for s in slots)),
                timeout,
            )
        except TimeoutError:
            log.error("replicas did not stop in %.0f s; killing them", timeout)
        await self.supervisor.close()  # kills anything still alive

    async def wait_ready(
        self, model: str | None = None, *, count: int | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait until `count` (default: all) replicas of `model` (default: every model) are ready."""

        async def one(name: str) -> None:
            while True:
                changed = self.supervisor.changed
                slots = self.slots(name)
                if sum(s.state is SlotState.READY for s in slots) >= (len(slots) if count is None else count):
                    return
                if all(s.state in (SlotState.READY, SlotState.FAILED) for s in slots):
                    failed = [s.id for s in slots if s.state is SlotState.FAILED]
                    raise PoolError(f"model {name}: replicas failed: {failed}")
                await changed.wait()

        names = [model] if model is not None else list(self.models)
        await asyncio.wait_for(asyncio.gather(*(one(n) for n in names)), timeout_s)

    # --- queries -----------------------------------------------------------------------------------------------
    def slots(self, model: str | None = None) -> list[Slot]:
        out = [s for s in self.supervisor.slots.values() if model is None or s.model.name == model]
        return sorted(out, key=lambda s: (s.model.name, s.index))

    def slot(self, replica_id: str) -> Slot:
        slot = self.supervisor.slots.get(replica_id)
        if slot is None:
            raise UnknownReplica(replica_id)
        return slot

    def describe(self) -> list[dict[str, Any]]:
        return [s.describe() for s in self.slots()]

    def _model(self, name: str) -> ModelPoolConfig:
        model = self.models.get(name)
        if model is None:
            raise PoolError(f"no pool model named {name!r}")
        return model

    # --- operations --------------------------------------------------------------------------------------------
    async def drain(self, replica_id: str) -> SlotState:
        """Stop routing to the replica, let its in-flight requests finish (up to the grace), stop it."""
        slot = self.slot(replica_id)
        self.supervisor.stop(slot.id, drain=True, after="stop", reason="drain")
        return await self.supervisor.wait_for(slot.id, {SlotState.STOPPED, SlotState.FAILED})

    async def restart(self, replica_id: str, *, reason: str = "admin") -> SlotState:
        """Drain, stop and relaunch one replica (also revives a stopped or failed one); waits for ready or failed
        (or stopped, when another command stopped it meanwhile)."""
        slot = self.slot(replica_id)
        gen = slot.gen
        self.supervisor.stop(slot.id, drain=True, after="restart", reason=reason)
        return await self.supervisor.wait_for(slot.id, {SlotState.READY, SlotState.FAILED}, newer_than=gen)

    async def restart_one(self, replica_id: str, *, reason: str, wait_others_s: float | None = None) -> SlotState:
        """Restart one replica without dropping its model below N-1 ready (waits for the others first)."""
        slot = self.slot(replica_id)
        async with self._locks[slot.model.name]:
            if slot.state is SlotState.READY:  # taking down a replica that serves nothing cannot cost readiness
                await self._others_ready(slot, wait_others_s)
            return await self.restart(slot.id, reason=reason)

    async def rolling_restart(self, model: str, *, reason: str = "rolling") -> list[dict[str, Any]]:
        """Replace every replica of `model`, one at a time; returns the replicas' final descriptions."""
        m = self._model(model)
        async with self._locks[m.name]:
            for slot in self.slots(m.name):
                if slot.id not in self.supervisor.slots:
                    continue
                await self._others_ready(slot, None)
                state = await self.restart(slot.id, reason=reason)
                if state is SlotState.FAILED:
                    raise PoolError(f"rolling restart stopped: {slot.id} failed: {slot.last_error}")
                if state is not SlotState.READY and state is not SlotState.REMOVED:
                    raise PoolError(f"rolling restart stopped: {slot.id} was {state.value} by another command")
        return [s.describe() for s in self.slots(m.name)]

    async def _others_ready(self, slot: Slot, timeout_s: float | None) -> None:
        others = [s for s in self.slots(slot.model.name) if s is not slot]
        bad = [s.id for s in others if s.state in (SlotState.FAILED, SlotState.STOPPED)]
        if bad:
            raise PoolError(f"restarting {slot.id} would leave fewer than N-1 ready replicas ({bad} are down)")
        try:
            states = await asyncio.wait_for(
                asyncio.gather(*(self.supervisor.wait_for(s.id, {SlotState.READY}) for s in others)),
                timeout_s if timeout_s is not None else slot.model.startup_deadline_s,
            )
        except TimeoutError:
            raise PoolError(
                f"other replicas of {slot.model.name} did not become ready; not restarting {slot.id}"
            ) from None
        down = [f"{s.id} ({state.value})" for s, state in zip(others, states, strict=True) if state is SlotState.FAILED
                or state is SlotState.STOPPED]  # fmt: skip
        if down:  # one failed or was stopped while it was waited for
            raise PoolError(f"restarting {slot.id} would leave fewer than N-1 ready replicas: {down}")

    async def scale(self, model: str, replicas: int, *, wait: bool = True) -> list[str]:
        """Set the number of replicas of `model`; removal drains first. Returns the replica ids afterwards."""
        m = self._model(model)
        if not 0 <= replicas <= self.config.max_replicas:
            raise PoolError(f"replicas must be in [0, {self.config.max_replicas}]")
        async with self._locks[m.name]:
            current = self.slots(m.name)
            if replicas > len(current):
                new = [self._new_slot(m) for _ in range(replicas - len(current))]
                for slot in new:
                    self.supervisor.launch(slot.id)
                if wait:
                    await asyncio.gather(*(self.supervisor.wait_for(s.id, _SETTLED - {SlotState.STOPPED}) for s in new))
            else:  # the replicas that serve least go first: failed, stopped, backing off, starting, then ready
                gone = sorted(current, key=lambda s: (_SERVING.get(s.state, 0), -s.index))[: len(current) - replicas]
                for slot in gone:
                    self.supervisor.stop(slot.id, drain=True, after="remove", reason="scale-down")
                if wait:
                    await asyncio.gather(*(self.supervisor.wait_for(s.id, set()) for s in gone))
        return [s.id for s in self.slots(m.name)]

    # --- replica construction ----------------------------------------------------------------------------------
    def _new_slot(self, m: ModelPoolConfig) -> Slot:
        index = self._next_index[m.name]
        self._next_index[m.name] = index + 1
        host = self.config.host
        avoid, span = self.reserved_ports, m.data_parallel_size
        port = free_port(host, avoid=avoid)
        # a data-parallel engine's rank r publishes on port + r: the whole span free
        kv_port = free_port(host, span=span, avoid=avoid) if m.kv_events else None
        replay_port = free_port(host, span=span, avoid=avoid) if m.kv_events else None
        slot_id = f"{m.name}-{index}"
        tokenizer = m.tokenizer or ("sim" if m.kind == "sim" else self._model_paths.get(m.name))
        settings = ReplicaSettings(
            m.served, tokenizer, m.max_concurrency, m.max_num_seqs, m.role,
            pooling=m.warmup_path != "/v1/completions", block_size=m.block_size,
        )  # fmt: skip
        replica = build_replica(
            slot_id, f"http://{host}:{port}", settings, managed=True,
            kv_events_endpoint=tcp_endpoint(host, kv_port), kv_events_replay_endpoint=tcp_endpoint(host, replay_port),
        )  # fmt: skip
        slot = Slot(slot_id, m, index, port, kv_port, replay_port, replica)
        self.supervisor.add(slot)
        if self._on_replica is not None:
            self._on_replica(replica)
        return slot

    def _command(self, slot: Slot) -> LaunchCommand:
        m, host = slot.model, self.config.host
        env = {**self.base_env, **m.env}
        assign = m.device_for(slot.index)
        if m.kind == "sim":
            argv = [
                sys.executable,
                "-m",
                "simengine",
                "--host",
                host,
                "--port",
                str(slot.port),
                "--model",
                m.served,
                "--seed",
                str(slot.index),
            ]
            for flag, value in (
                ("--block-size", m.block_size),
                ("--max-model-len", m.max_model_len),
                ("--max-num-seqs", m.max_num_seqs),
                ("--kv-events-port", slot.kv_port),
                ("--kv-events-replay-port", slot.kv_replay_port),
            ):
                if value is not None:
                    argv += [flag, str(value)]
            if m.kv_transfer_config is not None:
                argv += ["--kv-transfer-config", json.dumps(m.kv_transfer_config, separators=(",", ":"))]
            if m.lora_modules:
                argv += ["--lora-modules", *(f"{name}={path}" for name, path in m.lora_modules.items())]
            if m.dynamic_lora:
                argv.append("--runtime-lora")
            return LaunchCommand(argv + list(m.extra_args), env, parse_cpu_list(assign.cpu_bind or ""))
        device = self._devices.get(m.name, "cpu")
        spec = EngineLaunchSpec(
            model=self._model_paths[m.name],
            port=slot.port,
            served_model_name=m.served,
            host=host,
            device=device,
            block_size=m.block_size,
            max_model_len=m.max_model_len,
            max_num_seqs=m.max_num_seqs,
            kv_cache_memory_bytes=m.kv_cache_bytes,
            gpu_memory_utilization=m.gpu_memory_utilization,
            enable_prefix_caching=m.prefix_caching,
            kv_events_port=slot.kv_port,
            kv_events_replay_port=slot.kv_replay_port,
            cpu_threads_bind=assign.cpu_bind if device == "cpu" else None,
            cuda_visible_devices=assign.cuda_visible_devices if device == "gpu" else None,
            tensor_parallel_size=m.tensor_parallel_size,
            data_parallel_size=m.data_parallel_size,
            enforce_eager=m.enforce_eager,
            dtype=m.dtype,
            cache_root=str(Path(self.config.cache_root).resolve()) if self.config.cache_root else None,
            kv_transfer_config=m.kv_transfer_config,
            otlp_traces_endpoint=m.otlp_traces_endpoint,
            lora_modules={name: str(Path(path).resolve()) for name, path in m.lora_modules.items()},
            dynamic_lora=m.dynamic_lora,
            runner=m.runner,
            convert=m.convert,
            max_loras=m.max_loras,
            max_lora_rank=m.max_lora_rank,
            extra_args=tuple(m.extra_args),
            extra_env=dict(m.env),
        )
        cpus = parse_cpu_list(assign.cpu_bind or "") if device == "cpu" else None
        env = vllm_env(spec, self.base_env)
        if (m.kv_transfer_config or {}).get(
            "kv_connector"
        ) == "NixlConnector" and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in m.env:
            # one per engine: several share the host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(host, avoid=self.reserved_ports))
        return LaunchCommand(vllm_argv(spec), env, cpus)
