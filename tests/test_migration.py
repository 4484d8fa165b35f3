"""Request migration through the gateway with simulated engines: the engine of a stream fails mid-answer (its
connection cut, as when the process dies, or silent past the idle timeout) and the answer continues on another
replica in the same client stream, token for token the answer an undisturbed engine gives (the simulated engine
is autoregressive and deterministic, as greedy decoding is), its usage the whole answer's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.keys import REPLICAS
from gateway.migration import MessagesSeam, Relayed, context_full, continuation, migratable
from gateway.request_parse import ParsedRequest
from simengine import Faults, SimConfig
from tests.conftest import gateway_over_sims, wait_for

SIM = SimConfig(model="sim", decode_ms=10.0)
TOKENS = 40
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about migration."}]


async def stream_text(
    client: openai.AsyncOpenAI, kind: str, *, after: int | None = None, on_chunk: Any = None, ids: Any = None
) -> tuple[str, Any, str]:
    """(text, final usage, replica that started it) of one streamed answer; `on_chunk(replica)` is awaited after
    `after` content chunks; each chunk's `id` added to the set `ids` when given."""
    common: dict[str, Any] = {"model": "sim", "max_tokens": TOKENS, "stream": True, "temperature": 0}
    common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        stream = await client.chat.completions.create(messages=MESSAGES, **common)  # type: ignore[call-overload]
    else:
        stream = await client.completions.create(prompt="Tell me about migration.", **common)
    replica = stream.response.headers["x-kvgate-replica"]
    parts, usage, seen = [], None, 0
    async for chunk in stream:
        if ids is not None:
            ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if kind == "chat" else choice.text
            if text:
                parts.append(text)
                seen += 1
                if seen == after:
                    await on_chunk(replica)
    return "".join(parts), usage, replica


async def by_label(http: aiohttp.ClientSession, url: str, sample: str, label: str) -> dict[str, float]:
    """A metric's samples by one label's value."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {
        s.labels[label]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == sample
    }


async def migrations(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return await by_label(http, url, "kvgate_stream_migrations_total", "outcome")


async def tokens(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return await by_label(http, url, "kvgate_tokens_total", "kind")


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_a_stream_whose_engine_fails_continues_on_another_replica(
    kind: str, fault: str, http: aiohttp.ClientSession
) -> None:
    # the stall is 30 s; the idle bound only has to stay above an undisturbed stream's gaps on a busy 2-core machine
    # (at 0.5 s a CI run once saw the continuation itself pause that long and move a second time)
    timeouts = {"stream_idle_s": 2.0}
    async with gateway_over_sims([SIM, SIM], timeouts=timeouts) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            reference, ref_usage, _ = await stream_text(client, kind)
            assert len(reference.split()) == TOKENS

            async def break_engine(replica: str) -> None:
                port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                sim = next(s for s in sims if s.port == port)
                faults = {"cut_after_tokens": 1} if fault == "cut" else {"stall_after_tokens": 1, "stall_s": 30}
                async with http.post(f"{sim.url}/sim/faults", json=faults) as resp:
                    assert resp.status == 200

            ids: set[str] = set()
            text, usage, _ = await stream_text(client, kind, after=5, on_chunk=break_engine, ids=ids)
        assert text == reference  # token for token the undisturbed answer
        assert len(ids) == 1  # one answer's chunks, the continuation's too, as from one engine
        # its usage the undisturbed answer's: the prompt the first engine computed, every token delivered
        assert usage.completion_tokens == TOKENS and usage.prompt_tokens == ref_usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + TOKENS
        assert await migrations(http, gw.url) == {"resumed": 1.0, "closed": 0.0, "failed": 0.0}


async def test_with_migration_off_a_cut_stream_ends_with_an_error_event(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM, SIM], retry={"migrate_streams": False}) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:

            async def cut(replica: str) -> None:
                port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                sim = next(s for s in sims if s.port == port)
                async with http.post(f"{sim.url}/sim/faults", json={"cut_after_tokens": 1}) as resp:
                    assert resp.status == 200

            with pytest.raises(openai.APIError, match="failed mid-stream"):
                await stream_text(client, "completions", after=5, on_chunk=cut)
        assert await migrations(http, gw.url) == {"resumed": 0.0, "closed": 0.0, "failed": 0.0}


@pytest.mark.parametrize(("role_in_first_token", "stream_interval"), [(True, 1), (False, 3), (True, 4)])
async def test_the_seam_loses_no_token_whatever_the_engine_puts_in_an_event(
    role_in_first_token: bool, stream_interval: int, http: aiohttp.ClientSession
) -> None:
    """Engines that send the assistant role with the first token, or several tokens per event (vLLM's stream
    interval above 1): the continued stream is still the undisturbed answer, its usage the whole answer's."""
    sim = SIM.model_copy(update={"role_in_first_token": role_in_first_token, "stream_interval": stream_interval})
    async with gateway_over_sims([sim, sim]) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            reference, _, _ = await stream_text(client, "chat")
            assert len(reference.split()) == TOKENS

            async def cut(replica: str) -> None:
                port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                sim_server = next(s for s in sims if s.port == port)
                async with http.post(f"{sim_server.url}/sim/faults", json={"cut_after_tokens": 1}) as resp:
                    assert resp.status == 200

            text, usage, _ = await stream_text(client, "chat", after=3, on_chunk=cut)
        assert text == reference
        assert usage.completion_tokens == TOKENS
        assert await migrations(http, gw.url) == {"resumed": 1.0, "closed": 0.0, "failed": 0.0}


async def test_a_messages_stream_whose_engine_fails_continues_through_chat(http: aiohttp.ClientSession) -> None:
    """The Messages API (anthropic SDK): the engine is cut after five text deltas; the answer continues on the other
    replica through its chat route and reaches the client as the same Anthropic stream, token for token the
    undisturbed answer, with the whole answer's output tokens and stop reason."""
    anthropic = pytest.importorskip("anthropic")
    async with gateway_over_sims([SIM, SIM]) as (gw, sims):
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0) as client:

            async def answer(after: int | None = None) -> tuple[str, Any]:
                parts: list[str] = []
                async with client.messages.stream(
                    model="sim", max_tokens=TOKENS, system=MESSAGES[0]["content"],
                    messages=[MESSAGES[1]],
                ) as stream:  # fmt: skip
                    replica = stream.response.headers["x-kvgate-replica"]
                    async for text in stream.text_stream:
                        parts.append(text)
                        if len(parts) == after:
                            port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                            sim = next(s for s in sims if s.port == port)
                            async with http.post(f"{sim.url}/sim/faults", json={"cut_after_tokens": 1}) as resp:
                                assert resp.status == 200
                    return "".join(parts), await stream.get_final_message()

            reference, undisturbed = await answer()
            assert len(reference.split()) == TOKENS
            text, final = await answer(after=5)
        assert await migrations(http, gw.url) == {"resumed": 1.0, "closed": 0.0, "failed": 0.0}
        # the prompt counted as its message_start told the client: the first engine's, twice in all
        prompt = undisturbed.usage.input_tokens + (undisturbed.usage.cache_read_input_tokens or 0)
        assert (await tokens(http, gw.url))["prompt"] == 2 * prompt
    assert text == reference  # token for token the undisturbed answer
    assert final.usage.output_tokens == TOKENS and final.stop_reason == undisturbed.stop_reason == "max_tokens"
    # the prompt split into uncached and cached as the undisturbed answer's (the SDK kept message_start's whole count
    # with no cache fields: the prompt looked uncached)
    assert final.usage.cache_read_input_tokens is not None
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


IMAGE_TURN = [{"role": "user", "content": [IMAGE, {"type": "text", "text": MESSAGES[1]["content"]}]}]


@pytest.mark.parametrize(
    ("messages", "extra"),
    [
        (IMAGE_TURN, None),
        ([MESSAGES[1]], {"thinking": {"type": "enabled", "budget_tokens": 16}}),
        ([MESSAGES[1]], {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}),
    ],
    ids=["image", "thinking", "structured-output"],
)
async def test_a_messages_stream_a_chat_continuation_cannot_render_ends_with_an_error(
    http: aiohttp.ClientSession, messages: list[dict[str, Any]], extra: dict[str, Any] | None
) -> None:
    """A Messages request whose prompt or constraints the chat continuation would not carry (an image, a thinking
    budget, structured output) is not continued on another replica with a different meaning: its cut stream ends
    with an error event the SDK raises."""
    anthropic = pytest.importorskip("anthropic")
    async with gateway_over_sims([SIM, SIM]) as (gw, sims):
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0) as client:
            parts: list[str] = []
            with pytest.raises(anthropic.APIStatusError, match="mid-stream"):
                async with client.messages.stream(
                    model="sim", max_tokens=TOKENS, system=MESSAGES[0]["content"], messages=messages,
                    extra_body=extra,
                ) as stream:  # fmt: skip
                    replica = stream.response.headers["x-kvgate-replica"]
                    async for text in stream.text_stream:
                        parts.append(text)
                        if len(parts) == 5:
                            port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                            sim = next(s for s in sims if s.port == port)
                            async with http.post(f"{sim.url}/sim/faults", json={"cut_after_tokens": 1}) as resp:
                                assert resp.status == 200
        assert len(parts) >= 5
        assert (await migrations(http, gw.url)).get("resumed", 0) == 0


def test_a_chat_continuations_error_event_is_told_as_anthropics_error_not_as_a_clean_end() -> None:
    """vLLM's error event in the chat continuation of a Messages stream (then `[DONE]`): the client gets Anthropic's
    `error` event and nothing after it, not `message_delta` with `end_turn` on an answer cut short."""
    seam = MessagesSeam(index=0)
    text, _ = seam.translate(b'data: {"choices":[{"index":0,"delta":{"content":" wor"}}]}\n\n', 3)
    assert [json.loads(e.split(b"data: ")[1])["delta"]["text"] for e in text] == [" wor"]
    error = b'data: {"error": {"object": "error", "message": "grammar failed", "type": "BadRequestError"}}\n\n'
    (event,), usage = seam.translate(error, 3)
    assert event.startswith(b"event: error\n") and usage is None
    assert json.loads(event.split(b"data: ")[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "grammar failed"}
    }  # fmt: skip
    assert seam.translate(b"data: [DONE]\n\n", 3) == ([], None)


def test_a_chat_continuation_that_met_a_stop_string_ends_with_anthropics_stop_sequence() -> None:
    """vLLM's chat choice names the stop string it met (`stop_reason`); the Messages client's closing
    message_delta says `stop_sequence` and that string, as the Messages API does."""
    seam = MessagesSeam(index=0)
    seam.translate(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"END"}]}\n\n', 2)
    _, delta, _ = seam.translate(b"data: [DONE]\n\n", 2)[0]
    assert json.loads(delta.split(b"data: ")[1])["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_a_messages_answer_that_opened_a_thinking_block_is_not_continued_as_text() -> None:
    """A reasoning model's stream cut in its thinking block: a chat continuation would write its answer into the
    thinking block (the client's text lost); no continuation is made, so the stream ends with an error event."""
    events = [
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","content":[]}}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"thinking","thinking":""}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"thinking_delta","thinking":"let me"}}\n\n',
    ]
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    parsed = ParsedRequest("json", body, "m", True, True, 100, api="anthropic")
    assert migratable(parsed)
    relayed = Relayed(1 << 20)
    relayed.add(events, sum(map(len, events)))
    assert continuation(parsed, relayed) is None
    text_events = [events[0], events[1].replace(b'"thinking","thinking":""', b'"text","text":""'), (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"Hello"}}\n\n'
    )]  # fmt: skip
    relayed = Relayed(1 << 20)
    relayed.add(text_events, sum(map(len, text_events)))
    assert continuation(parsed, relayed) is not None  # a text answer is continued


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [
        ("chat", {"messages": []}, True),
        ("chat", {"messages": [], "response_format": {"type": "text"}}, True),
        ("chat", {"messages": [], "response_format": {"type": "json_object"}}, False),
        ("chat", {"messages": [], "structured_outputs": {"regex": "a+"}}, False),
        ("completions", {"prompt": "x", "guided_choice": ["a", "b"]}, False),
        ("chat", {"messages": [], "tools": [{"type": "function"}]}, False),
        ("chat", {"messages": [], "n": 2}, False),
        ("completions", {"prompt": "x", "echo": True}, False),
    ],
)
def test_what_a_continuation_can_carry_exactly_is_migratable(kind: str, body: dict[str, Any], expected: bool) -> None:
    parsed = ParsedRequest(kind, {"model": "m", "stream": True, **body}, "m", True, True, None)  # type: ignore[arg-type]
    assert migratable(parsed) is expected


def test_min_tokens_counts_from_the_continuations_start() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    parsed = ParsedRequest("chat", {**body, "max_tokens": 50, "min_tokens": 20}, "m", True, True, 50)
    relayed = Relayed(1 << 20)
    events = [b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'] * 8
    relayed.add(events, sum(map(len, events)))
    sent = json.loads(continuation(parsed, relayed) or b"")
    assert (sent["max_tokens"], sent["min_tokens"]) == (42, 12)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_a_chat_answer_cut_in_its_reasoning_is_not_continued(field: str) -> None:
    """An engine with a reasoning parser streams the thinking apart from the content: a continuation would carry
    none of it and think again from the start with the budget spent, so the stream is not continued (it ends with
    its error event), nor taken as ended."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    parsed = ParsedRequest("chat", {**body, "max_tokens": 50}, "m", True, True, 50)
    relayed = Relayed(1 << 20)
    events = [b'data: {"choices":[{"index":0,"delta":{"%s":"hmm"}}]}\n\n' % field.encode()] * 3
    relayed.add(events, sum(map(len, events)))
    assert continuation(parsed, relayed) is None and relayed.ended is None


async def test_a_stream_continues_on_a_replica_at_its_gate(http: aiohttp.ClientSession) -> None:
    """One stream per replica with a gate of one each: the replica of one fails, and its stream continues on the
    other (the failed replica's place is what it takes), not ended with an error because that one is at its gate."""
    admission = {"replica_max_concurrency": 1, "targets": {"enabled": False}}
    async with gateway_over_sims([SIM, SIM], admission=admission) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            reference, _, _ = await stream_text(client, "chat")
            started = asyncio.Event()

            async def break_engine(replica: str) -> None:
                await started.wait()  # the other stream holds the other replica
                port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                sim = next(s for s in sims if s.port == port)
                async with http.post(f"{sim.url}/sim/faults", json={"cut_after_tokens": 1}) as resp:
                    assert resp.status == 200

            async def other(replica: str) -> None:
                started.set()

            broken = asyncio.create_task(stream_text(client, "chat", after=5, on_chunk=break_engine))
            await wait_for(lambda: sum(r.in_flight for r in gw.app[REPLICAS]) == 1, what="the first stream")
            (text, _, first), (other_text, _, second) = await asyncio.gather(
                broken, stream_text(client, "chat", after=1, on_chunk=other)
            )
        assert first != second and text == reference and other_text == reference
        assert await migrations(http, gw.url) == {"resumed": 1.0, "closed": 0.0, "failed": 0.0}


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_a_stream_cut_when_its_answer_fills_the_context_ends_at_its_length(
    kind: str, http: aiohttp.ClientSession
) -> None:
    """No max_tokens: the answer runs to the context's end. Cut a token before it, the continuation's prompt (the
    answer so far, rendered again) no longer fits the context and the engine refuses it: the client's stream ends
    as the undisturbed one does, its finish reason `length` and its usage the whole answer's, not with an error."""
    small = SIM.model_copy(update={"max_model_len": 32, "default_max_tokens": 1000})
    async with gateway_over_sims([small, small]) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:

            async def answer(after: int | None = None) -> tuple[str, Any, list[str]]:
                options: dict[str, Any] = {"stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
                if kind == "chat":
                    stream: Any = await client.chat.completions.create(model="sim", messages=MESSAGES, **options)  # type: ignore[arg-type]
                else:
                    stream = await client.completions.create(model="sim", prompt="Tell me about migration.", **options)
                replica, parts, usage, finishes = stream.response.headers["x-kvgate-replica"], [], None, []
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        text = choice.delta.content if kind == "chat" else choice.text
                        parts += [text] if text else []
                        finishes += [choice.finish_reason] if choice.finish_reason else []
                        if len(parts) == after and text:
                            port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
                            sim = next(s for s in sims if s.port == port)
                            async with http.post(f"{sim.url}/sim/faults", json={"cut_after_tokens": 1}) as resp:
                                assert resp.status == 200
                return "".join(parts), usage, finishes

            reference, ref_usage, ref_finishes = await answer()
            assert ref_finishes == ["length"] and ref_usage.prompt_tokens + ref_usage.completion_tokens == 32
            text, usage, finishes = await answer(after=ref_usage.completion_tokens - 2)
        assert finishes == ["length"] and reference.startswith(text) and text
        assert usage.prompt_tokens == ref_usage.prompt_tokens and usage.completion_tokens == len(text.split())
        assert await migrations(http, gw.url) == {"resumed": 0.0, "closed": 1.0, "failed": 0.0}


@pytest.mark.parametrize("kind", ["chat", "completions", "messages"])
async def test_a_stream_cut_after_its_last_token_ends_whole_without_running_again(
    kind: str, http: aiohttp.ClientSession
) -> None:
    """The engine dies right after the answer's last token (max_tokens reached), before its finish reason or the
    usage the client asked for: nothing is left to generate, so nothing runs again, and the client's stream ends as
    the engine would have ended it (finish reason `length` / stop reason `max_tokens`, the whole answer's usage)."""
    cut = SIM.model_copy(update={"faults": Faults(cut_after_tokens=5)})
    async with gateway_over_sims([cut, cut]) as (gw, sims):
        if kind == "messages":
            async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0) as api:
                async with api.messages.stream(model="sim", max_tokens=5, messages=MESSAGES[1:]) as stream:  # type: ignore[arg-type]
                    text = "".join([piece async for piece in stream.text_stream])
                    final = await stream.get_final_message()
            assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5 and len(text.split()) == 5
        else:
            async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
                usage, finishes, parts = None, [], []
                options: dict[str, Any] = {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
                if kind == "chat":
                    stream: Any = await client.chat.completions.create(model="sim", messages=MESSAGES, **options)  # type: ignore[arg-type]
                else:
                    stream = await client.completions.create(model="sim", prompt="Tell me about migration.", **options)
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        parts += [(choice.delta.content if kind == "chat" else choice.text) or ""]
                        finishes += [choice.finish_reason] if choice.finish_reason else []
            assert finishes == ["length"] and len("".join(parts).split()) == 5
            assert usage is not None and usage.completion_tokens == 5 and usage.prompt_tokens > 0
        assert sum(s.engine.stats.started for s in sims) == 1
        assert await migrations(http, gw.url) == {"resumed": 0.0, "closed": 1.0, "failed": 0.0}


def test_a_refusal_for_the_context_is_told_from_other_refusals() -> None:
    """vLLM's wordings (renderers/params.py and v1/engine/input_processor.py of the vLLM this project runs), the
    simulator's, and refusals that are not about the context."""
    full = [
        "This model's maximum context length is 2048 tokens. However, your prompt contains 2050 input tokens, which "
        "exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
        "The decoder prompt (length 2050) is longer than the maximum model length of 2048. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens.",
    ]
    assert all(context_full(400, message) for message in full)
    assert not context_full(400, "max_tokens must be at least 1") and not context_full(503, full[0])
    # older vLLM: the prompt with its max_tokens past the context, not the prompt alone: no end at `length`
    older = (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens ({} in the messages, "
        "{} in the completion)."
    )
    assert not context_full(400, older.format(1900, 200)) and context_full(400, older.format(2048, 52))


async def test_a_stream_cut_after_its_last_token_on_its_last_migration_ends_whole(http: aiohttp.ClientSession) -> None:
    """One migration allowed: the first engine dies after 2 of 5 tokens, the continuation's engine after the other
    3, before its finish reason. Nothing is left to generate, so the stream still ends whole (the bound on
    migrations bounds what runs again, not the gateway's own closing)."""
    sims = [SIM.model_copy(update={"faults": Faults(cut_after_tokens=n)}) for n in (2, 3)]
    async with gateway_over_sims(sims, retry={"max_migrations": 1}) as (gw, servers):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            options: dict[str, Any] = {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
            stream = await client.chat.completions.create(model="sim", messages=MESSAGES, **options)  # type: ignore[call-overload]
            chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"] and len(text.split()) == 5 and chunks[-1].usage.completion_tokens == 5
        assert sum(s.engine.stats.started for s in servers) == 2
        assert await migrations(http, gw.url) == {"resumed": 0.0, "closed": 1.0, "failed": 0.0}
