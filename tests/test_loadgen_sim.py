"""The load generator against the real simulated vLLM engine (and, for request headers and error shapes only, a
small recording server): every workload and arrival mode, session ordering, the sweep's knee on an engine whose
knee is known by construction, the CLI modes and their files."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadgen import cli
from loadgen import workloads as wl
from loadgen.client import Message, RequestResult, RequestSpec, Target
from loadgen.runner import Arrival, SettingResult, Tenant, WorkloadFactory, run_setting
from loadgen.stats import summarize
from loadgen.text import CharTextMaker
from simengine import SimConfig, SimServer, run_sim_engine
from simengine.tokenize import tokenize_chat
from tests.conftest import wait_for

M = CharTextMaker()
FAST = SimConfig(block_size=16, overhead_ms=0.5, prefill_us_per_token=2.0, decode_ms=0.5, decode_ms_per_seq=0.0)

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with run_sim_engine(FAST) as server:
        yield server


async def _run(url: str, factory: WorkloadFactory, arrival: Arrival, **kw: Any) -> SettingResult:
    async with aiohttp.ClientSession() as http:
        return await run_setting(http, Target(url, "sim-model"), factory, arrival, **kw)


def _chat_tokens(messages: list[Message] | tuple[Message, ...]) -> int:
    return len(tokenize_chat([{"role": r, "content": c} for r, c in messages]))


async def test_shared_prefix_closed_loop(sim: SimServer) -> None:
    specs = list(wl.shared_prefix(M, seed=1, groups=2, prompts_per_group=4, system_tokens=64, question_tokens=8,
                                  output_tokens=5))  # fmt: skip
    res = await _run(sim.url, lambda s: wl.shared_prefix(M, seed=s, groups=2, prompts_per_group=4, system_tokens=64,
                                                          question_tokens=8, output_tokens=5),
                     Arrival("closed", concurrency=3), seed=1)  # fmt: skip
    assert len(res.results) == 8 and all(r.ok for r in res.results)
    by_sid = {s.session_id: s for s in specs}
    for r in res.results:
        assert r.completion_tokens == 5 and r.usage_present and r.finish_reason == "length"
        assert r.prompt_tokens == _chat_tokens(by_sid[r.session_id].messages)  # exact usage, 4 bytes a token
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)
    assert sum(r.cached_tokens for r in res.results) > 0  # later prompts of a group hit its system prompt
    s = summarize(res.results, res.wall_s)
    assert s.completion_tokens == 40 and s.output_tok_per_s == pytest.approx(40 / res.wall_s)
    assert sim.engine.stats.completed == 8


async def test_inter_token_latency_is_every_gap_between_streamed_tokens() -> None:
    slow = FAST.model_copy(update={"decode_ms": 20.0})  # each token after the first comes 20 ms after the last
    async with run_sim_engine(slow) as server:
        res = await _run(server.url, lambda s: wl.random_requests(M, seed=s, num_requests=3, input_tokens=(16, 32),
                                                                   output_tokens=(6, 6)),
                         Arrival("closed", concurrency=1))  # fmt: skip
    assert [len(r.itl_s) for r in res.results] == [5, 5, 5]
    for r in res.results:
        assert r.ttft_s is not None and sum(r.itl_s) == pytest.approx(r.e2e_s - r.ttft_s, abs=0.01)
    s = summarize(res.results, res.wall_s)
    assert s.itl_s["p50"] is not None and 0.019 <= s.itl_s["p50"] < 0.2  # the engine's own gap, and its spread


async def test_multi_round_waits_for_answers_and_grows_history(sim: SimServer) -> None:
    def factory(seed: int) -> Any:
        return wl.multi_round_chat(M, seed=seed, users=3, rounds=3, system_tokens=32, question_tokens=8,
                                   answer_tokens=6, think_s=0.01)  # fmt: skip

    specs = list(factory(2))
    res = await _run(sim.url, factory, Arrival("closed", concurrency=2), seed=2)
    assert len(res.results) == 9 and all(r.ok for r in res.results)
    for user in range(3):
        turns = sorted((r for r in res.results if r.session_id == f"chat{user}"), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        history: list[Message] = []
        for k, r in enumerate(turns):
            spec = next(s for s in specs if s.session_id == r.session_id and s.turn == k)
            history.extend(spec.messages)
            assert r.prompt_tokens == _chat_tokens(history)  # the previous answers were sent back
            history.append(("assistant", r.text))
            if k:
                prev = turns[k - 1]
                assert r.start_s >= prev.start_s + prev.e2e_s  # turn k+1 only after turn k's answer
                assert r.cached_tokens > 0  # the history is a cached prefix


async def test_agent_sessions_and_random(sim: SimServer) -> None:
    res = await _run(sim.url, lambda s: wl.agent_sessions(M, seed=s, sessions=2, turns=4, system_tokens=64,
                                                           tool_result_tokens=16, output_tokens=4),
                     Arrival("closed", concurrency=4))  # fmt: skip
    assert len(res.results) == 8 and all(r.ok for r in res.results)
    last = max((r for r in res.results if r.session_id.endswith("-0")), key=lambda r: r.turn)
    first = min((r for r in res.results if r.session_id.endswith("-0")), key=lambda r: r.turn)
    assert last.prompt_tokens > first.prompt_tokens + 3 * 16  # grew by the tool results and answers
    res = await _run(sim.url, lambda s: wl.random_requests(M, seed=s, num_requests=12, input_tokens=(8, 40),
                                                            output_tokens=(2, 6)),
                     Arrival("closed", concurrency=4), max_requests=10)  # fmt: skip
    assert len(res.results) == 10 and all(r.ok and 2 <= r.completion_tokens <= 6 for r in res.results)
    assert sum(r.cached_tokens for r in res.results) == 0  # no reuse


async def test_open_loop_poisson_and_trace_arrivals(sim: SimServer) -> None:
    res = await _run(sim.url, lambda s: wl.random_requests(M, seed=s, num_requests=10, input_tokens=(8, 16),
                                                            output_tokens=(2, 2)),
                     Arrival("poisson", rate=200.0), seed=3)  # fmt: skip
    assert len(res.results) == 10 and all(r.ok for r in res.results)
    starts = sorted(r.start_s for r in res.results)
    assert starts[-1] > 0  # arrivals are spread out, not all at t=0
    recs = wl.parse_mooncake_trace(
        json.dumps({"timestamp": t, "input_length": 40, "output_length": 3, "hash_ids": [0, i]})
        for i, t in enumerate((0, 30, 60, 90))
    )
    res = await _run(sim.url, lambda s: wl.trace_replay(M, recs, seed=s, block_tokens=16),
                     Arrival("trace"))  # fmt: skip
    assert len(res.results) == 4 and all(r.ok for r in res.results)
    for r in res.results:
        offset = int(r.session_id.removeprefix("trace")) * 0.030
        assert r.start_s >= offset  # not sent before its timestamp
    assert sum(r.cached_tokens for r in res.results) > 0  # hash id 0 is a shared 16-token block


async def test_a_flash_crowd_arrives_in_its_bursts_and_its_users_send_their_user_field(sim: SimServer) -> None:
    """The flash crowd's requests arrive within their bursts' windows (replayed at their own times), the same seed
    gives the same arrivals; shared_prefix's end users send OpenAI's `user`, one of `users` each."""
    factory = lambda s: wl.flash_crowd(  # noqa: E731
        M, seed=s, prompts=2, bursts=2, per_burst=6, burst_s=0.1, gap_s=0.5, system_tokens=32, question_tokens=4,
        output_tokens=2,
    )  # fmt: skip
    assert [x.arrival_s for x in factory(4)] == [x.arrival_s for x in factory(4)] != [x.arrival_s for x in factory(5)]
    res = await _run(sim.url, factory, Arrival("trace"), seed=4)
    assert len(res.results) == 12 and all(r.ok for r in res.results)
    arrival = {x.session_id: x.arrival_s for x in factory(4)}
    for r in res.results:
        burst = int(r.session_id.removeprefix("fc")) // 6
        assert 0.5 * burst <= arrival[r.session_id] < 0.5 * burst + 0.1  # within its burst
        assert r.start_s >= arrival[r.session_id]  # sent at its time, not before
    assert sum(r.cached_tokens for r in res.results) > 0  # a burst shares two system prompts
    specs = list(wl.shared_prefix(M, seed=1, groups=3, prompts_per_group=4, system_tokens=8, users=5))
    assert all(x.send_user for x in specs) and {x.user_id for x in specs} == {f"u{i}" for i in range(5)}
    assert not any(x.send_user for x in wl.shared_prefix(M, seed=1, groups=3, prompts_per_group=4, system_tokens=8))


def test_sub_agents_are_conversations_of_their_own_under_their_parents_session_header() -> None:
    specs = list(wl.agent_sessions(M, seed=2, sessions=2, turns=3, system_tokens=32, subagents=2))
    assert len(specs) == 2 * 3 * 3
    convs = {x.session_id for x in specs}
    assert convs == {f"agent-2-{s}{sub}" for s in range(2) for sub in ("", "-sub0", "-sub1")}
    for x in specs:  # every conversation of a session sends the parent's header
        assert dict(x.headers)[wl.SESSION_HEADER] == x.session_id.split("-sub")[0]
    firsts = [x for x in specs if x.turn == 0]
    subs = {x.messages[0][1] for x in firsts if "-sub" in x.session_id}
    assert len(subs) == 1 and subs != {firsts[0].messages[0][1]}  # one sub-agent system prompt, not the parent's
    assert len(subs.pop()) < len(firsts[0].messages[0][1])  # half its tokens


async def test_a_next_turn_found_by_the_new_session_scan_is_sent(sim: SimServer) -> None:
    """One user, two rounds, one request at a time: turn 2 is only read from the workload (by the scan for new
    sessions) after turn 1 finished, when nothing is in flight any more. The runner once waited for a wake-up that
    could not come; it must send the turn. (The wait_for bound only keeps a regression from hanging the suite.)"""
    factory = lambda s: wl.multi_round_chat(  # noqa: E731
        M, seed=s, users=1, rounds=3, system_tokens=8, question_tokens=4, answer_tokens=2
    )
    res = await asyncio.wait_for(_run(sim.url, factory, Arrival("closed", concurrency=1)), 60)
    assert sorted(r.turn for r in res.results) == [0, 1, 2] and all(r.ok for r in res.results)


async def test_workload_is_built_before_the_clock_starts(sim: SimServer) -> None:
    """A generator that builds its whole workload on the first `next` must not do it after the Poisson clock started:
    that would bunch the first arrivals into a burst (it once made the routing benchmark's p99 an artefact)."""
    built_at: list[float] = []

    def factory(seed: int) -> Iterator[RequestSpec]:
        specs = list(wl.random_requests(M, seed=seed, num_requests=4, input_tokens=(8, 8), output_tokens=(2, 2)))
        built_at.append(time.time())  # runs on the first next(), like shared_prefix's shuffle
        yield from specs

    res = await _run(sim.url, factory, Arrival("poisson", rate=100.0), seed=1)
    assert len(res.results) == 4 and all(r.ok for r in res.results)
    assert len(built_at) == 1 and built_at[0] <= res.started_at


async def test_duration_repeats_the_workload() -> None:
    async with run_sim_engine(SimConfig(instant=True)) as server:
        res = await _run(server.url, lambda s: wl.shared_prefix(M, seed=s, groups=1, prompts_per_group=2,
                                                                 system_tokens=8, question_tokens=2, output_tokens=2),
                         Arrival("closed", concurrency=2), duration_s=0.3)  # fmt: skip
    assert len(res.results) > 2 and all(r.ok for r in res.results)
    assert any(r.session_id.startswith("e1-") for r in res.results)
    assert res.wall_s >= 0.3


# --- request shape, headers and errors: a recording server ------------------------------------------------------


def _recording_app(seen: list[tuple[dict[str, str], dict[str, Any]]]) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((dict(request.headers), body))
        mode = body["messages"][-1]["content"]
        if mode == "fail":
            err = {"error": {"message": "nope", "type": "BadRequestError", "param": None, "code": 400}}
            return web.json_response(err, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kvgate-replica": "r1"})
        await resp.prepare(request)
        for word in ("a", "b"):
            await resp.write(f'data: {{"choices":[{{"index":0,"delta":{{"content":"{word}"}}}}]}}\n\n'.encode())
        if mode == "cut":
            return resp
        usage = {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _spec(i: int, text: str) -> RequestSpec:
    return RequestSpec(f"s{i}", f"u{i}", 0, (("user", text),), 2, headers=((wl.SESSION_HEADER, f"s{i}"),))


async def test_request_shape_tenants_and_errors() -> None:
    seen: list[tuple[dict[str, str], dict[str, Any]]] = []
    texts = ["ok"] * 40 + ["fail", "cut"]
    async with TestServer(_recording_app(seen)) as server:
        url = str(server.make_url("")).rstrip("/")
        res = await _run(url, lambda s: iter([_spec(i, t) for i, t in enumerate(texts)]),
                         Arrival("closed", concurrency=4), seed=5,
                         tenants=[Tenant("key-a", 3.0), Tenant("key-b", 1.0)])  # fmt: skip
    _, body = seen[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 2 and body["model"] == "sim-model"
    assert {h[wl.SESSION_HEADER] for h, _ in seen} == {f"s{i}" for i in range(len(texts))}
    keys = [h["Authorization"] for h, _ in seen]
    assert set(keys) == {"Bearer key-a", "Bearer key-b"} and keys.count("Bearer key-a") > keys.count("Bearer key-b")
    by_sid = {r.session_id: r for r in res.results}
    ok = by_sid["s0"]
    assert ok.ok and ok.replica == "r1" and (ok.prompt_tokens, ok.cached_tokens, ok.completion_tokens) == (7, 4, 2)
    assert ok.text == "ab" and ok.tenant in ("key-a", "key-b")
    fail = by_sid["s40"]
    assert not fail.ok and fail.status == 400 and fail.error_type == "http_400:BadRequestError"
    cut = by_sid["s41"]
    assert not cut.ok and cut.error_type == "incomplete_stream" and cut.completion_tokens == 2
    s = summarize(res.results, res.wall_s)
    assert s.errors == {"http_400:BadRequestError": 1, "incomplete_stream": 1}


async def test_connection_error_is_classified() -> None:
    async with run_sim_engine(SimConfig(instant=True)) as server:
        url = server.url
    res = await _run(url, lambda s: iter([_spec(0, "x")]), Arrival("closed", concurrency=1))
    assert [r.error_type for r in res.results] == ["connection"]


# --- CLI modes ----------------------------------------------------------------------------------------------------


async def test_sweep_finds_known_knee_and_writes_gate(tmp_path: Path) -> None:
    # 4 sequence slots, costly prefill and decode: up to 4 requests run at once; from 8 on half of them queue for a
    # whole request time, so TTFT p50 jumps while throughput stays at the 4-slot ceiling.
    # Sleeps dominate the CPU work (30 ms per token), so the shape holds on a busy machine; 24 requests take six
    # waves of 4 at both concurrency 4 and 8, so their throughputs match (and one stall of a busy machine moves
    # their ratio by a few percent, short of the knee rule's 10%).
    cfg = SimConfig(max_num_seqs=4, block_size=16, overhead_ms=1.0, prefill_us_per_token=25.0, decode_ms=30.0,
                    decode_ms_per_seq=0.0)  # fmt: skip
    config = tmp_path / "kvgate.yaml"
    config.write_text("# my gateway\nserver:\n  port: 9000  # keep\nadmission:\n  replica_max_concurrency: 100\n")
    out = tmp_path / "sweep"
    async with run_sim_engine(cfg) as server:
        argv = ["sweep", "--url", server.url, "--workload", "random", "--input-len", "400:400",
                "--random-output-len", "16:16", "-n", "24", "--concurrencies", "1,2,4,8",
                "--metrics-url", f"{server.url}/metrics", "--out", str(out), "--write-gate", str(config),
                "--label", "sim"]  # fmt: skip
        rc = await asyncio.to_thread(cli.main, argv)
    assert rc == 0
    doc = json.loads((out / "result.json").read_text())
    assert doc["knee"]["load"] == 4 and doc["knee"]["found"] and doc["knee"]["saturated_at"] == 8
    assert doc["recommendation"]["replica_max_concurrency"] == 4
    assert [p["verdict"] for p in doc["points"]][2:] in (["sweet spot", "queueing"], ["sweet spot", "batch only"])
    assert yaml.safe_load(config.read_text()) == {"server": {"port": 9000}, "admission": {"replica_max_concurrency": 4}}
    assert "# keep" in config.read_text()
    for p in doc["points"]:
        s = p["summary"]
        assert s["requests"] == 24 and s["success_rate"] == 1.0 and s["completion_tokens"] == 24 * 16
        assert s["completion_tokens"] == sum(r["completion_tokens"] for r in p["requests"])
        assert s["output_tok_per_s"] == pytest.approx(s["completion_tokens"] / s["wall_s"])
        assert s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"]
        assert p["prefix_cache"]["queries"] == s["prompt_tokens"]  # the engine counted what usage reported
    assert (out / "report.html").exists()
    if HAVE_MATPLOTLIB:  # the report extra: charts too
        assert (out / "throughput_ttft.png").stat().st_size > 1000 and (out / "latency_cdf.png").exists()
        assert "data:image/png;base64," in (out / "report.html").read_text()


async def test_run_and_compare_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with run_sim_engine(FAST) as server:
        for label in ("a", "b"):
            argv = ["run", "--url", server.url, "--workload", "multi-round", "--users", "2", "--rounds", "2",
                    "--system-len", "32", "--question-len", "8", "--output-len", "4", "-c", "2",
                    "--tenant", "k1:1", "--tenant", "k2:1", "--out", str(tmp_path / label), "--label", label,
                    "--no-charts"]  # fmt: skip
            assert await asyncio.to_thread(cli.main, argv) == 0
    doc = json.loads((tmp_path / "a" / "result.json").read_text())
    point = doc["points"][0]
    assert point["summary"]["requests"] == 4 and point["summary"]["success_rate"] == 1.0
    assert set(point["tenants"]) <= {"k1", "k2"} and "api_key" not in doc["config"]
    capsys.readouterr()
    files = [str(tmp_path / x / "result.json") for x in ("a", "b")]
    assert cli.main(["compare", *files, "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "a tok/s" in printed and "b TTFT" in printed
    html = (tmp_path / "cmp" / "compare.html").read_text()
    assert html.count("data:image/png;base64,") == (2 if HAVE_MATPLOTLIB else 0)
    assert cli.main(["compare", str(tmp_path / "missing.json")]) == 2


async def test_quality_mode_on_sim(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with run_sim_engine(FAST) as server:
        argv = ["quality", "--url", server.url, "--long-input", "600", "--long-output", "64", "--identical", "3",
                "--out", str(tmp_path)]  # fmt: skip
        rc = await asyncio.to_thread(cli.main, argv)
    doc = json.loads((tmp_path / "result.json").read_text())
    checks = {c["name"]: c for c in doc["quality"]}
    assert set(checks) == {"long_context", "long_generation", "no_repetition_loop", "deterministic"}
    assert checks["long_context"]["passed"] and checks["long_generation"]["passed"]
    assert checks["deterministic"]["passed"] and checks["deterministic"]["figures"]["distinct"] == 1
    assert rc == (0 if all(c["passed"] for c in checks.values()) else 1)
    assert "PASS  long_context" in capsys.readouterr().out


def test_cli_usage_errors(tmp_path: Path) -> None:
    assert cli.main([]) == 2
    assert cli.main(["sweep", "--url", "http://127.0.0.1:9", "--concurrencies", "0,2"]) == 2
    bad = tmp_path / "t.jsonl"
    bad.write_text("{oops\n")
    argv = ["run", "--url", "http://127.0.0.1:9", "--model", "m", "--workload", "trace", "--trace", str(bad)]
    assert cli.main(argv) == 2
    assert cli.main(["run", "--url", "http://127.0.0.1:9", "--model", "m", "--workload", "trace"]) == 2


def test_result_rows_are_json_safe() -> None:
    r = RequestResult("s", "u", 0, text="secret answer")
    row = r.to_json()
    assert "text" not in row and row["output_chars"] == len("secret answer")


async def test_completions_endpoint(sim: SimServer) -> None:
    async with aiohttp.ClientSession() as http:
        target = Target(sim.url, "sim-model", endpoint="completions")
        res = await run_setting(http, target, lambda s: wl.random_requests(M, seed=s, num_requests=3,
                                                                            input_tokens=(8, 8), output_tokens=(3, 3)),
                                Arrival("closed", concurrency=3))  # fmt: skip
    assert all(r.ok and r.completion_tokens == 3 and r.text for r in res.results)


async def test_an_interrupted_sweep_keeps_the_settings_that_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during the second of three settings (the sweep's task cancelled, as asyncio.run does on SIGINT): the
    first setting is written, marked interrupted, with no knee or gate; the cancellation still ends the command."""
    out = tmp_path / "sweep"
    slow = FAST.model_copy(update={"decode_ms": 20.0})  # 16 tokens: about 0.3 s a request
    async with run_sim_engine(slow) as server:
        argv = ["sweep", "--url", server.url, "--workload", "random", "--input-len", "32:32", "--random-output-len",
                "16:16", "-n", "4", "--concurrencies", "1,2,4", "--out", str(out), "--no-charts"]  # fmt: skip
        task = asyncio.create_task(cli.amain(argv))
        # the first setting's 4 requests, then one of the second's: the first is in the document by then
        await wait_for(lambda: server.engine.stats.completed >= 5 or task.done(), 60.0, "a request of the second")
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    doc = json.loads((out / "result.json").read_text())
    assert [p["load"] for p in doc["points"]] == [1]
    assert doc["interrupted"] == "after 1 of 3 settings: no knee, gate or plan"
    assert doc["knee"] is None and doc["recommendation"] is None
    assert "kvgate loadgen: interrupted after 1 of 3 settings" in capsys.readouterr().err


async def test_rate_sweep_open_loop(tmp_path: Path) -> None:
    async with run_sim_engine(SimConfig(instant=True)) as server:
        argv = ["sweep", "--url", server.url, "--model", "sim-model", "--workload", "shared-prefix", "--groups", "2",
                "--prompts-per-group", "3", "--system-len", "32", "--question-len", "4", "--output-len", "2",
                "--rates", "50,100", "--replicas", "2", "--out", str(tmp_path), "--no-charts"]  # fmt: skip
        assert await asyncio.to_thread(cli.main, argv) == 0
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["arrival"] == "poisson" and [p["rate"] for p in doc["points"]] == [50.0, 100.0]
    assert all(p["summary"]["requests"] == 6 and p["concurrency"] is None for p in doc["points"])
    assert doc["recommendation"]["replicas"] == 2 and doc["recommendation"]["replica_max_concurrency"] >= 1
    assert not (tmp_path / "throughput_ttft.png").exists() and (tmp_path / "report.html").exists()
