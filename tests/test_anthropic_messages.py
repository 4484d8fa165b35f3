"""The Anthropic Messages API through kvgate: the `anthropic` SDK against kvgate in front of two simulated engines
(which serve `/v1/messages` as vLLM does): answers whole and streamed with their usage, count_tokens, the SDK's
exception classes from kvgate's own errors, cache-aware routing of a shared system prompt, sessions by the coding
agents' headers, and a stream cut by its engine ending in an Anthropic `error` event."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import pytest

from cacheindex.tokenizers import SimPromptTokenizer
from gateway.admission.config import hash_key
from gateway.anthropic import messages_as_chat
from gateway.errors import BadRequest, Overloaded, render_error
from gateway.keys import CACHE, REPLICAS
from simengine import SimConfig
from simengine import messages as sim_messages
from simengine.config import Faults
from simengine.tokenize import tokenize_chat
from tests.conftest import gateway_over_sims, wait_for

SIM = SimConfig(model="sim", block_size=16, overhead_ms=0, prefill_us_per_token=0, decode_ms=0, decode_ms_per_seq=0)
CACHE_AWARE = {"routing": {"policy": "cache-aware"}, "cache": {"tokenizers": {"sim": "sim"}}}
SYSTEM = "You are a careful coding agent. " * 40  # 320 of the simulator's tokens: 20 blocks of 16


@asynccontextmanager
async def sdk(url: str) -> AsyncIterator[Callable[..., anthropic.AsyncAnthropic]]:
    """A maker of SDK clients for kvgate at `url` (no retries: every answer is kvgate's first), closed at the end."""
    made: list[anthropic.AsyncAnthropic] = []

    def make(key: str | None = "sk-any", **options: Any) -> anthropic.AsyncAnthropic:
        made.append(anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, **options))
        return made[-1]

    try:
        yield make
    finally:
        for api in made:
            await api.close()


def metric(text: str, name: str, model: str = "sim") -> float:
    found = re.search(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', text, re.M)
    assert found is not None, name
    return float(found.group(1))


async def test_messages_whole_and_streamed_with_usage_and_count_tokens() -> None:
    async with gateway_over_sims([SIM, SIM], **CACHE_AWARE) as (gw, sims), sdk(gw.url) as client:
        api = client(default_headers={"anthropic-beta": "kvgate-test-2026"})

        msgs: list[anthropic.types.MessageParam] = [{"role": "user", "content": "write a haiku"}]
        whole = await api.messages.create(model="sim", max_tokens=5, system=SYSTEM, messages=msgs)
        assert whole.type == "message" and whole.content[0].type == "text" and whole.content[0].text
        assert whole.usage.output_tokens == 5
        counted = await api.messages.count_tokens(model="sim", system=SYSTEM, messages=msgs)
        prompt = tokenize_chat([{"role": "system", "content": SYSTEM}, *msgs])  # the simulator's own rendering
        assert counted.input_tokens == len(prompt)
        assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == len(prompt)

        async with api.messages.stream(model="sim", max_tokens=7, system=SYSTEM, messages=msgs) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text and final.usage.output_tokens == 7 and final.stop_reason == "max_tokens"
        assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == len(prompt)
        assert (final.usage.cache_read_input_tokens or 0) >= 16 * 20  # the second time, the system prompt was cached
        # anthropic-version (and -beta) reached the engine as the SDK sent them
        seen = [h for s in sims for h in s.engine.anthropic_headers]
        assert seen and set(seen) == {(api.default_headers["anthropic-version"], "kvgate-test-2026")}
        metrics = await _metrics(gw.url)
        # kvgate read the Messages API's usage: cached and completion tokens (whole + streamed answer)
        completion = re.search(r'^kvgate_tokens_total\{kind="completion",model="sim"\} (\S+)$', metrics, re.M)
        assert completion is not None and float(completion.group(1)) == 5 + 7
        cached = re.search(r'^kvgate_tokens_total\{kind="cached",model="sim"\} (\S+)$', metrics, re.M)
        assert cached is not None and float(cached.group(1)) == final.usage.cache_read_input_tokens
        # its prediction of the cached prompt equals what the engines reported
        predicted = metric(metrics, "kvgate_prefix_predicted_cached_tokens_total")
        assert predicted == metric(metrics, "kvgate_prefix_reported_cached_tokens_total") > 0


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        return await resp.text()


async def test_a_shared_system_prompt_is_routed_to_its_holder() -> None:
    async with gateway_over_sims([SIM, SIM], **CACHE_AWARE) as (gw, _), sdk(gw.url) as client:
        api = client()
        homes, reasons, cached = [], [], []
        for question in ("first question", "second question", "third question"):
            raw = await api.messages.with_raw_response.create(
                model="sim", max_tokens=2, system=[{"type": "text", "text": SYSTEM}],
                messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
            )  # fmt: skip
            homes.append(raw.headers["x-kvgate-replica"])
            reasons.append(raw.headers["x-kvgate-route-reason"])
            cached.append((await raw.parse()).usage.cache_read_input_tokens)
        assert reasons == ["cold-least-load", "cache-hit", "cache-hit"]
        assert len(set(homes)) == 1
        assert cached[0] == 0 and cached[1] >= 16 * 20 and cached[2] == cached[1]


@pytest.mark.parametrize(
    ("header", "metadata"),
    [("x-claude-code-session-id", None), ("session-id", None), ("x-session-affinity", None), (None, "user-7")],
)
async def test_an_agent_session_stays_on_its_replica(header: str | None, metadata: str | None) -> None:
    async with gateway_over_sims([SIM, SIM], **CACHE_AWARE) as (gw, _), sdk(gw.url) as client:
        api = client()
        extra = {header: "session-42"} if header else {}
        meta: anthropic.types.MetadataParam = {"user_id": metadata} if metadata else {}
        first = ""
        for turn in range(4):  # a different prompt every turn: only the session keeps it in place
            raw = await api.messages.with_raw_response.create(
                model="sim", max_tokens=2, system="totally different " * (turn + 1), metadata=meta,
                messages=[{"role": "user", "content": f"turn {turn}"}], extra_headers=extra,
            )  # fmt: skip
            if turn == 0:
                first = raw.headers["x-kvgate-replica"]
            else:
                assert (raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route-reason"]) == (first, "session")


async def test_an_agents_tool_use_keeps_its_session_awaited_until_its_tool_result() -> None:
    """An answer that is a tool call (forced: tool_choice any / a named tool, as vLLM's guided choice does) marks
    the agent expected back on its replica (`kvgate_sessions_awaited`), read by the SDK as a tool_use block whole
    and streamed; the turn carrying its tool_result comes back to the same replica with its history cached and
    ends the wait."""
    tools: list[anthropic.types.ToolParam] = [{"name": "bash", "input_schema": {"type": "object"}},
                                              {"name": "read", "input_schema": {"type": "object"}}]  # fmt: skip
    session = {"x-claude-code-session-id": "agent-9"}
    msgs: list[anthropic.types.MessageParam] = [{"role": "user", "content": "fix the failing test"}]
    async with gateway_over_sims([SIM, SIM], **CACHE_AWARE) as (gw, _), sdk(gw.url) as client:
        api = client()
        whole = await api.messages.create(
            model="sim", max_tokens=4, system=SYSTEM, messages=msgs, tools=tools, tool_choice={"type": "any"},
        )  # fmt: skip
        assert whole.stop_reason == "tool_use" and whole.content[0].type == "tool_use"
        assert whole.content[0].name == "bash" and whole.content[0].input["input"].count(" w") == 4  # type: ignore[index]
        assert "kvgate_sessions_awaited 0.0" in await _metrics(gw.url)  # no session: nothing to keep
        async with api.messages.stream(
            model="sim", max_tokens=4, system=SYSTEM, messages=msgs, tools=tools,
            tool_choice={"type": "tool", "name": "read"}, extra_headers=session,
        ) as stream:  # fmt: skip
            home = stream.response.headers["x-kvgate-replica"]
            call = await stream.get_final_message()
        assert call.stop_reason == "tool_use" and call.content[0].type == "tool_use" and call.content[0].name == "read"
        assert call.content[0].input == {"input": whole.content[0].input["input"]}  # type: ignore[index]  # same tokens
        awaited = gw.app[CACHE].awaited
        await wait_for(lambda: awaited is not None and len(awaited) == 1, what="the session awaited")
        assert "kvgate_sessions_awaited 1.0" in await _metrics(gw.url)
        result: list[anthropic.types.MessageParam] = [
            *msgs,
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.content[0].id, "name": "read",
                                                "input": call.content[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.content[0].id,
                                           "content": "1 failed"}]},
        ]  # fmt: skip
        raw_next = await api.messages.with_raw_response.create(
            model="sim", max_tokens=2, system=SYSTEM, messages=result, extra_headers=session
        )
        assert (raw_next.headers["x-kvgate-replica"], raw_next.headers["x-kvgate-route-reason"]) == (home, "session")
        assert ((await raw_next.parse()).usage.cache_read_input_tokens or 0) >= 16 * 20
        assert "kvgate_sessions_awaited 0.0" in await _metrics(gw.url)


TENANTS = {
    "alice": {"keys": [hash_key("sk-alice")], "limits": {"requests_per_minute": 1}},
    "bob": {"keys": [hash_key("sk-bob")]},
}


async def test_errors_are_the_sdks_exception_classes() -> None:
    admission = {"auth": True, "tenants": TENANTS}
    async with gateway_over_sims([SIM, SIM], admission=admission) as (gw, _), sdk(gw.url) as client:
        msgs: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await client("sk-wrong").messages.create(model="sim", max_tokens=2, messages=msgs)
        assert auth.value.type == "authentication_error"
        bob = client("sk-bob")
        assert (await bob.messages.create(model="sim", max_tokens=2, messages=msgs)).usage.output_tokens == 2
        bearer = client(None, auth_token="sk-bob")  # Authorization
        assert (await bearer.messages.create(model="sim", max_tokens=2, messages=msgs)).usage.output_tokens == 2
        with pytest.raises(anthropic.BadRequestError) as bad:
            await bob.messages.create(model="sim", max_tokens=0, messages=msgs)
        assert bad.value.type == "invalid_request_error" and "max_tokens" in str(bad.value.message)
        with pytest.raises(anthropic.BadRequestError):  # a block type vLLM does not know
            await bob.messages.create(
                model="sim",
                max_tokens=2,
                messages=[{"role": "user", "content": [{"type": "video"}]}],  # type: ignore[list-item]
            )
        with pytest.raises(anthropic.NotFoundError) as missing:
            await bob.messages.create(model="no-such-model", max_tokens=2, messages=msgs)
        assert missing.value.type == "not_found_error"
        assert missing.value.request_id == missing.value.response.headers["x-request-id"]  # Anthropic's `request-id`
        alice = client("sk-alice")
        raw = await alice.messages.with_raw_response.create(model="sim", max_tokens=2, messages=msgs)
        assert raw.headers["request-id"] == raw.headers["x-request-id"]
        assert raw.headers["anthropic-ratelimit-requests-limit"] == raw.headers["x-ratelimit-limit-requests"] == "1"
        assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", raw.headers["anthropic-ratelimit-requests-reset"])
        # the quota's window is the wall clock's minute: should the request above have been the last of one, the
        # first request of the next passes, and the one after it is refused (two boundaries are a minute apart)
        with pytest.raises(anthropic.RateLimitError) as limited:
            for _ in range(2):
                await alice.messages.create(model="sim", max_tokens=2, messages=msgs)
        assert limited.value.type == "rate_limit_error"
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert limited.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"


async def test_a_stream_its_engine_cuts_ends_with_an_anthropic_error_event() -> None:
    cut = SIM.model_copy(update={"faults": Faults(cut_after_tokens=3)})
    async with gateway_over_sims([cut, cut], retry={"migrate_streams": False}) as (gw, _), sdk(gw.url) as client:
        api = client()
        got: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with api.messages.stream(
                model="sim", max_tokens=10, messages=[{"role": "user", "content": "a long answer"}]
            ) as stream:
                async for piece in stream.text_stream:
                    got.append(piece)
        assert len(got) == 3  # the tokens before the cut reached the client
        assert failed.value.type == "api_error" and failed.value.body["type"] == "error"  # type: ignore[index]


async def test_a_stream_cut_right_before_message_stop_ends_whole() -> None:
    """The engine died after `message_delta` (the stop reason and usage): the SDK gets its final message whole, and
    the continuation that would run nothing is not tried."""
    cut = SIM.model_copy(update={"faults": Faults(cut_before_end=True)})
    async with gateway_over_sims([cut, cut]) as (gw, sims), sdk(gw.url) as client:
        async with client().messages.stream(
            model="sim", max_tokens=4, messages=[{"role": "user", "content": "a short answer"}]
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
        assert final.content[0].type == "text" and final.content[0].text == text and text
        assert sum(s.engine.stats.started for s in sims) == 1


async def test_counting_tokens_takes_no_capacity_slot_and_charges_no_tokens() -> None:
    """Claude Code counts its prompt while its answers stream: with the pool's one slot taken by a stream, a count
    is answered at once (a message is refused), and the tenant's token quota is not charged for counting."""
    slow = SIM.model_copy(update={"decode_ms": 20})
    tenants = {"carol": {"keys": [hash_key("sk-carol")], "limits": {"tokens_per_minute": 100_000}}}
    admission = {"auth": True, "tenants": tenants, "replica_max_concurrency": 1, "queue": {"max_queued": 0}}
    async with gateway_over_sims([slow], admission=admission) as (gw, _), sdk(gw.url) as make:
        api = make("sk-carol")
        msgs: list[anthropic.types.MessageParam] = [{"role": "user", "content": "a long answer"}]
        async with api.messages.stream(model="sim", max_tokens=100, messages=msgs) as stream:
            async for _ in stream.text_stream:  # the stream holds the slot from its first token on
                break
            windows: set[str] = set()
            while len(windows) != 1:  # two counts in one window of the quota (a minute's boundary between: again)
                remaining, windows = [], set()
                for _ in range(2):
                    counted = await api.messages.with_raw_response.count_tokens(
                        model="sim", system=SYSTEM, messages=msgs
                    )
                    assert (await counted.parse()).input_tokens > 300
                    remaining.append(int(counted.headers["anthropic-ratelimit-tokens-remaining"]))
                    windows.add(counted.headers["anthropic-ratelimit-tokens-reset"])
            with pytest.raises(anthropic.APIStatusError) as refused:
                await api.messages.create(model="sim", max_tokens=2, messages=msgs)
            assert refused.value.status_code == 529
            await stream.until_done()
        assert remaining[0] == remaining[1]


def test_anthropic_error_shapes_and_statuses() -> None:
    status, headers, body = render_error(Overloaded("no capacity", retry_after_s=3), api="anthropic")
    assert (status, headers["Retry-After"]) == (529, "3")  # Anthropic's SDK raises OverloadedError for 529
    assert body == b'{"type":"error","error":{"type":"overloaded_error","message":"no capacity"}}'
    assert render_error(Overloaded("no capacity"))[0] == 503  # OpenAI's routes keep 503
    status, _, body = render_error(BadRequest("bad"), api="anthropic")
    assert status == 400 and b'"invalid_request_error"' in body


AGENT_TURN: dict[str, Any] = {
    "model": "m", "max_tokens": 4, "metadata": {"user_id": "u1"}, "cache_salt": "s",
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"}, {"type": "text", "text": "Be brief."}],
    "tools": [{"name": "read", "input_schema": {"properties": {}}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "open a.txt"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "A"},
                                                                   {"type": "text", "text": "B"}]},
            {"type": "text", "text": "and?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
        {"role": "system", "content": "reminder"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "done"}]},
    ],
}  # fmt: skip


def test_the_chat_view_converts_as_vllm_does() -> None:
    body = AGENT_TURN
    view = messages_as_chat(body)
    assert view is not None
    assert view["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "open a.txt"},
        {"role": "assistant", "reasoning": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"p":"a"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "A\nB"},
        {"role": "user", "content": [{"type": "text", "text": "and?"},
                                     {"type": "image_url", "image_url": {"url": ""}}]},
        {"role": "system", "content": "reminder"},
        {"role": "tool", "tool_call_id": "t2", "content": "done"},  # a user message left empty is dropped
    ]  # fmt: skip
    assert view["tools"] == [
        {"type": "function", "function": {"name": "read", "description": None,
                                          "parameters": {"properties": {}, "type": "object"}}}
    ]  # fmt: skip
    assert (view["user"], view["cache_salt"]) == ("u1", "s")
    unhashable = [{"role": {}, "content": "hi"}, {"role": "user", "content": [{"type": ["text"], "text": "x"}]}]
    bad_bodies = [{**body, "max_tokens": None}, {**body, "messages": []}, {**body, "messages": [{"role": "tool"}]}]
    for bad in bad_bodies + [{**body, "messages": [m]} for m in unhashable]:  # 400s, not a crash on a dict
        with pytest.raises(BadRequest):
            messages_as_chat(bad)


def test_the_simulator_renders_a_messages_body_as_kvgate_predicts_it() -> None:
    """The simulated engine's own conversion (simengine.messages) and kvgate's view, each tokenized its own way,
    give the same prompt: what makes the cache-aware tests above exact."""
    view = messages_as_chat(AGENT_TURN)
    assert view is not None
    predicted = SimPromptTokenizer().tokenize_chat(view["messages"])
    assert predicted == tokenize_chat(sim_messages.chat_messages(AGENT_TURN))


async def test_no_ready_replica_is_the_sdks_overloaded_error() -> None:
    async with gateway_over_sims([SIM], **CACHE_AWARE) as (gw, sims), sdk(gw.url) as client:
        sims[0].engine.set_faults(Faults(fail_health=True))
        replicas = gw.app[REPLICAS]
        await wait_for(lambda: not any(r.routable(time.monotonic()) for r in replicas), what="the replica down")
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            await client().messages.create(model="sim", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert overloaded.value.status_code == 529 and overloaded.value.type == "overloaded_error"
        assert int(overloaded.value.response.headers["retry-after"]) >= 1


async def test_count_tokens_neither_binds_a_session_nor_follows_one() -> None:
    """An agent counts its prompt before sending it: the count (computing no KV, placed by load) must not bind the
    session to that replica; the session's first message goes where its system prompt is cached."""
    async with gateway_over_sims([SIM, SIM, SIM], **CACHE_AWARE) as (gw, _), sdk(gw.url) as make:
        api = make()
        first = await api.messages.with_raw_response.create(
            model="sim", max_tokens=4, system=SYSTEM, messages=[{"role": "user", "content": "warm"}]
        )
        holder = first.headers["x-kvgate-replica"]
        for i in range(4):
            session = {"X-Claude-Code-Session-Id": f"agent-{i}"}
            msgs = [{"role": "user", "content": f"task {i}"}]
            await api.messages.count_tokens(model="sim", system=SYSTEM, messages=msgs, extra_headers=session)
            raw = await api.messages.with_raw_response.create(
                model="sim", max_tokens=4, system=SYSTEM, messages=msgs, extra_headers=session
            )
            assert raw.headers["x-kvgate-replica"] == holder, raw.headers["x-kvgate-route-reason"]
