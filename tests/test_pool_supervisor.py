"""Supervisor and pool against real simulated-engine child processes: readiness after warm-up, crash restart with
backoff, crash loop, hung replica, start-up deadline, stop without orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from engine_pool.http_client import UpstreamClient
from engine_pool.launcher import free_port, port_is_free
from engine_pool.pool import EnginePool
from engine_pool.replica_set import ReplicaSet
from engine_pool.slots import PoolError, SlotState
from engine_pool.spec import PoolConfig
from tests.conftest import wait_for


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@asynccontextmanager
async def sim_pool(tmp_path: Path, registry: CollectorRegistry, **model: Any) -> AsyncIterator[EnginePool]:
    spec = {
        "name": "m",
        "kind": "sim",
        "replicas": 1,
        "restart": {"backoff_base_s": 0.05, "backoff_max_s": 0.2},
        "liveness": {"interval_s": 0.1, "timeout_s": 2.0, "failures": 2},
        "startup_deadline_s": 60,
        **model,
    }
    cfg = PoolConfig.model_validate({"log_dir": str(tmp_path / "logs"), "models": [spec]})
    with closing(UpstreamClient()) as client:
        replicas = ReplicaSet(client, interval_s=0.1)
        pool = EnginePool(cfg, replicas, client, registry)
        try:
            await pool.start()
            yield pool
        finally:
            await pool.stop()
            await replicas.close()


async def test_ready_only_after_warm_up_and_stop_leaves_no_process(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with sim_pool(tmp_path, registry, replicas=2) as pool:
        slots = pool.slots("m")
        assert [s.id for s in slots] == ["m-0", "m-1"]
        for s in slots:  # nothing is routable before its warm-up succeeded
            assert not s.replica.warm
        await pool.wait_ready(timeout_s=60)
        pgids = []
        async with aiohttp.ClientSession() as client:
            for s in slots:
                assert s.state is SlotState.READY and s.replica.warm and s.replica.managed
                assert s.process is not None
                pgids.append(s.process.pgid)
                async with client.get(f"{s.replica.url}/sim/stats") as resp:
                    stats = await resp.json()
                assert stats["completed"] >= 1  # the warm-up was a real completion
        log_text = (tmp_path / "logs" / "m-0.log").read_text()
        assert "kvgate: starting m-0" in log_text
        assert (
            registry.get_sample_value("kvgate_pool_replica_state", {"replica": "m-0", "model": "m", "state": "ready"})
            == 1
        )
    assert all(not group_alive(p) for p in pgids)
    assert all(s.state is SlotState.STOPPED for s in slots)


async def test_crash_is_restarted_with_backoff(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with sim_pool(tmp_path, registry) as pool:
        await pool.wait_ready(timeout_s=60)
        slot = pool.slot("m-0")
        assert slot.process is not None
        old_pid, gen = slot.process.pid, slot.gen
        os.kill(old_pid, signal.SIGKILL)
        state = await pool.supervisor.wait_for("m-0", {SlotState.READY}, newer_than=gen, timeout_s=60)
        assert state is SlotState.READY
        assert slot.process is not None and slot.process.pid != old_pid
        assert slot.replica.warm and slot.replica.healthy
        events = [e.split(" ", 1)[1] for e in slot.describe()["events"]]
        assert any(e.startswith("backoff: restart in") for e in events)
        assert (
            registry.get_sample_value("kvgate_pool_restarts_total", {"replica": "m-0", "model": "m", "reason": "crash"})
            == 1
        )


async def test_crash_loop_is_reported_not_spinning(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    # --crash-after 0: the engine exits on its first request, i.e. on every warm-up
    async with sim_pool(
        tmp_path,
        registry,
        extra_args=["--crash-after", "0"],
        restart={"backoff_base_s": 0.05, "crash_loop_limit": 3, "crash_loop_window_s": 600},
    ) as pool:
        state = await pool.supervisor.wait_for("m-0", {SlotState.FAILED}, timeout_s=90)
        slot = pool.slot("m-0")
        assert state is SlotState.FAILED
        assert slot.gen == 3  # exactly crash_loop_limit launches, then it stays failed
        assert slot.process is None
        assert slot.last_error is not None and slot.last_error.startswith("startup: exit status")
        assert registry.get_sample_value("kvgate_pool_crash_loops_total", {"replica": "m-0", "model": "m"}) == 1
        assert not slot.replica.warm
        with pytest.raises(Exception, match="replicas failed"):
            await pool.wait_ready(timeout_s=5)


async def test_hung_replica_is_taken_out_and_restarted(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with sim_pool(tmp_path, registry) as pool:
        await pool.wait_ready(timeout_s=60)
        slot = pool.slot("m-0")
        gen = slot.gen
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{slot.replica.url}/sim/faults", json={"fail_health": True}) as resp:
                assert resp.status == 200
        # out of routing as soon as the supervisor sees it, then killed and relaunched (fresh faults)
        await pool.supervisor.wait_for("m-0", {SlotState.STOPPING, SlotState.BACKOFF}, timeout_s=30)
        assert not slot.replica.routable(0.0)
        assert await pool.supervisor.wait_for("m-0", {SlotState.READY}, newer_than=gen, timeout_s=60) is SlotState.READY
        assert (
            registry.get_sample_value("kvgate_pool_restarts_total", {"replica": "m-0", "model": "m", "reason": "hung"})
            == 1
        )


async def test_a_replica_that_hangs_while_the_gateway_drains_is_stopped_not_relaunched(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with sim_pool(tmp_path, registry) as pool:
        await pool.wait_ready(timeout_s=60)
        slot = pool.slot("m-0")
        pool.quiesce()  # the gateway's drain began
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{slot.replica.url}/sim/faults", json={"fail_health": True}) as resp:
                assert resp.status == 200
        assert await pool.supervisor.wait_for("m-0", {SlotState.STOPPED}, timeout_s=30) is SlotState.STOPPED
        assert slot.process is None and not slot.replica.routable(0.0)
        assert slot.events[-1][1] == "stopped: not relaunched: the gateway is shutting down"


async def test_start_up_deadline(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with sim_pool(
        tmp_path,
        registry,
        extra_args=["--fail-health"],
        startup_deadline_s=1.0,
        restart={"backoff_base_s": 0.05, "crash_loop_limit": 2},
    ) as pool:
        assert await pool.supervisor.wait_for("m-0", {SlotState.FAILED}, timeout_s=60) is SlotState.FAILED
        slot = pool.slot("m-0")
        assert slot.last_error is not None and "not ready within 1 s" in slot.last_error
        labels = {"replica": "m-0", "model": "m", "reason": "startup"}
        assert registry.get_sample_value("kvgate_pool_restarts_total", labels) == slot.restarts == 1
        assert slot.process is None
        # an admin restart revives a failed replica (it fails again here: the flag is part of its command line)
        gen = slot.gen
        assert await pool.restart("m-0") is SlotState.FAILED
        assert slot.gen == gen + 2


async def test_replica_is_pinned_to_its_cpus_from_launch(tmp_path: Path) -> None:
    """A CPU replica's processes start on the cores of its `cpu_bind` (a restart too), not wherever the gateway
    runs: nothing has to migrate them later."""
    cpu = max(os.sched_getaffinity(0))
    registry = CollectorRegistry()
    async with sim_pool(tmp_path, registry, devices=[{"cpu_bind": str(cpu)}]) as pool:
        await pool.wait_ready(timeout_s=60)
        slot = pool.slot("m-0")
        assert slot.process is not None
        assert os.sched_getaffinity(slot.process.pid) == {cpu}
        gen = slot.gen
        os.kill(slot.process.pid, signal.SIGKILL)
        assert await pool.supervisor.wait_for("m-0", {SlotState.READY}, newer_than=gen, timeout_s=60) is SlotState.READY
        assert slot.process is not None and os.sched_getaffinity(slot.process.pid) == {cpu}


async def test_start_up_that_stops_progressing_is_restarted_before_its_deadline(tmp_path: Path) -> None:
    """A starting engine that uses no CPU (blocked) is declared stalled after `startup_stall_s`, long before the
    deadline, and relaunched with backoff."""
    registry = CollectorRegistry()
    async with sim_pool(
        tmp_path,
        registry,
        extra_args=["--fail-health"],  # starts, then idles forever without answering /health
        startup_deadline_s=600,
        startup_stall_s=3,
        restart={"backoff_base_s": 0.05, "crash_loop_limit": 2},
    ) as pool:
        assert await pool.supervisor.wait_for("m-0", {SlotState.FAILED}, timeout_s=90) is SlotState.FAILED
        slot = pool.slot("m-0")
        assert slot.last_error is not None and "start-up stalled" in slot.last_error, slot.last_error
        # two failures, one restart between them: the second ended in `failed`, not relaunched (counting it as a
        # restart put the metric one ahead of `kvgate admin status`)
        labels = {"replica": "m-0", "model": "m", "reason": "startup"}
        assert registry.get_sample_value("kvgate_pool_restarts_total", labels) == slot.restarts == 1


def test_cpu_bind_is_checked_at_load() -> None:
    with pytest.raises(ValueError, match=r"not a CPU list"):
        PoolConfig.model_validate({"models": [{"name": "m", "devices": [{"cpu_bind": "zero"}]}]})
    with pytest.raises(ValueError, match=r"runs backwards"):
        PoolConfig.model_validate({"models": [{"name": "m", "devices": [{"cpu_bind": "3-1"}]}]})
    devices = [{"cpu_bind": "0-1,3"}, {"cpu_bind": "nobind"}]
    ok = PoolConfig.model_validate({"models": [{"name": "m", "devices": devices}]})
    assert ok.models[0].devices[0].cpu_bind == "0-1,3"


def test_engine_ports_are_chosen_below_the_ephemeral_range() -> None:
    """An outgoing connection takes its source port from the kernel's ephemeral range; an engine port chosen there
    could be taken before the engine binds it (seen: vLLM's KV-event socket, `Address already in use`, every
    restart)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(p < low for p in ports) and all(port_is_free("127.0.0.1", p) for p in ports)


ROOT = str(Path(__file__).resolve().parent.parent)


async def test_an_engine_dies_with_a_kvgate_that_is_killed(tmp_path: Path) -> None:
    """kvgate killed with SIGKILL cannot stop its engines: the kernel signals them (no process left holding its
    port or its GPU)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from engine_pool.launcher import EngineProcess\n"
        "async def main():\n"
        "    proc = await EngineProcess.start([sys.executable, '-c', 'import time; time.sleep(120)'], {}, "
        f"Path({str(tmp_path / 'engine.log')!r}), max_bytes=1 << 20, backups=1, name='e')\n"
        "    print(proc.pgid, flush=True)\n"
        "    await asyncio.sleep(120)\n"
        "asyncio.run(main())\n"
    )
    parent = await asyncio.create_subprocess_exec(sys.executable, str(script), stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    assert parent.stdout is not None
    child = int(await asyncio.wait_for(parent.stdout.readline(), 30))
    os.kill(child, 0)  # running
    parent.kill()
    await parent.wait()

    def gone() -> bool:  # exited (a zombie until whoever adopted it reaps it)
        try:
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
        except (FileNotFoundError, ProcessLookupError):
            return True

    await wait_for(gone, what="the engine gone with its kvgate")


async def test_a_drain_during_a_rolling_restart_ends_it_instead_of_hanging_the_model(tmp_path: Path) -> None:
    """A replica drained while a rolling restart restarts it stays stopped (the later command wins); the rolling
    restart says so and lets go of the model, so the next scale runs at once."""
    async with sim_pool(tmp_path, CollectorRegistry(), replicas=2) as pool:
        await pool.wait_ready(timeout_s=60)
        rolling = asyncio.create_task(pool.rolling_restart("m"))
        await wait_for(lambda: pool.slot("m-0").state is not SlotState.READY, what="m-0 being restarted")
        assert await asyncio.wait_for(pool.drain("m-0"), 60) is SlotState.STOPPED
        with pytest.raises(PoolError, match="m-0 was stopped by another command"):
            await asyncio.wait_for(rolling, 60)
        assert await asyncio.wait_for(pool.scale("m", 3), 60) == ["m-0", "m-1", "m-2"]


async def test_a_scale_down_removes_the_replicas_that_serve_least(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with sim_pool(tmp_path, registry, replicas=2) as pool:
        await pool.wait_ready(timeout_s=60)
        await pool.drain("m-0")
        assert await pool.restart("m-0") is SlotState.READY  # a drained replica revived: counted as a restart
        labels = {"replica": "m-0", "model": "m", "reason": "admin"}
        assert registry.get_sample_value("kvgate_pool_restarts_total", labels) == 1
        await pool.drain("m-0")
        assert await asyncio.wait_for(pool.scale("m", 1), 60) == ["m-1"]  # not the only ready one
        assert pool.slot("m-1").state is SlotState.READY
        # the removed replica's series go with it (slot ids are not reused: scaling up and down would pile them up)
        await wait_for(lambda: registry.get_sample_value("kvgate_pool_restarts_total", labels) is None, 30.0)


async def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    """An engine that exits before it is ready is a start-up failure, with the last line it wrote (here its own
    argument error), not a bare crash status: the operator need not open its log to see why."""
    restart = {"backoff_base_s": 0.05, "crash_loop_limit": 2, "crash_loop_window_s": 600}
    async with sim_pool(tmp_path, CollectorRegistry(), extra_args=["--no-such-flag"], restart=restart) as pool:
        assert await pool.supervisor.wait_for("m-0", {SlotState.FAILED}, timeout_s=60) is SlotState.FAILED
        error = pool.slot("m-0").last_error
        assert error is not None and error.startswith("startup: exit status 2") and "--no-such-flag" in error
