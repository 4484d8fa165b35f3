"""Every vLLM endpoint through the one request path, as a client sees it: the official openai client for embeddings,
plain HTTP for vLLM's own endpoints, with tenant auth, retries, metrics and the access log applying to all."""

from __future__ import annotations

import json
import logging

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_pool.launcher import free_port
from gateway.admission.auth import hash_key
from gateway.embedded import running_gateway
from simengine import Faults, SimConfig
from tests.conftest import gateway_config, gateway_over_sims, scrape

SIM = SimConfig(model="sim", instant=True)


async def requests_total(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    counted: dict[tuple[str, str], float] = {}
    for s in await scrape(http, url):
        if s.name == "kvgate_requests_total":  # summed over models and replicas
            key = (s.labels["endpoint"], s.labels["status"])
            counted[key] = counted.get(key, 0.0) + s.value
    return counted


async def test_embeddings_with_the_openai_client(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM, SIM]) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            raw = await client.embeddings.with_raw_response.create(model="sim", input=["hello", "kvgate"])
            result = raw.parse()
        assert [len(d.embedding) for d in result.data] == [8, 8] and result.usage.prompt_tokens > 0
        assert raw.headers["x-kvgate-replica"] and raw.headers["x-request-id"]
        assert (await requests_total(http, gw.url))[("embeddings", "200")] == 1


async def test_tokenize_and_detokenize_without_a_model_mean_the_only_one(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        async with http.post(gw.url + "/tokenize", json={"prompt": "hello world"}) as resp:
            assert resp.status == 200, await resp.text()
            tokens = (await resp.json())["tokens"]
        async with http.post(gw.url + "/detokenize", json={"model": "sim", "tokens": tokens}) as resp:
            assert resp.status == 200 and (await resp.json())["prompt"] == "hello world"
        async with http.post(gw.url + "/tokenize", json={"model": "nope", "prompt": "x"}) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"
        counted = await requests_total(http, gw.url)
        assert counted[("tokenize", "200")] == 1 and counted[("detokenize", "200")] == 1


async def test_stream_true_on_a_route_that_does_not_stream_gets_the_engines_answer(
    http: aiohttp.ClientSession,
) -> None:
    """`"stream": true` on embeddings or tokenizing is a field the engine ignores: its JSON answer is relayed whole,
    not taken for a stream cut short (a 502, retried on every replica and opening their breakers, so that three
    such requests took the pool out for everyone)."""
    async with gateway_over_sims([SIM, SIM]) as (gw, _):
        for _ in range(3):
            async with http.post(gw.url + "/tokenize", json={"model": "sim", "prompt": "hi", "stream": True}) as resp:
                assert resp.status == 200 and (await resp.json())["tokens"]
        body = {"model": "sim", "input": "hi", "stream": True}
        async with http.post(gw.url + "/v1/embeddings", json=body) as resp:
            assert resp.status == 200 and len((await resp.json())["data"][0]["embedding"]) == 8
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(gw.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
        errors = [s for s in await scrape(http, gw.url) if s.name == "kvgate_upstream_errors_total" and s.value]
        assert errors == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("/v1/embeddings", {"input": "hi"}),
    ],
)
async def test_a_request_without_a_model_means_the_pools_only_one(
    path: str, body: dict[str, object], http: aiohttp.ClientSession
) -> None:
    """vLLM's request models take no `model` as its served model: a client that names none (written for one vLLM)
    is served by a gateway of one model, and told to name one by a gateway of several (400)."""
    async with gateway_over_sims([SIM]) as (gw, _):
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
    other = SIM.model_copy(update={"model": "other"})
    async with gateway_over_sims([SIM, other]) as (gw, _):
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "model"
    # no engine reached yet: which model is meant is not known yet either (503, as for a model named then)
    async with running_gateway(gateway_config([f"http://127.0.0.1:{free_port()}"])) as gw:
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "engines_not_discovered"


async def test_an_endpoint_the_engine_lacks_answers_the_engines_error(http: aiohttp.ClientSession) -> None:
    """/v1/rerank on an engine that serves no reranker: the engine's own 404, OpenAI-shaped."""
    async with gateway_over_sims([SIM, SIM]) as (gw, _):
        async with http.post(gw.url + "/v1/rerank", json={"model": "sim", "query": "q", "documents": ["d"]}) as resp:
            assert resp.status == 404
            assert set((await resp.json())["error"]) >= {"message", "type", "code"}


async def test_other_endpoints_get_auth_retries_and_the_access_log(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    broken = SIM.model_copy(update={"faults": Faults(error_rate=1.0)})
    admission = {"auth": True, "tenants": {"acme": {"keys": [hash_key("sk-acme")]}}}
    async with gateway_over_sims([broken, SIM], admission=admission, server={"access_log": "plain"}) as (gw, _):
        body = {"model": "sim", "input": "hello"}
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            async with http.post(gw.url + "/v1/embeddings", json=body) as resp:
                assert resp.status == 401
            for _ in range(4):  # the broken replica answers 500 for all: retried on the good one
                async with http.post(
                    gw.url + "/v1/embeddings", json=body, headers={"Authorization": "Bearer sk-acme"}
                ) as resp:
                    assert resp.status == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
        assert len(lines) == 5 and all("endpoint=embeddings" in x for x in lines)
        assert " status=401 " in lines[0] and all("tenant=acme" in x and " status=200 " in x for x in lines[1:])


async def test_version_reports_the_engine_and_kvgate(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        async with http.get(gw.url + "/version") as resp:
            body = await resp.json()
        assert resp.status == 200 and body["version"] and body["kvgate"]


async def test_audio_forms_are_forwarded_intact(http: aiohttp.ClientSession) -> None:
    audio = bytes(range(256)) * 400  # 100 KiB of "audio", every byte value: binary, brackets included
    expected = f"{len(audio)} bytes, sum {sum(audio) % 65536}"
    async with gateway_over_sims([SIM, SIM], models={"aliases": {"whisper-1": "sim"}}) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            result = await client.audio.transcriptions.create(model="sim", file=("clip.wav", audio))
            assert result.text == expected
            # an alias resolved in the form too (the engine reads its model there), the audio untouched
            aliased = await client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", audio))
        assert aliased.text == expected
        for fields in ({"model": "sim"}, {}):  # without a model: the pool's only one, as vLLM takes it
            form = aiohttp.FormData({**fields})
            form.add_field("file", audio, filename="clip.wav")
            async with http.post(f"{gw.url}/v1/audio/translations", data=form) as resp:
                body = await resp.json()
                assert resp.status == 200, body
                assert body["text"] == expected  # every byte arrived as sent
        counted = await requests_total(http, gw.url)
        assert counted[("transcriptions", "200")] == 2 and counted[("translations", "200")] == 2


async def test_a_stored_response_is_retrieved_and_cancelled_on_the_replica_that_holds_it(
    http: aiohttp.ClientSession,
) -> None:
    """Three replicas, each keeping the responses it ran: retrieve and cancel go where the response is, every time
    (routed by load, two calls in three would reach a replica that answers 404)."""
    async with gateway_over_sims([SIM, SIM, SIM]) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            created = await client.responses.with_raw_response.create(model="sim", input="hello")
            response = created.parse()
            holder = created.headers["x-kvgate-replica"]
            for _ in range(6):
                raw = await client.responses.with_raw_response.retrieve(response.id)
                assert raw.parse().id == response.id and raw.headers["x-kvgate-replica"] == holder
                assert raw.headers["x-kvgate-route-reason"] == "holds-response"
            cancelled = await client.responses.cancel(response.id)
            assert cancelled.status == "cancelled"
        async with http.get(gw.url + "/v1/responses/resp-unknown") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "response_not_found"
        assert (await requests_total(http, gw.url))[("responses", "200")] == 8


async def test_reading_a_stored_response_charges_and_counts_nothing(http: aiohttp.ClientSession) -> None:
    """A client polls its (background) response: each read returns the usage it was charged when it ran; charged and
    counted again per poll, the tenant reached its token quota by polling, and the latency percentiles had a sample
    of every poll."""
    tenants = {"t": {"keys": [hash_key("sk-t")], "limits": {"tokens_per_minute": 100_000}}}
    overrides = {"admission": {"auth": True, "tenants": tenants}, "admin": {"key": "adm"}}
    async with gateway_over_sims([SIM], **overrides) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-t", max_retries=0) as client:
            created = await client.responses.create(model="sim", input="hello", max_output_tokens=4)
            assert created.usage is not None and created.usage.total_tokens > 0
            before = await metric_values(http, gw.url)
            windows: set[str] = set()
            while len(windows) != 1:  # two reads in one window of the quota (a minute's boundary between: again)
                remaining, windows = [], set()
                for _ in range(2):
                    read = await client.responses.with_raw_response.retrieve(created.id)
                    assert read.parse().usage == created.usage
                    remaining.append(read.headers["x-ratelimit-remaining-tokens"])
                    windows.add(read.headers["x-ratelimit-reset-tokens"])
            assert remaining[0] == remaining[1]
        after = await metric_values(http, gw.url)
    for name in ("kvgate_tokens_total", "kvgate_time_to_first_token_seconds_count"):
        assert after[name] == before[name], name


async def metric_values(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for sample in await scrape(http, url, {"Authorization": "Bearer adm"}):
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def test_a_streamed_response_is_reached_on_its_replica_while_it_runs_and_after_its_client_left(
    http: aiohttp.ClientSession,
) -> None:
    """A background response streams on while its client is gone (vLLM keeps it): from the stream's first event on,
    GET and cancel of its id go to the replica running it, also after the client left mid-stream."""
    slow = SIM.model_copy(update={"instant": False, "decode_ms": 20})
    async with gateway_over_sims([slow, slow, slow]) as (gw, _):
        body = {"model": "sim", "input": "stream me", "stream": True, "max_output_tokens": 200}
        async with http.post(gw.url + "/v1/responses", json=body) as resp:
            holder = resp.headers["x-kvgate-replica"]
            first = await resp.content.readuntil(b"\n\n")
            response_id = json.loads(first[first.index(b"{") :])["response"]["id"]
            for _ in range(3):  # while it runs
                async with http.get(f"{gw.url}/v1/responses/{response_id}") as got:
                    assert got.headers.get("x-kvgate-replica") == holder
        for _ in range(3):  # after its client left
            async with http.post(f"{gw.url}/v1/responses/{response_id}/cancel") as got:
                assert got.headers.get("x-kvgate-replica") == holder


def token_totals(text: str, model: str) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvgate_tokens_total" and s.labels["model"] == model
    }


async def test_responses_are_routed_by_their_prompt_streamed_and_continued_where_they_are_stored(
    http: aiohttp.ClientSession,
) -> None:
    """Responses share a long `instructions` prefix: cache-aware routing keeps them on the replica holding it (the
    chat view of the body), the engine reports it cached; a stream's usage (in its response.completed event) is
    counted; a response continuing another (`previous_response_id`) goes to the replica storing the first."""
    instructions = " ".join(f"Rule {i}: be brief about topic {i}." for i in range(60))
    cache = {"tokenizers": {"sim": "sim"}}
    async with gateway_over_sims([SIM, SIM, SIM], routing={"policy": "cache-aware"}, cache=cache) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            routed, cached = set(), []
            for i in range(5):
                raw = await client.responses.with_raw_response.create(
                    model="sim", instructions=instructions, input=[{"role": "user", "content": f"question {i}"}]
                )
                routed.add(raw.headers["x-kvgate-replica"])
                usage = raw.parse().usage
                assert usage is not None
                cached.append(usage.input_tokens_details.cached_tokens)
            assert len(routed) == 1 and min(cached[1:]) > 100  # the instructions' blocks, cached where they are
            (holder,) = routed
            async with http.get(gw.url + "/metrics") as resp:
                before = token_totals(await resp.text(), "sim")
            events = [e async for e in await client.responses.create(model="sim", input="stream me", stream=True)]
            assert events[0].type == "response.created" and events[-1].type == "response.completed"
            final = events[-1].response
            assert final.usage is not None and "".join(e.delta for e in events if e.type.endswith(".delta"))
            async with http.get(gw.url + "/metrics") as resp:
                after = token_totals(await resp.text(), "sim")
            assert after["prompt"] - before["prompt"] == final.usage.input_tokens
            assert after["completion"] - before["completion"] == final.usage.output_tokens
            first = await client.responses.with_raw_response.create(model="sim", instructions=instructions, input="a")
            first_holder, first_id = first.headers["x-kvgate-replica"], first.parse().id
            assert first_holder == holder
            for i in range(4):  # without the pin, two in three would reach a replica that does not store it
                raw = await client.responses.with_raw_response.create(
                    model="sim", input=f"and then {i}", previous_response_id=first_id
                )
                assert raw.headers["x-kvgate-replica"] == first_holder and raw.parse().status == "completed"


async def test_an_agents_tool_loop_on_the_responses_api_is_predicted_as_the_engine_caches_it(
    http: aiohttp.ClientSession,
) -> None:
    """A Codex-shaped turn (reasoning, a function and a namespaced call, their outputs, an answer) sent twice: the
    engine builds its chat messages as vLLM does and reports the first prompt's prefix cached the second time;
    kvgate's predicted cached tokens equal the engine's."""
    loop = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules. " * 200}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt " * 50},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One file."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ]  # fmt: skip
    cache = {"tokenizers": {"sim": "sim"}}
    async with gateway_over_sims([SIM, SIM], routing={"policy": "cache-aware"}, cache=cache) as (gw, _):
        cached = []
        for _ in range(2):
            body = {"model": "sim", "input": loop, "max_output_tokens": 4, "store": False}
            async with http.post(gw.url + "/v1/responses", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            cached.append(answer["usage"]["input_tokens_details"]["cached_tokens"])
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        async with http.post(gw.url + "/v1/responses", json={**body, "input": [{"type": "item_reference"}]}) as resp:
            assert resp.status == 400  # as vLLM: an item it cannot build a message of

    def total(name: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    assert cached[0] == 0 and cached[1] > 400  # the developer message and the loop's blocks, cached
    assert total("kvgate_prefix_predicted_cached_tokens_total") == total("kvgate_prefix_reported_cached_tokens_total")
    assert total("kvgate_prefix_reported_cached_tokens_total") == sum(cached)


async def test_generate_is_routed_by_the_token_ids_it_carries(http: aiohttp.ClientSession) -> None:
    """vLLM's token-in, token-out route: requests sharing a long token-id prefix stay on the replica holding it
    (hashed as a completions prompt of those ids), the engine reports it cached, usage is counted; a body whose
    `token_ids` are not ids is routed by load and gets the engine's 400."""
    prefix = list(range(1000, 1400))
    async with gateway_over_sims([SIM, SIM, SIM], routing={"policy": "cache-aware"}) as (gw, _):
        routed, cached = set(), []
        for i in range(4):
            body = {"token_ids": [*prefix, 7, i], "sampling_params": {"max_tokens": 4}, "request_id": f"rollout-{i}"}
            async with http.post(gw.url + "/inference/v1/generate", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
                routed.add(resp.headers["x-kvgate-replica"])
            assert answer["request_id"] == f"rollout-{i}" and len(answer["choices"][0]["token_ids"]) == 4
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert len(routed) == 1 and min(cached[1:]) >= 384  # the prefix's full blocks, cached where they are
        async with http.post(gw.url + "/inference/v1/generate", json={"token_ids": ["x"]}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "token_ids"
        async with http.get(gw.url + "/metrics") as resp:
            assert token_totals(await resp.text(), "sim")["prompt"] >= 4 * 402
        counted = await requests_total(http, gw.url)
        assert counted[("generate", "200")] == 4 and counted[("generate", "400")] == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions/render", {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}),
     ("/v1/messages/render", {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
     ("/v2/embed", {"model": "sim", "texts": ["hi"]}),
     ("/cohere/v2/chat", {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}),
     ("/generative_scoring", {"model": "sim", "query": "q", "items": ["a"]}),
     ("/v1/chat/completions/batch", {"model": "sim", "messages": [[{"role": "user", "content": "hi"}]]}),
     ("/invocations", {"messages": [{"role": "user", "content": "hi"}]})],
)  # fmt: skip
async def test_the_rest_of_vllms_serving_routes_reach_the_engine(
    path: str, body: dict[str, object], http: aiohttp.ClientSession
) -> None:
    """Routes the simulator does not serve: the request crossed kvgate (routed, counted under the route's name)
    and the engine's own 404 came back, in the route's API shape."""
    async with gateway_over_sims([SIM]) as (gw, _):
        async with http.post(gw.url + path, json=body) as resp:
            answer = await resp.json()
            assert resp.status == 404 and resp.headers["x-kvgate-replica"], answer
        assert ("error" in answer) and sum((await requests_total(http, gw.url)).values()) == 1


async def test_a_stored_responses_events_are_streamed_when_asked(http: aiohttp.ClientSession) -> None:
    """`GET /v1/responses/{id}?stream=true` (a background response's events, vLLM's resume) is relayed as the
    event stream it is, from the replica holding it, `starting_after` honoured by the engine."""
    async with gateway_over_sims([SIM, SIM]) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            created = await client.responses.with_raw_response.create(model="sim", input="hello")
            response, holder = created.parse(), created.headers["x-kvgate-replica"]
            events = [e async for e in await client.responses.retrieve(response.id, stream=True)]
            assert [e.type for e in events] == ["response.created", "response.output_text.delta", "response.completed"]
            assert events[-1].response.id == response.id
        async with http.get(f"{gw.url}/v1/responses/{response.id}?stream=true&starting_after=0") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["x-kvgate-replica"] == holder
            assert (await resp.read()).count(b"event: ") == 2


async def test_a_request_named_in_its_body_keeps_that_name_to_the_engine(http: aiohttp.ClientSession) -> None:
    """vLLM names a request by its X-Request-Id, else by the body's `request_id` (an RL framework's rollout id, which
    its abort then names): without the header kvgate sends the body's name on, not one of its own."""
    async with gateway_over_sims([SIM]) as (gw, sims):
        body = {"model": "sim", "prompt": "hi", "max_tokens": 2, "request_id": "rollout-7"}
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["x-request-id"] == "rollout-7"
        async with http.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "mine"}) as resp:
            assert resp.headers["x-request-id"] == "mine"  # the header wins, as in vLLM
        assert list(sims[0].engine.request_ids)[-2:] == ["rollout-7", "mine"]


async def test_an_abort_call_is_recorded_as_requests_are(http: aiohttp.ClientSession) -> None:
    """`/inference/v1/abort_requests` (sent to every engine) is in the metrics and the access log like any request:
    answered 200, refused 400."""
    async with gateway_over_sims([SIM]) as (gw, _):
        for body, status in (({"request_ids": ["generate-tokens-x"]}, 200), ({"ids": ["x"]}, 400)):
            async with http.post(gw.url + "/inference/v1/abort_requests", json=body) as resp:
                assert resp.status == status
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    for status in ("200", "400"):
        assert f'kvgate_requests_total{{endpoint="abort",model="-",replica="-",status="{status}"}} 1.0' in text
