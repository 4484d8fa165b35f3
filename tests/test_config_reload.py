"""Reload of the whole configuration file without a restart (POST /admin/reload with an empty body, as SIGHUP):
engines join and leave (a removed one finishes its in-flight request), tenants, routing parameters and aliases
change under traffic, sections that need a restart are named and keep running, and an invalid file changes
nothing and says where it is wrong."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.admission.config import hash_key
from gateway.config_load import ConfigSource, load_config
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import REPLICAS
from gateway.reload import RELOADER
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import wait_for
from tests.test_admission_gateway import wait_ready

ADMIN = {"Authorization": "Bearer adm"}


def config_file(path: Path, engines: list[SimServer], **extra: Any) -> None:
    data: dict[str, Any] = {
        "server": {"port": 0, "access_log": "off"},
        "health": {"interval_s": 0.1, "timeout_s": 1.0, "metrics_interval_s": 0.1},
        "admin": {"key": "adm"},
        "routing": {"policy": "least-load"},
        "engines": [{"url": s.url} for s in engines],
        "admission": {"auth": True, "tenants": {"acme": {"keys": [hash_key("sk-acme")]}}},
    }
    data.update(extra)
    path.write_text(yaml.safe_dump(data))


@asynccontextmanager
async def gateway_from(path: Path, **flags: Any) -> AsyncIterator[RunningGateway]:
    """`flags`: the command line's overrides (`kvgate serve --policy ...`), over the file at start and on reload."""
    source = ConfigSource(str(path), flags)
    async with running_gateway(load_config(str(path), overrides=flags, environ={}), source=source) as gw:
        yield gw


async def chat(http: aiohttp.ClientSession, gw: RunningGateway, key: str, model: str = "sim", **body: Any) -> Any:
    payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    async with http.post(
        f"{gw.url}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        return r.status, r.headers.get("x-kvgate-replica"), await r.json()


async def reload(http: aiohttp.ClientSession, gw: RunningGateway) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{gw.url}/admin/reload", headers=ADMIN) as resp:
        return resp.status, await resp.json()


async def test_reloading_the_file_applies_engines_tenants_routing_and_aliases(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(run_sim_engine(SimConfig(model="sim", decode_ms=50, seed=i)))
            for i in range(2)
        ]
        path = tmp_path / "kvgate.yaml"
        config_file(path, sims[:1])
        gw = await stack.enter_async_context(gateway_from(path))
        await wait_ready(http, gw.url)
        first = sims[0].url.split("://", 1)[1]
        assert (await chat(http, gw, "sk-acme"))[:2] == (200, first)
        assert (await chat(http, gw, "sk-new"))[0] == 401
        slow = asyncio.create_task(chat(http, gw, "sk-acme", max_tokens=40))  # in flight on the first engine
        await wait_for(lambda: any(r.in_flight for r in gw.app[REPLICAS]), what="a request in flight")

        # the second engine replaces the first; a new tenant; an alias; cache-aware routing; a new port
        config_file(
            path, sims[1:], routing={"policy": "cache-aware"}, models={"aliases": {"gpt-4o-mini": "sim"}},
            admission={"auth": True, "tenants": {"acme": {"keys": [hash_key("sk-acme")]},
                                                 "new": {"keys": [hash_key("sk-new")]}}},
            server={"port": 1, "access_log": "off"},
        )  # fmt: skip
        status, answer = await reload(http, gw)
        assert status == 200, answer
        second = sims[1].url.split("://", 1)[1]
        assert answer["engines_added"] == [second] and answer["engines_removed"] == [first]
        assert set(answer["applied"]) == {"admission", "routing", "models", "engines"}
        assert answer["restart_needed"] == ["server"]
        status, _, body = await slow  # the removed engine finished what it had
        assert status == 200 and body["usage"]["completion_tokens"] == 40
        await wait_ready(http, gw.url)
        status, replica, _ = await chat(http, gw, "sk-new", model="gpt-4o-mini")
        assert (status, replica) == (200, second)
        async with http.get(f"{gw.url}/admin/replicas", headers=ADMIN) as resp:
            listed = {r["id"] for r in (await resp.json())["replicas"]}
        assert listed == {second}


async def test_an_invalid_file_changes_nothing_and_says_where(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with run_sim_engine(SimConfig(model="sim")) as sim:
        path = tmp_path / "kvgate.yaml"
        config_file(path, [sim])
        async with gateway_from(path) as gw:
            await wait_ready(http, gw.url)
            config_file(path, [sim], routing={"policy": "cache-aware", "params": {"no_such_param": 1}})
            status, answer = await reload(http, gw)
            assert status == 400 and "routing" in answer["error"]["message"]
            path.write_text("engines: [")  # not even YAML
            status, answer = await reload(http, gw)
            assert status == 400
            assert (await chat(http, gw, "sk-acme"))[0] == 200  # still the old config


async def test_a_reload_to_cache_aware_routes_by_prefix_at_once(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """Started with least-load, reloaded to cache-aware: the prefix-cache state follows the policy, so requests
    sharing a long system prompt go where the first one went; back to least-load and again to cache-aware, the
    cache state starts over (what it knew went stale while no policy used it)."""
    sim = SimConfig(model="sim", block_size=16, overhead_ms=0, prefill_us_per_token=0, decode_ms=0, decode_ms_per_seq=0)
    system = "you are a helpful assistant who answers briefly and politely. " * 30  # 300 words
    cache_aware = {"policy": "cache-aware"}
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(run_sim_engine(sim.model_copy(update={"seed": i}))) for i in range(3)]
        path = tmp_path / "kvgate.yaml"
        config_file(path, sims, admission={"auth": False}, cache={"tokenizers": {"sim": "sim"}})
        gw = await stack.enter_async_context(gateway_from(path))
        await wait_ready(http, gw.url)

        async def reasons(user: str) -> list[str]:
            got = []
            for n in range(3):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{user} {n}"}]
                body = {"model": "sim", "max_tokens": 2, "messages": messages}
                async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    got.append(resp.headers["x-kvgate-route-reason"])
            return got

        for routing, first_user in ((cache_aware, "q"), ({"policy": "least-load"}, "r"), (cache_aware, "s")):
            config_file(path, sims, admission={"auth": False}, routing=routing, cache={"tokenizers": {"sim": "sim"}})
            status, answer = await reload(http, gw)
            assert status == 200 and "routing" in answer["applied"], answer
            got = await reasons(first_user)
            if routing is cache_aware:
                assert got[0].startswith("cold-") and got[1:] == ["cache-hit", "cache-hit"], got
            else:
                assert not any(r.startswith(("cold-", "cache-")) for r in got), got


async def test_one_engine_twice_in_a_reloaded_file_is_refused_with_its_path(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """An engine written twice (issue 33: a trailing slash) is a configuration error on reload too: nothing
    changes, the answer names the entry."""
    async with run_sim_engine(SimConfig(model="sim")) as sim:
        path = tmp_path / "kvgate.yaml"
        config_file(path, [sim])
        async with gateway_from(path) as gw:
            await wait_ready(http, gw.url)
            data = yaml.safe_load(path.read_text())
            data["engines"].append({"url": sim.url + "/"})
            path.write_text(yaml.safe_dump(data))
            status, answer = await reload(http, gw)
            assert status == 400 and "engines.1.url: duplicate engine" in answer["error"]["message"]
            assert [r.id for r in gw.app[REPLICAS]] == [sim.url.split("://")[1]]
            assert (await chat(http, gw, "sk-acme"))[0] == 200


async def test_a_reload_keeps_the_command_lines_flags_over_the_file(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """`kvgate serve -c F --policy round-robin --engine URL`: the flags win over the file at start and on every
    reload, so reloading an unchanged file changes nothing."""
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(run_sim_engine(SimConfig(model="sim", seed=i))) for i in range(2)]
        path = tmp_path / "kvgate.yaml"
        config_file(path, sims[:1], routing={"policy": "cache-aware"})
        flags = {"routing": {"policy": "round-robin"}, "engines": [{"url": sims[1].url}]}
        gw = await stack.enter_async_context(gateway_from(path, **flags))
        await wait_ready(http, gw.url)
        status, answer = await reload(http, gw)
        assert status == 200 and answer["applied"] == [] and answer["engines_removed"] == [], answer
        status, replica, _ = await chat(http, gw, "sk-acme")
        assert status == 200 and replica == sims[1].url.split("://")[1]
        assert [r.id for r in gw.app[REPLICAS]] == [replica]


async def test_a_quota_store_change_is_named_as_needing_a_restart(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with run_sim_engine(SimConfig(model="sim")) as sim:
        path = tmp_path / "kvgate.yaml"
        config_file(path, [sim])
        async with gateway_from(path) as gw:
            await wait_ready(http, gw.url)
            auth = {"auth": True, "tenants": {"acme": {"keys": [hash_key("sk-acme")]}}}
            config_file(path, [sim], admission={**auth, "redis": {"url": "http://127.0.0.1:6379"}})
            status, answer = await reload(http, gw)
            assert status == 400 and "admission.redis.url: a Redis URL is" in answer["error"]["message"]
            config_file(path, [sim], admission={**auth, "redis": {"url": "redis://127.0.0.1:6379/0"}})
            status, answer = await reload(http, gw)
            assert status == 200 and answer["restart_needed"] == ["admission.redis"], answer


async def test_an_engine_put_back_while_it_drains_stays_and_the_rest_of_that_reload_applies(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A reload removes an engine carrying a request; a second one, while it drains, lists it again (and switches
    the policy): the engine takes requests again and stays when its drain ends. It used to fail the second reload
    ("replica already exists") after the policy had changed, and the drain then removed the engine for good."""
    async with AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(run_sim_engine(SimConfig(model="sim", decode_ms=50, seed=i)))
            for i in range(2)
        ]
        path = tmp_path / "kvgate.yaml"
        config_file(path, sims)
        gw = await stack.enter_async_context(gateway_from(path))
        await wait_ready(http, gw.url)
        first, second = (s.url.split("://", 1)[1] for s in sims)
        replicas = gw.app[REPLICAS]
        config_file(path, sims[:1])  # the first engine alone takes the next request
        assert (await reload(http, gw))[1]["engines_removed"] == [second]
        await wait_for(lambda: replicas.get(second) is None, what="the second engine gone")
        slow = asyncio.create_task(chat(http, gw, "sk-acme", max_tokens=40))
        await wait_for(lambda: replicas.get(first).in_flight > 0, what="a request on the first engine")  # type: ignore[union-attr]
        config_file(path, sims[1:])
        status, answer = await reload(http, gw)
        assert status == 200 and answer["engines_removed"] == [first]
        assert replicas.get(first).draining  # type: ignore[union-attr]
        config_file(path, sims, routing={"policy": "round-robin"})
        status, answer = await reload(http, gw)
        assert status == 200, answer
        assert answer["engines_added"] == [first] and set(answer["applied"]) == {"routing", "engines"}
        assert not replicas.get(first).draining  # type: ignore[union-attr]
        assert (await slow)[0] == 200
        await wait_for(lambda: not gw.app[RELOADER].draining, what="the drain's end")
        await wait_ready(http, gw.url)
        served = {(await chat(http, gw, "sk-acme"))[1] for _ in range(4)}  # round-robin: both engines
        assert served == {first, second}
        status, answer = await reload(http, gw)  # nothing changed since: nothing to apply
        assert status == 200 and answer["applied"] == []


async def test_a_new_gate_on_an_engine_applies_in_place_without_taking_it_out(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Changing an attached engine's `max_concurrency` while it serves keeps it in the pool (it used to drain, and
    the gateway answered 503 no_ready_replica until its streams ended); the new gate is the one admission uses."""
    async with run_sim_engine(SimConfig(model="sim", decode_ms=50)) as sim:
        path = tmp_path / "kvgate.yaml"
        config_file(path, [sim])
        async with gateway_from(path) as gw:
            await wait_ready(http, gw.url)
            rid = sim.url.split("://", 1)[1]
            slow = asyncio.create_task(chat(http, gw, "sk-acme", max_tokens=40))
            replica = gw.app[REPLICAS].get(rid)
            assert replica is not None
            await wait_for(lambda: replica.in_flight > 0, what="a request in flight")
            config_file(path, [sim])
            data = yaml.safe_load(path.read_text())
            data["engines"][0].update(max_concurrency=3, max_num_seqs=8)
            path.write_text(yaml.safe_dump(data))
            status, answer = await reload(http, gw)
            assert status == 200, answer
            assert answer["engines_changed"] == [rid] and answer["engines_removed"] == []
            assert gw.app[REPLICAS].get(rid) is replica and not replica.draining
            assert (replica.max_concurrency, replica.max_num_seqs) == (3, 8)
            assert (await chat(http, gw, "sk-acme"))[:2] == (200, rid)  # served while the stream goes on
            async with http.get(f"{gw.url}/ready") as resp:
                assert resp.status == 200
            assert (await slow)[0] == 200


async def test_switching_auth_by_reload_switches_who_may_read_metrics(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """`server.metrics_access: auto` follows admission.auth as reloaded: turned on, /metrics needs the admin key
    and /ready tells only its verdict; turned off, /metrics is public again."""
    async with run_sim_engine(SimConfig(model="sim")) as sim:
        path = tmp_path / "kvgate.yaml"
        config_file(path, [sim], admission={"auth": False})
        async with gateway_from(path) as gw:
            await wait_ready(http, gw.url)

            async def public() -> tuple[int, bool]:
                async with http.get(f"{gw.url}/metrics") as m, http.get(f"{gw.url}/ready") as r:
                    return m.status, "models" in await r.json()

            assert await public() == (200, True)
            config_file(path, [sim])  # auth on
            assert (await reload(http, gw))[0] == 200
            assert await public() == (401, False)
            config_file(path, [sim], admission={"auth": False})
            assert (await reload(http, gw))[0] == 200
            assert await public() == (200, True)
