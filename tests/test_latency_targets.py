"""Admission by predicted latency: the model and the verdict on literal values (`policies.latency`), the online
learner on literal sample sequences, clean, noisy and stale (`engine_pool.latency`), and the gateway in front of
simulated engines whose KV capacity caps the batch: past the knee a request is refused at once with Retry-After
instead of queued, and a looser target asked by header is honoured."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import engine_pool.replica
from engine_pool.http_client import UpstreamClient
from engine_pool.latency import MIN_SAMPLES, WINDOW, LatencyLearner
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Identity
from gateway.admission.config import AdmissionConfig
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.targets import LatencyGate, place
from gateway.config_load import ConfigError, load_config
from gateway.context import RequestContext
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from policies.latency import Held, Prediction, ReplicaLatency, Targets, judge, predict, room_wait
from policies.least_load import LeastLoad
from simengine import SimConfig
from tests.conftest import gateway_over_sims, wait_for

NOW = 100.0


def replica(held: tuple[Held, ...] = (), kv: int | None = 1000, **terms: float) -> ReplicaLatency:
    t = {"overhead_s": 0.01, "prefill_s_per_token": 0.001, "step_s": 0.02, "step_per_seq_s": 0.005, **terms}
    return ReplicaLatency(
        "r",
        kv,
        held,
        t["overhead_s"],
        t["prefill_s_per_token"],
        t["step_s"],
        t["step_per_seq_s"],
        t.get("margin_s", 0.0),
    )


# --- the model ------------------------------------------------------------------------------------------------------
def test_a_request_that_fits_waits_for_nothing() -> None:
    assert room_wait(1000, (Held(300, 105.0), Held(300, 103.0)), 400, NOW) == 0.0
    assert room_wait(None, (Held(10**9, 1e9),), 400, NOW) == 0.0  # capacity unknown: never a wait


def test_a_request_that_does_not_fit_waits_for_the_earliest_ends_that_make_room() -> None:
    held = (Held(400, 109.0), Held(400, 102.0), Held(200, 104.0))
    assert room_wait(1000, held, 300, NOW) == pytest.approx(2.0)  # 1,300 > 1,000: the one ending at 102 frees 400
    assert room_wait(1000, held, 500, NOW) == pytest.approx(4.0)  # needs 500: 400 free at 102, 600 at 104
    assert room_wait(1000, held, 700, NOW) == pytest.approx(9.0)  # needs 700: only at 109


def test_a_cached_run_is_pinned_once_by_the_requests_that_share_it() -> None:
    """A burst on one system prompt (1,536 tokens cached) pins it once: a third request fits in 2,048 tokens. Each
    used to count either its prompt whole (1,636: full after one) or nothing of it."""
    shared = (Held(100, 105.0, prefix=7, cached=1536), Held(100, 103.0, prefix=7, cached=1536))
    assert room_wait(2048, shared, 100, NOW, prefix=7, cached=1536) == 0.0
    # agents resuming private histories each pin their own: a third history does not fit beside two
    private = (Held(200, 105.0, prefix=1, cached=8000), Held(200, 103.0, prefix=2, cached=8000))
    assert room_wait(19200, private, 200, NOW, prefix=3, cached=8000) == pytest.approx(3.0)  # the first to end frees
    assert room_wait(19200, private, 200, NOW) == 0.0  # the same request with nothing cached pins nothing


def test_a_pinned_run_is_freed_with_the_last_request_that_holds_it() -> None:
    held = (Held(100, 101.0, prefix=7, cached=1000), Held(100, 105.0, prefix=7, cached=1000))
    assert room_wait(1300, held, 500, NOW) == pytest.approx(5.0)  # at 101 only 100 is freed: the run stays pinned


def test_a_request_past_its_predicted_end_is_expected_to_need_as_long_again() -> None:
    """A model that knew nothing predicted every request of a first burst to end at once: they are still held, so
    the KV is still full (NOW is 100)."""
    overdue = (Held(500, 98.0), Held(500, 99.5))  # 2 s and 0.5 s past their predicted ends
    assert room_wait(1000, overdue, 400, NOW) == pytest.approx(0.5)  # the less overdue frees room first
    assert room_wait(1000, (Held(500, 98.0), Held(500, 101.0)), 400, NOW) == pytest.approx(1.0)


def test_prediction_is_wait_plus_prefill_and_the_decode_step_of_the_batch() -> None:
    p = predict(replica((Held(900, 103.0),)), NOW, 500, uncached=200)
    assert p.wait_s == pytest.approx(3.0) and p.ttft_s == pytest.approx(3.0 + 0.01 + 0.2)
    assert p.batch == 2 and p.tpot_s == pytest.approx(0.02 + 0.005 * 2)


def _p(name: str, wait: float, ttft: float, tpot: float = 0.03, batch: int = 2) -> Prediction:
    return Prediction(name, wait, ttft, tpot, batch)


def test_verdict_admits_where_the_targets_are_met_best_first() -> None:
    v = judge([_p("a", 1.0, 1.5), _p("b", 0.0, 0.4), _p("c", 3.0, 3.2)], Targets(ttft_s=2.0))
    assert v.admit and v.reason == "within-target" and v.best is not None and v.best.replica == "b"
    assert v.prefer == ("b",)  # the one with KV room: routing looks there first


def test_while_every_replica_has_room_routing_is_left_to_the_policy() -> None:
    v = judge([_p("a", 0.0, 0.5), _p("b", 0.0, 0.4)], Targets(ttft_s=2.0))
    assert v.admit and v.prefer == ()
    v = judge([_p("a", 0.5, 0.9), _p("b", 1.5, 1.9), _p("c", 3.0, 3.2)], Targets(ttft_s=2.0))
    assert v.prefer == ("a",)  # all must wait: the one predicted first (elsewhere it waits longer)


def test_a_replica_that_must_wait_but_answers_first_stays_in_the_preference() -> None:
    """Its cached prefix makes up for the wait: a document's replica must wait 0.1 s for KV room, another has room
    and must compute the document (0.5 s). Routing was sent to the other only, copied the document there, and a pool
    whose cache fits its documents only partitioned thrashed (77-79% hits where 91-92% were reached)."""
    v = judge([_p("holder", 0.1, 0.15), _p("other", 0.0, 0.5), _p("slow", 1.0, 1.6)], Targets(ttft_s=2.0))
    assert v.admit and v.prefer == ("holder", "other")


def test_verdict_refuses_with_the_drain_when_every_replica_would_make_it_wait_too_long() -> None:
    v = judge([_p("a", 4.0, 4.2), _p("b", 2.5, 2.9)], Targets(ttft_s=2.0))
    assert not v.admit and v.reason == "ttft-target" and v.retry_after_s == pytest.approx(2.5)


def test_a_prompt_longer_than_its_target_is_served_where_it_need_not_wait() -> None:
    v = judge([_p("a", 0.0, 5.0), _p("b", 1.0, 6.0)], Targets(ttft_s=2.0))
    assert v.admit and v.reason == "no-wait" and v.prefer == ("a",)


def test_time_per_token_target_but_an_idle_replica_is_never_too_slow() -> None:
    slow = [_p("a", 0.0, 0.1, tpot=0.2, batch=5), _p("b", 0.0, 0.1, tpot=0.15, batch=3)]
    assert judge(slow, Targets(ttft_s=2.0, tpot_s=0.1)).reason == "tpot-target"
    idle = [*slow, _p("c", 0.0, 0.1, tpot=0.12, batch=1)]
    v = judge(idle, Targets(ttft_s=2.0, tpot_s=0.1))
    assert v.admit and v.prefer == ("c",)
    assert judge([], Targets(ttft_s=1.0)).reason == "no-replica"
    # a decode speed that is still the engine's prior (its lifetime mean inter-token latency, first slow tokens
    # included), not learned from answers, is a guess: never a refusal
    guessed = Prediction("a", 0.0, 0.1, 0.2, 5, decode_learned=False)
    assert judge([guessed], Targets(ttft_s=2.0, tpot_s=0.1)).admit


def test_a_request_may_ask_only_for_looser_targets() -> None:
    t = Targets(ttft_s=2.0, tpot_s=0.1)
    assert t.looser(5.0, 0.05) == Targets(5.0, 0.1)
    assert t.looser(1.0, None) == t
    assert Targets().looser(3.0, None) == Targets(3.0, None)


# --- the learner on literal sequences -------------------------------------------------------------------------------
def test_clean_samples_give_the_engines_line() -> None:
    learner = LatencyLearner()
    for tokens in (100, 300, 500, 700, 900, 1100):
        learner.observe_first_token(tokens, 0.05 + 0.002 * tokens)
    for batch in (1, 2, 4, 8, 6, 3):
        learner.observe_decode(batch, 0.02 + 0.004 * batch, 100)
    overhead, prefill, step, per_seq = learner.terms(None, None)
    assert overhead == pytest.approx(0.05) and prefill == pytest.approx(0.002)
    assert step == pytest.approx(0.02) and per_seq == pytest.approx(0.004)


def test_a_quarter_of_wild_samples_moves_the_line_little() -> None:
    rng = random.Random(7)
    learner = LatencyLearner()
    for i in range(WINDOW):
        tokens = rng.randint(50, 2000)
        ttft = 0.05 + 0.002 * tokens + rng.gauss(0, 0.01)
        if i % 4 == 0:  # a pause, a preemption, a stale reading: ten times too slow or almost nothing
            ttft = ttft * 10 if i % 8 == 0 else 0.001
        learner.observe_first_token(tokens, ttft)
    _, prefill, _, _ = learner.terms(None, None)
    assert prefill == pytest.approx(0.002, rel=0.15)


def test_an_engine_that_changed_is_relearned_within_the_window() -> None:
    learner = LatencyLearner()
    for tokens in range(100, 100 + 50 * WINDOW, 50):
        learner.observe_first_token(tokens, 0.002 * tokens)
    for tokens in range(100, 100 + 50 * WINDOW, 50):  # the engine is now three times slower
        learner.observe_first_token(tokens, 0.006 * tokens)
    assert learner.terms(None, None)[1] == pytest.approx(0.006)


def test_until_enough_samples_the_engines_own_counters_are_the_prior() -> None:
    learner = LatencyLearner()
    assert learner.terms(0.003, 0.01) == (0.0, 0.003, 0.0, 0.01)
    # the engine's mean inter-token latency since it started is the decode step until answers teach one
    assert learner.terms(0.003, 0.01, 0.004) == (0.0, 0.003, 0.004, 0.01)
    assert learner.terms(None, None) == (0.0, 0.0, 0.0, 0.0)  # knowing nothing: no cost, never a refusal on a guess
    for tokens in range(MIN_SAMPLES - 1):
        learner.observe_first_token(100 * (tokens + 1), 0.1)
    assert learner.terms(0.003, None)[1] == 0.003


def test_the_margin_is_how_late_first_tokens_came_at_a_high_quantile() -> None:
    learner = LatencyLearner()
    assert learner.margin() == 0.0
    for late in (0.05, -0.2, 0.3, 0.1, 0.0, 0.02, 0.4, -0.1, 0.08, 0.12):  # seconds later than predicted
        learner.observe_late(1.0 + late, 1.0)
    assert learner.margin() == pytest.approx(0.4)  # the 90th percentile of ten samples: the tenth
    early = LatencyLearner()
    for _ in range(10):
        early.observe_late(0.5, 1.0)
    assert early.margin() == 0.0  # predictions that were too pessimistic never lower a prediction
    view = replica(margin_s=0.25)
    assert predict(view, NOW, 100, uncached=100).ttft_s == pytest.approx(0.01 + 0.1 + 0.25)


def test_short_answers_teach_no_decode_speed() -> None:
    """A whole answer of 4 tokens that took 0.6 s is mostly its HTTP and scheduling time, not a 150 ms decode step:
    it must not make the model refuse on a time-per-token target."""
    learner = LatencyLearner()
    for batch in (1, 2, 3, 4, 2, 3):
        learner.observe_decode(batch, 0.15, 4)
    assert not learner.decode_learned and learner.terms(None, None)[2:] == (0.0, 0.0)
    for batch in (1, 2, 3, 4):
        learner.observe_decode(batch, 0.01 * batch, 32)
    assert learner.decode_learned and learner.terms(None, None)[3] == pytest.approx(0.01)


def test_a_decode_is_learned_against_the_batch_it_ran_in_not_the_one_it_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst's first request joins an empty replica but decodes beside the rest of the burst: read as a batch of
    one, a CPU engine's 25 ms a sequence looked like a 50 ms step that running sequences hardly slow."""
    clock = [0.0]
    monkeypatch.setattr(engine_pool.replica.time, "monotonic", lambda: clock[0])
    replica = Replica("r", "http://127.0.0.1:1", "m", max_num_seqs=2)
    first = replica.begin()
    mark = replica.batch_mark()
    clock[0] = 0.01
    replica.begin()  # the burst's second request, a moment later
    clock[0] = 1.01
    third = replica.begin()  # a third: it waits for a batch slot and runs in no batch
    clock[0] = 2.01
    assert replica.mean_batch(mark) == pytest.approx((0.01 + 2 * 2.0) / 2.01)
    replica.end(first)
    replica.end(third)
    assert replica.mean_batch(replica.batch_mark()) == 1  # a span of no time: what runs now
    learner = LatencyLearner()
    for batch in (1.0, 1.02, 1.0, 1.01, 1.03, 1.0, 1.0, 1.02):  # one request at a time: the batch says nothing
        learner.observe_decode(batch, 0.002 + 0.025 * batch, 32)
    assert not learner.decode_learned
    for batch in (2.0, 1.98, 2.01, 2.0, 2.02, 1.99, 2.0, 2.01):  # two at a time: at the next refit, a line
        learner.observe_decode(batch, 0.002 + 0.025 * batch, 32)
    assert learner.terms(None, None)[2:] == pytest.approx((0.002, 0.025))


def test_the_kv_a_request_holds_is_its_max_tokens_or_the_mean_output_seen() -> None:
    learner = LatencyLearner()
    assert learner.held_tokens(1000, 64) == 1064
    assert learner.held_tokens(1000, None) == 1256  # a guess before any answer
    for output in (40, 20):  # the first answers replace the guess at once
        learner.observe_decode(1, 0.01, output)
    assert learner.held_tokens(1000, None) == 1030
    for _ in range(200):
        learner.observe_decode(1, 0.01, 40)
    assert learner.held_tokens(1000, None) == pytest.approx(1040, abs=2)


# --- through the gateway ------------------------------------------------------------------------------------------
PROMPT_WORDS = 200  # about 430 of the simulator's tokens
MAX_TOKENS = 32
# four requests' KV per replica (2,048 tokens in blocks of 16): a fifth waits for one to finish, as vLLM's scheduler
# makes it wait
KV_SIM = SimConfig(model="sim", block_size=16, num_blocks=128, decode_ms=25, overhead_ms=2)


def _body(i: int, stream: bool = True) -> dict[str, object]:
    prompt = f"request {i} " + " ".join(f"w{i}x{k}" for k in range(PROMPT_WORDS))
    return {"model": "sim", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream, "ignore_eos": True}


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, object], **headers: str) -> tuple[int, dict]:
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        raw = await resp.read()
        info = {"retry_after": resp.headers.get("Retry-After")}
        if resp.status != 200:
            info["error"] = json.loads(raw)["error"]
        return resp.status, info


async def _outcomes(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvgate_slo_requests_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


@pytest.mark.parametrize("targets_on", [True, False])
async def test_past_the_knee_requests_are_refused_at_once_instead_of_queued(
    targets_on: bool, http: aiohttp.ClientSession
) -> None:
    targets = {"enabled": targets_on, "default": {"ttft_s": 0.3, "tpot_s": 10.0}}
    async with gateway_over_sims([KV_SIM, KV_SIM], admission={"targets": targets}) as (gw, _):
        for i in range(10):  # the model learns each replica's speed from answers (four at a time fit)
            await asyncio.gather(*(_post(http, gw.url, _body(100 * i + j)) for j in range(2)))
        answers = await asyncio.gather(*(_post(http, gw.url, _body(1000 + i)) for i in range(40)))
        refused = [info for status, info in answers if status == 503]
        if not targets_on:
            assert not refused  # without targets every request is let through to queue in the engines
            return
        # eight fit in the two engines at once; each takes about a second, so most of a burst of 40 would wait
        # longer than 0.3 s for KV room: they are refused, with the predicted drain as Retry-After
        assert 8 <= len(answers) - len(refused) < 40 and refused
        assert all(info["error"]["code"] == "latency_target" and info["retry_after"] for info in refused)
        assert (await _outcomes(http, gw.url)).get("refused") == len(refused)
        # a client that can wait asks for a looser target: admitted into the same burst
        status, _ = await _post(http, gw.url, _body(5000), **{"x-llm-d-slo-ttft-ms": "600000"})
        assert status == 200


async def test_a_target_header_that_is_not_a_number_is_a_400(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([KV_SIM]) as (gw, _):
        status, info = await _post(http, gw.url, _body(1), **{"x-kvgate-slo-ttft-ms": "soon"})
        assert status == 400 and info["error"]["param"] == "x-kvgate-slo-ttft-ms"


async def test_requests_sharing_a_prompt_prefix_hold_only_their_own_kv(http: aiohttp.ClientSession) -> None:
    """Prompt blocks a replica already holds are shared, not allocated again (vLLM's prefix cache; the simulator's
    KV cap): a burst sharing a long prefix fits many times more requests than one of distinct prompts, and the gate
    admits it instead of predicting waits that would not happen."""
    targets = {"default": {"ttft_s": 0.3, "tpot_s": 10.0}}
    cache = {"routing": {"policy": "cache-aware"}, "cache": {"tokenizers": {"sim": "sim"}}}
    async with gateway_over_sims([KV_SIM, KV_SIM], admission={"targets": targets}, **cache) as (gw, _):
        for i in range(10):  # the model learns each replica's speed from answers
            await asyncio.gather(*(_post(http, gw.url, _body(100 * i + j)) for j in range(2)))
        shared = _body(0)
        for _ in range(2):  # the prefix cached on the replica it is routed to
            assert (await _post(http, gw.url, shared))[0] == 200
        burst = [{**shared, "prompt": f"{shared['prompt']} question {i}"} for i in range(16)]
        answers = await asyncio.gather(*(_post(http, gw.url, body) for body in burst))
        assert [status for status, _ in answers] == [200] * 16


def test_samples_of_one_prompt_length_leave_the_prefill_speed_to_the_engines_counters() -> None:
    learner = LatencyLearner()
    for _ in range(8):  # every prompt computed the same 100 tokens: no slope can be read from them
        learner.observe_first_token(100, 0.05)
    assert learner.terms(2e-4, None)[:2] == (0.0, 2e-4)
    for _ in range(8):  # another length: at the next refit the answers speak
        learner.observe_first_token(300, 0.09)
    overhead, prefill, _, _ = learner.terms(2e-4, None)
    assert prefill == pytest.approx(2e-4) and overhead == pytest.approx(0.03)


async def test_a_max_tokens_past_the_context_holds_only_what_the_context_leaves(http: aiohttp.ClientSession) -> None:
    """vLLM caps max_tokens at the context the prompt leaves: two clients asking for a million tokens hold no more
    KV than that, so the others are still admitted; a max_tokens past any float is served, not a 500."""
    sim = SimConfig(model="sim", block_size=16, num_blocks=128, decode_ms=5, overhead_ms=2, max_model_len=512)
    targets = {"default": {"ttft_s": 0.5, "tpot_s": 10.0}}
    async with gateway_over_sims([sim, sim], admission={"targets": targets}) as (gw, sims):
        for i in range(10):  # the model learns each replica's speed from answers
            await asyncio.gather(*(_post(http, gw.url, _body(100 * i + j)) for j in range(2)))
        huge = [asyncio.create_task(_post(http, gw.url, {**_body(900 + i), "max_tokens": 10**6})) for i in range(2)]
        await wait_for(lambda: sum(s.engine.running for s in sims) == 2, what="both long answers generating")
        for i in range(4):
            assert (await _post(http, gw.url, _body(2000 + i)))[0] == 200
        assert (await _post(http, gw.url, {**_body(3000), "max_tokens": 10**400}))[0] == 200
        assert [status for status, _ in await asyncio.gather(*huge)] == [200, 200]


async def test_a_stream_whose_client_left_before_its_terminator_counts_as_served() -> None:
    """The client read the whole answer and closed before the chunked terminator (aiohttp and openai clients do):
    the gateway sets its status after admission's end, so the outcome must not wait for the status."""
    registry = CollectorRegistry()
    client = UpstreamClient()
    replicas = ReplicaSet(client)
    router = Router(LeastLoad(), replicas, GatewayMetrics(registry), None)
    gate = LatencyGate(AdmissionConfig(), replicas, router, AdmissionMetrics(registry))
    ctx = RequestContext("r", "chat", model="m", stream=True)
    ctx.answered, ctx.ttft_s = True, 0.1
    gate.finish(ctx, Identity("t", 1, "standard"), Targets(ttft_s=2.0, tpot_s=0.1))
    counted = registry.get_sample_value(
        "kvgate_slo_requests_total", {"model": "m", "priority": "standard", "tenant": "t", "outcome": "met"}
    )
    await replicas.close()
    client.close()
    assert counted == 1


@pytest.mark.parametrize(
    ("targets", "interactive", "batch"),
    [
        ({}, Targets(2.0, 0.1), Targets(600.0, float("inf"))),
        ({"default": {"ttft_s": 0.5}}, Targets(0.5, 0.1), Targets(600.0, float("inf"))),
        ({"classes": {"batch": {"ttft_s": 100}}}, Targets(2.0, 0.1), Targets(100.0, float("inf"))),
        ({"classes": {"interactive": {"tpot_s": 0.05}}}, Targets(2.0, 0.05), Targets(600.0, float("inf"))),
    ],
    ids=["shipped", "one-default-field", "one-batch-field", "another-class"],
)
async def test_a_target_field_a_file_does_not_give_keeps_its_shipped_value(
    targets: dict[str, object], interactive: Targets, batch: Targets
) -> None:
    """`default: {ttft_s: 0.5}` used to drop the shipped 100 ms TPOT target, and `classes: {batch: {ttft_s: 100}}`
    the batch class's "no TPOT target" (it inherited the default's 100 ms)."""
    config = load_config(overrides={"admission": {"targets": targets}}, environ={}).admission
    client = UpstreamClient()
    replicas = ReplicaSet(client)
    registry = CollectorRegistry()
    gate = LatencyGate(
        config, replicas, Router(LeastLoad(), replicas, GatewayMetrics(registry), None), AdmissionMetrics(registry)
    )
    got = [gate.targets(Identity("t", i, name), "m", {}) for i, name in enumerate(config.priority_classes)]
    await replicas.close()
    client.close()
    assert got == [interactive, batch]


def test_targets_of_a_class_that_does_not_exist_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"targets\.classes\.gold: unknown class"):
        load_config(overrides={"admission": {"targets": {"classes": {"gold": {"ttft_s": 1}}}}}, environ={})


async def test_a_hold_routed_elsewhere_counts_the_kv_it_needs_where_it_runs() -> None:
    """Admission holds a request's KV on the replica it predicts first; the router may place it where its prompt is
    cached. The hold moved as it was: a burst of prompts cached on the replicas they went to counted each prompt
    whole, the KV looked full after a fifth of the burst, and the rest went to the one replica left with room."""
    client = UpstreamClient()
    replicas = ReplicaSet(client)
    for rid in ("a", "b"):
        replicas.add(Replica(rid, "http://127.0.0.1:9", "m"))
    registry = CollectorRegistry()
    gate = LatencyGate(
        AdmissionConfig(), replicas, Router(LeastLoad(), replicas, GatewayMetrics(registry), None),
        AdmissionMetrics(registry),
    )  # fmt: skip
    uncached_a = Prediction("a", 0.0, 0.0, 0.0, 1, tokens=1641)  # the prompt is not cached on a: predicted first
    cached_b = Prediction("b", 0.0, 0.0, 0.0, 1, tokens=105)
    ctx = RequestContext("r", "chat", model="m")
    gate.hold(ctx, replicas.get("a"), uncached_a, 1609, 32)
    ctx.predictions = (uncached_a, cached_b)
    place(ctx, replicas.get("b"), replicas)  # the router found it cached on b
    held = {r.id: sum(h.tokens for h in r.held.values()) for r in replicas}
    await replicas.close()
    client.close()
    assert held == {"a": 0, "b": 105} and ctx.prediction == cached_b
