"""Disaggregated serving through kvgate: the selective split decision on literal snapshots, and the whole flow over
simulated engines with a shared-storage KV connector (prefill step, hand-over, decode, fallbacks)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_pool.spec import ModelPoolConfig, PoolConfig
from engine_pool.vllm_command import EngineLaunchSpec, vllm_argv
from gateway.config_load import load_config
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import REPLICAS
from policies.base import ReplicaState
from policies.disagg import Split, split
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import gateway_config, wait_for

BS = 16


def rep(rid: str, in_flight: int = 0, **kw: Any) -> ReplicaState:
    return ReplicaState(id=rid, model="m", in_flight=in_flight, **kw)


# --- the decision --------------------------------------------------------------------------------------------------
def test_a_long_uncached_prompt_is_split() -> None:
    assert split(2000, BS, [rep("p")], [rep("d")], {}, min_prefill_tokens=512) == Split(True, "split")


def test_a_prompt_whose_uncached_part_is_short_runs_whole_on_decode() -> None:
    # 2000 tokens, 1600 of them (100 blocks) cached on a decode replica: 400 left to compute
    assert split(2000, BS, [rep("p")], [rep("d")], {"d": 100}, min_prefill_tokens=512) == Split(False, "short-prompt")
    assert split(300, BS, [rep("p")], [rep("d")], {}, min_prefill_tokens=512).reason == "short-prompt"


def test_without_a_ready_prefill_replica_the_request_runs_whole() -> None:
    down = rep("p", ready=False)
    full = rep("q", in_flight=2, max_concurrency=2)
    assert split(2000, BS, [down, full], [rep("d")], {}, min_prefill_tokens=512) == Split(False, "no-prefill-replica")


def test_a_saturated_prefill_group_sends_work_to_decode_replicas_with_room() -> None:
    busy = rep("p", in_flight=8, max_num_seqs=8)
    assert split(2000, BS, [busy], [rep("d", max_num_seqs=8)], {}, min_prefill_tokens=512).reason == "prefill-saturated"
    # decode is as full: splitting still moves the prefill off it
    full = rep("d", in_flight=8, max_num_seqs=8)
    assert split(2000, BS, [busy], [full], {}, min_prefill_tokens=512).split


# --- through the gateway -------------------------------------------------------------------------------------------
SIM = SimConfig(model="sim", block_size=BS, overhead_ms=0, prefill_us_per_token=0, decode_ms=0, decode_ms_per_seq=0)
LONG = "summarise this document: " + "the quick brown fox jumps over the lazy dog. " * 60  # ~2800 sim tokens
SHORT = "hello there"


@asynccontextmanager
async def pd_gateway(
    tmp: Path, prefill: list[SimConfig], decode: list[SimConfig], **overrides: Any
) -> AsyncIterator[tuple[RunningGateway, list[SimServer], list[SimServer]]]:
    folder = str(tmp / "kv")
    async with AsyncExitStack() as stack:
        p = [await stack.enter_async_context(run_sim_engine(c.model_copy(update={"kv_transfer_dir": folder})))
             for c in prefill]  # fmt: skip
        d = [await stack.enter_async_context(run_sim_engine(c.model_copy(update={"kv_transfer_dir": folder})))
             for c in decode]  # fmt: skip
        engines = [{"url": s.url, "model": "sim", "name": f"prefill-{i}", "role": "prefill"} for i, s in enumerate(p)]
        engines += [{"url": s.url, "model": "sim", "name": f"decode-{i}", "role": "decode"} for i, s in enumerate(d)]
        routing = {"policy": "cache-aware", **overrides.pop("routing", {})}
        cfg = gateway_config([], engines=engines, routing=routing, cache={"tokenizers": {"sim": "sim"}}, **overrides)
        gw = await stack.enter_async_context(running_gateway(cfg))
        replicas = gw.app[REPLICAS]
        expected = sum(1 for c in prefill if not c.faults.fail_health) + len(decode)
        await wait_for(lambda: sum(r.routable(time.monotonic()) for r in replicas) == expected, what="replicas ready")
        yield gw, p, d


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, **extra: Any) -> tuple[dict[str, Any], Any]:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 6, **extra}
    async with http.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data, resp.headers


async def test_a_long_prompt_is_prefilled_on_a_prefill_replica_and_decoded_from_the_handed_over_kv(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with pd_gateway(tmp_path, [SIM], [SIM, SIM]) as (gw, (prefill,), decode):
        data, headers = await complete(http, gw.url, LONG)
        assert headers["x-kvgate-disagg"] == "split; prefill=prefill-0"
        assert headers["x-kvgate-replica"].startswith("decode-")
        assert prefill.engine.stats.completed == 1 and prefill.engine.stats.generated_tokens == 1
        usage = data["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BS  # handed over
        assert sum(s.engine.stats.generated_tokens for s in decode) == 6
        # the same answer as the request run whole on one engine
        async with run_sim_engine(SIM) as alone:
            whole, _ = await complete(http, alone.url, LONG)
        assert data["choices"][0]["text"] == whole["choices"][0]["text"]
        metrics = await (await http.get(gw.url + "/metrics")).text()
        assert 'kvgate_disagg_requests_total{mode="split",model="sim"} 1.0' in metrics
        assert 'kvgate_disagg_prefill_seconds_count{model="sim"} 1.0' in metrics
        assert 'kvgate_disagg_handover_seconds_count{model="sim"} 1.0' in metrics
        # the handed-over KV was computed for this request: no cache hit in the gateway's counters or a tenant's bill
        assert not re.search(r'kvgate_tokens_total\{kind="cached",model="sim"\} [1-9]', metrics)
        assert re.search(r'kvgate_tokens_total\{kind="prompt",model="sim"\} [1-9]', metrics)


async def test_a_short_prompt_runs_whole_on_a_decode_replica(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with pd_gateway(tmp_path, [SIM], [SIM]) as (gw, (prefill,), _):
        _, headers = await complete(http, gw.url, SHORT)
        assert headers["x-kvgate-disagg"] == "aggregated; reason=short-prompt"
        assert headers["x-kvgate-replica"] == "decode-0"
        assert prefill.engine.stats.started == 0


async def test_a_split_stream_is_relayed_from_the_decode_replica(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with pd_gateway(tmp_path, [SIM], [SIM]) as (gw, (prefill,), (decode,)):
        body = {"model": "sim", "prompt": LONG, "max_tokens": 5, "stream": True}
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvgate-disagg"].startswith("split")
            events = [line async for line in resp.content if line.startswith(b"data: ")]
        assert events[-1].strip() == b"data: [DONE]" and len(events) == 6
        assert prefill.engine.stats.generated_tokens == 1 and decode.engine.stats.generated_tokens == 5


async def test_a_failing_prefill_replica_is_retried_on_another(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    broken = SIM.model_copy(update={"faults": SIM.faults.model_copy(update={"error_rate": 1.0})})
    async with pd_gateway(tmp_path, [broken, SIM], [SIM]) as (gw, (bad, good), _):
        for i in range(3):
            _, headers = await complete(http, gw.url, f"{i} {LONG}")
            assert headers["x-kvgate-disagg"] == "split; prefill=prefill-1"
        assert good.engine.stats.completed == 3 and bad.engine.stats.completed == 0


@pytest.mark.parametrize(
    "fault",
    [{"error_rate": 1.0}, {"fail_health": True}, {"stall_s": 5.0, "stall_rate": 1.0}],
    ids=lambda f: next(iter(f)),
)
async def test_without_a_working_prefill_replica_the_request_runs_whole(
    http: aiohttp.ClientSession, tmp_path: Path, fault: dict[str, Any]
) -> None:
    """Two prefill replicas that fail (500 both: not the request's fault here), are down, or stall past
    prefill_timeout_s: the request runs whole on the decode replica, never answered with their error."""
    broken = SIM.model_copy(update={"faults": SIM.faults.model_copy(update=fault)})
    routing = {"disaggregation": {"prefill_timeout_s": 1.0}}
    async with pd_gateway(tmp_path, [broken, broken], [SIM], routing=routing) as (gw, _, (decode,)):
        data, headers = await complete(http, gw.url, LONG)
        reason = "no-prefill-replica" if "fail_health" in fault else "prefill-failed"
        assert headers["x-kvgate-disagg"] == f"aggregated; reason={reason}"
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed whole on decode
        assert decode.engine.stats.completed == 1


async def test_a_model_with_only_prefill_replicas_up_is_not_ready(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """A prefill replica serves nothing alone: with its decode replica down, /ready said 200 (and a load balancer
    sent traffic) while every request was 503 no_ready_replica."""
    down = SIM.model_copy(update={"faults": SIM.faults.model_copy(update={"fail_health": True})})
    async with pd_gateway(tmp_path, [SIM], [SIM]) as (gw, _, _):
        async with http.get(gw.url + "/ready") as resp:
            assert resp.status == 200
    async with AsyncExitStack() as stack:
        p = await stack.enter_async_context(run_sim_engine(SIM))
        d = await stack.enter_async_context(run_sim_engine(down))
        engines = [{"url": p.url, "model": "sim", "role": "prefill"}, {"url": d.url, "model": "sim", "role": "decode"}]
        gw = await stack.enter_async_context(running_gateway(gateway_config([], engines=engines)))
        await wait_for(lambda: any(r.routable(time.monotonic()) for r in gw.app[REPLICAS]), what="prefill ready")
        async with http.get(gw.url + "/ready") as resp:
            state = await resp.json()
            assert resp.status == 503 and state["models"]["sim"]["ready"] == 1, state  # the prefill replica alone
        async with http.post(gw.url + "/v1/completions", json={"model": "sim", "prompt": SHORT}) as resp:
            assert resp.status == 503


# --- configuration -------------------------------------------------------------------------------------------------
def test_the_kv_connector_reaches_vllm_and_roles_are_checked() -> None:
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    argv = vllm_argv(EngineLaunchSpec(model="/m", port=8001, kv_transfer_config=connector))
    assert argv[argv.index("--kv-transfer-config") + 1] == '{"kv_connector":"ExampleConnector","kv_role":"kv_both"}'
    with pytest.raises(ValueError, match="needs kv_transfer_config"):
        ModelPoolConfig(name="p", role="prefill")
    with pytest.raises(ValueError, match="none to decode on"):
        PoolConfig(models=[ModelPoolConfig(name="p", serves="m", role="prefill", kv_transfer_config=connector)])


SHIPPED = Path(__file__).resolve().parent.parent / "deploy" / "gpu-8x-disagg.yaml"


@pytest.mark.skipif(not SHIPPED.is_file(), reason="needs the source checkout (the bare-install run has tests/ only)")
def test_the_shipped_disaggregated_gpu_config_loads() -> None:
    config = load_config(str(SHIPPED), environ={})
    assert config.pool is not None
    groups = {m.name: (m.served, m.role, m.replicas) for m in config.pool.models}
    assert groups == {
        "qwen3-32b-prefill": ("qwen3-32b", "prefill", 3),
        "qwen3-32b-decode": ("qwen3-32b", "decode", 5),
    }
