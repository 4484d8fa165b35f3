"""Pure parts of the load generator with literal values: percentiles, knee rule, verdicts, gate, repetition
detector, Mooncake trace parser, workloads, text lengths, YAML gate writer, Prometheus parser, tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import aiohttp
import pytest
import yaml

from loadgen import cli
from loadgen import workloads as wl
from loadgen.client import RequestResult, Target
from loadgen.gatecfg import GateConfigError, set_gate_text
from loadgen.promscrape import Scrape, parse_metrics, prefix_cache_report, replica_load
from loadgen.quality import find_repetition_loop, run_quality
from loadgen.report import format_compare, format_table, table_rows
from loadgen.runner import Tenant, parse_tenant
from loadgen.stats import (
    Knee,
    KneeRule,
    Slo,
    SweepPoint,
    distribution,
    find_knee,
    percentile,
    recommend_gate,
    slo_verdict,
    summarize,
    verdict,
)
from loadgen.text import CharTextMaker, TokenizerTextMaker, make_text_maker
from simengine.tokenize import tokenize_text

# --- percentiles -------------------------------------------------------------------------------------------------


def test_percentile_linear_interpolation_literals() -> None:
    v = [10.0, 20.0, 30.0, 40.0]
    assert percentile(v, 0) == 10.0
    assert percentile(v, 100) == 40.0
    assert percentile(v, 50) == 25.0  # h = 1.5
    assert percentile(v, 90) == pytest.approx(37.0)  # h = 2.7
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    with pytest.raises(ValueError):
        percentile(v, 101)


def test_percentile_matches_numpy_and_is_monotone() -> None:
    import random

    np = pytest.importorskip("numpy")

    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        vals = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))
        d = distribution(vals)
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]  # type: ignore[operator]


def test_summary_figures_are_consistent() -> None:
    rs = [
        RequestResult("a", "a", 0, ok=True, status=200, ttft_s=0.1, e2e_s=1.0, tpot_s=0.1, prompt_tokens=100,
                      cached_tokens=64, completion_tokens=10),
        RequestResult("b", "b", 0, ok=True, status=200, ttft_s=0.3, e2e_s=2.0, tpot_s=0.2, prompt_tokens=100,
                      cached_tokens=0, completion_tokens=30),
        RequestResult("c", "c", 0, ok=False, status=503, error_type="http_503", e2e_s=0.01, completion_tokens=0),
    ]  # fmt: skip
    s = summarize(rs, wall_s=4.0)
    assert (s.requests, s.succeeded, s.failed) == (3, 2, 1)
    assert s.success_rate == pytest.approx(2 / 3)
    assert s.completion_tokens == 40 and s.prompt_tokens == 200 and s.cached_tokens == 64
    assert s.output_tok_per_s == pytest.approx(10.0)  # 40 tokens / 4 s
    assert s.req_per_s == pytest.approx(0.5)
    assert s.cached_fraction == pytest.approx(0.32)
    assert s.ttft_s["p50"] == pytest.approx(0.2)
    assert s.errors == {"http_503": 1}
    assert json.dumps(s.to_json())  # serialisable


# --- knee rule ---------------------------------------------------------------------------------------------------

# A sweep whose knee is at concurrency 4: TTFT p50 flat until 4, then 5x while throughput stays flat.
SWEEP = [
    SweepPoint(1, 0.050, 100.0, 1.0, 0.5),
    SweepPoint(2, 0.052, 195.0, 1.0, 0.5),
    SweepPoint(4, 0.060, 380.0, 1.0, 0.55),
    SweepPoint(8, 0.250, 390.0, 1.0, 1.0),
    SweepPoint(16, 0.700, 392.0, 1.0, 2.0),
]


def test_knee_at_ttft_jump_with_flat_throughput() -> None:
    knee = find_knee(SWEEP)
    assert knee.found and knee.load == 4 and knee.index == 2 and knee.saturated_at == 8
    assert knee.baseline_ttft_s == 0.050
    assert find_knee(list(reversed(SWEEP))).load == 4  # order does not matter


def test_knee_needs_both_conditions() -> None:
    # TTFT rises 5x but throughput still doubles: not saturated yet.
    rising = [SweepPoint(1, 0.05, 100.0), SweepPoint(2, 0.25, 200.0), SweepPoint(4, 0.30, 210.0)]
    assert find_knee(rising).load == 2 and find_knee(rising).saturated_at == 4
    # Throughput flat but TTFT only 2x: not saturated.
    flat = [SweepPoint(1, 0.05, 100.0), SweepPoint(2, 0.10, 100.0)]
    knee = find_knee(flat)
    assert not knee.found and knee.load == 2
    # A stricter factor finds it.
    assert find_knee(flat, KneeRule(ttft_factor=1.5)).load == 1
    # Tiny absolute TTFTs (noise) do not make a knee: 3 ms > 3 x 0.5 ms but under min_rise_s.
    noise = [SweepPoint(1, 0.0005, 100.0), SweepPoint(2, 0.003, 100.0)]
    assert not find_knee(noise).found


def test_a_stalled_setting_followed_by_higher_throughput_is_not_the_knee() -> None:
    # bench/vllm_sweep.sh on the shared machine: concurrency 4 stalled (flat throughput, TTFT up), 8-64 kept gaining
    stalled = [
        SweepPoint(1, 0.040, 145.6),
        SweepPoint(2, 0.089, 181.0),
        SweepPoint(4, 0.150, 176.3),
        SweepPoint(8, 0.212, 556.1),
        SweepPoint(16, 0.391, 694.4),
        SweepPoint(32, 1.310, 585.8),
        SweepPoint(64, 1.669, 963.1),
    ]
    knee = find_knee(stalled)
    assert not knee.found and knee.load == 64
    # the same sweep with the gain at 64 gone: the flat step at 32 is now the real knee (16 just before it)
    plateau = [*stalled[:-1], SweepPoint(64, 1.669, 700.0)]
    knee = find_knee(plateau)
    assert knee.found and knee.load == 16 and knee.saturated_at == 32


def test_knee_on_failures_and_empty() -> None:
    failing = [SweepPoint(1, 0.05, 100.0), SweepPoint(2, 0.05, 200.0), SweepPoint(4, 0.05, 400.0, 0.9)]
    knee = find_knee(failing)
    assert knee.load == 2 and "success rate" in knee.reason
    with pytest.raises(ValueError):
        find_knee([])
    # a target that cannot be reached (or a bad key): the lowest load fails, no knee, nothing to recommend
    down = [SweepPoint(1, 0.0, 0.0, 0.0), SweepPoint(2, 0.0, 0.0, 0.0)]
    knee = find_knee(down)
    assert not knee.found and knee.saturated_at == 1


def test_a_gateway_that_sheds_load_has_its_knee_before_the_shedding() -> None:
    """Through an admission gate the admitted requests' TTFT never rises: the refusals (answered, with
    Retry-After) are the saturation. The gate of 2 here: 92 % refused from 4 on, the throughput flat."""
    shedding = [
        SweepPoint(1, 0.005, 100.0, 1.0, 0.1, 0.0),
        SweepPoint(2, 0.005, 199.0, 1.0, 0.1, 0.0),
        SweepPoint(4, 0.0067, 197.7, 1.0, 0.1, 0.917),
        SweepPoint(8, 0.0065, 197.9, 1.0, 0.1, 0.917),
    ]
    knee = find_knee(shedding)
    assert knee.found and knee.load == 2 and knee.saturated_at == 4 and "refused" in knee.reason
    assert [verdict(p, knee) for p in shedding][2:] == ["shedding", "shedding"]


def test_verdicts_literal() -> None:
    knee = find_knee(SWEEP)
    got = [verdict(p, knee) for p in SWEEP]
    assert got == ["interactive", "interactive", "sweet spot", "queueing", "batch only"]  # 5x, 14x
    assert verdict(SweepPoint(32, 0.6, 390.0), knee) == "batch only"  # 12 x baseline
    assert verdict(SweepPoint(3, 0.1, 300.0), knee) == "production"  # 2 x baseline, below the knee
    assert verdict(SweepPoint(8, 0.1, 300.0, 0.5), knee) == "failing"


def test_recommended_gate() -> None:
    knee = find_knee(SWEEP)
    assert recommend_gate(knee, SWEEP[2], replicas=1, by_rate=False) == 4
    assert recommend_gate(knee, SWEEP[2], replicas=2, by_rate=False) == 2
    assert recommend_gate(knee, SWEEP[2], replicas=8, by_rate=False) == 1  # never below 1
    # Rate sweep: Little's law, 6 req/s x 0.55 s = 3.3 -> 4 in flight.
    rate_knee = Knee(2, 6.0, True, 0.05, 8.0, "")
    assert recommend_gate(rate_knee, SweepPoint(6.0, 0.06, 380.0, 1.0, 0.55), replicas=1, by_rate=True) == 4
    with pytest.raises(ValueError):
        recommend_gate(knee, SWEEP[2], replicas=0, by_rate=False)


# --- repetition detector -----------------------------------------------------------------------------------------


def test_repetition_loop_words() -> None:
    text = "the model starts fine and then " + "I am a loop. " * 8
    loop = find_repetition_loop(text)
    assert loop is not None and loop.unit == "word" and loop.period == 4 and loop.repeats >= 8
    assert loop.pattern == "I am a loop."
    # cut mid-repetition by max_tokens: still a loop of the same period
    cut = find_repetition_loop(text + "I am")
    assert cut is not None and cut.period == 4


def test_repetition_loop_chars_and_negatives() -> None:
    loop = find_repetition_loop("answer: " + "ab" * 40)
    assert loop is not None and loop.unit == "char" and loop.period == 2
    assert find_repetition_loop("The quick brown fox jumps over the lazy dog, then sleeps.") is None
    assert find_repetition_loop("Wait...") is None  # short punctuation runs are not loops
    assert find_repetition_loop("") is None
    # three repetitions are below min_repeats=4
    assert find_repetition_loop("one two three " * 3) is None
    # a repeated tail that is a small fraction of a long text is not reported
    long_text = " ".join(f"w{i}" for i in range(400)) + " x y" * 5
    assert find_repetition_loop(long_text) is None


# --- Mooncake trace --------------------------------------------------------------------------------------------

SAMPLE_TRACE = """\
{"timestamp": 0, "input_length": 1100, "output_length": 12, "hash_ids": [0, 1, 2]}
{"timestamp": 250, "input_length": 1200, "output_length": 8, "hash_ids": [0, 1, 3]}

{"timestamp": 100, "input_length": 300, "output_length": 5, "hash_ids": [7]}
{"timestamp": 900, "input_length": 600, "output_length": 20, "hash_ids": [9, 10]}
"""


def test_parse_mooncake_trace() -> None:
    recs = wl.parse_mooncake_trace(SAMPLE_TRACE.splitlines())
    assert len(recs) == 4
    assert recs[0] == wl.TraceRecord(0.0, 1100, 12, (0, 1, 2))
    assert recs[2].hash_ids == (7,)


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ("not json", "line 2: not JSON"),
        ('{"timestamp": 1, "input_length": -1, "output_length": 1}', "input_length"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": "x", "input_length": 1, "output_length": 1}', "timestamp"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_parse_mooncake_trace_errors(line: str, msg: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(wl.TraceError, match=msg):
        wl.parse_mooncake_trace([good, line])


def test_trace_replay_shares_blocks_and_orders_by_time() -> None:
    m = CharTextMaker()
    recs = wl.parse_mooncake_trace(SAMPLE_TRACE.splitlines())
    specs = list(wl.trace_replay(m, recs, seed=1, block_tokens=512, time_scale=0.5, max_output_tokens=10))
    assert [s.arrival_s for s in specs] == [0.0, 0.05, 0.125, 0.45]
    assert [s.max_tokens for s in specs] == [10, 5, 8, 10]
    a, b = specs[0].messages[0][1], specs[2].messages[0][1]
    assert m.count(a) == 1100 and m.count(b) == 1200
    assert a[: 2 * 512 * 4] == b[: 2 * 512 * 4]  # hash ids 0 and 1 shared
    assert a[2 * 512 * 4 : 2 * 512 * 4 + 100] != b[2 * 512 * 4 : 2 * 512 * 4 + 100]  # 2 vs 3 differ
    clamped = list(wl.trace_replay(m, recs, seed=1, max_input_tokens=400))
    assert max(m.count(s.messages[0][1]) for s in clamped) == 400


# --- workloads and text ------------------------------------------------------------------------------------------


def test_text_maker_exact_lengths_and_prefix_property() -> None:
    m = CharTextMaker()
    t = m.text("k", 100)
    assert len(t) == 400 and len(tokenize_text(t)) == 100 == m.count(t)
    assert m.text("k", 100) == t and m.text("k", 30) == t[:120] and m.text("other", 100) != t
    assert m.text("k", 0) == ""


def test_shared_prefix_uniform_and_zipf() -> None:
    m = CharTextMaker()
    specs = list(wl.shared_prefix(m, seed=3, groups=4, prompts_per_group=5, system_tokens=50, question_tokens=10))
    assert len(specs) == 20 and len({s.session_id for s in specs}) == 20
    by_group: dict[int, set[str]] = {}
    for s in specs:
        assert s.group is not None
        by_group.setdefault(s.group, set()).add(s.messages[0][1])
        assert m.count(s.messages[0][1]) == 50 and m.count(s.messages[1][1]) == 10
    assert {g: len(v) for g, v in by_group.items()} == {0: 1, 1: 1, 2: 1, 3: 1}  # one system prompt per group
    assert sorted(sum(1 for s in specs if s.group == g) for g in range(4)) == [5, 5, 5, 5]
    assert [s.group for s in specs] != sorted(s.group for s in specs)  # type: ignore[type-var]  # shuffled
    again = list(wl.shared_prefix(m, seed=3, groups=4, prompts_per_group=5, system_tokens=50, question_tokens=10))
    assert again == specs  # seeded
    z = list(wl.shared_prefix(m, seed=3, groups=8, prompts_per_group=50, popularity="zipf", system_tokens=4))
    counts = [sum(1 for s in z if s.group == g) for g in range(8)]
    assert counts[0] > counts[7] and sum(counts) == 400


def test_multi_round_and_agent_shapes() -> None:
    m = CharTextMaker()
    chat = list(wl.multi_round_chat(m, seed=0, users=2, rounds=3, system_tokens=20, think_s=0.5))
    assert [(s.session_id, s.turn, s.final) for s in chat] == [
        ("chat0", 0, False), ("chat0", 1, False), ("chat0", 2, True),
        ("chat1", 0, False), ("chat1", 1, False), ("chat1", 2, True),
    ]  # fmt: skip
    assert chat[0].messages[0][0] == "system" and chat[0].messages[0] == chat[3].messages[0]
    assert chat[0].think_s == 0.0 and chat[1].think_s == 0.5
    agent = list(wl.agent_sessions(m, seed=0, sessions=2, turns=3, tool_result_tokens=16))
    assert all(dict(s.headers)[wl.SESSION_HEADER] == s.session_id for s in agent)
    assert agent[1].messages[0][1].startswith("Tool result: ")
    rnd = list(wl.random_requests(m, seed=0, num_requests=10, input_tokens=(5, 9), output_tokens=(2, 3)))
    assert all(5 <= m.count(s.messages[0][1]) <= 9 and 2 <= s.max_tokens <= 3 for s in rnd)
    assert len({s.messages[0][1] for s in rnd}) == 10


def test_parse_tenant() -> None:
    assert parse_tenant("sk-a:3") == Tenant("sk-a", 3.0)
    assert parse_tenant("plain") == Tenant("plain", 1.0)
    assert Tenant("sk-0123456789").label == "sk-0...89"
    for bad in ("k:x", "k:0", ":2"):
        with pytest.raises(ValueError):
            parse_tenant(bad)


# --- YAML gate writer --------------------------------------------------------------------------------------------


def test_set_gate_replaces_value_and_keeps_comments() -> None:
    text = (
        "# kvgate config\nserver:\n  port: 8000  # public port\nadmission:\n    queue_timeout_s: 5\n"
        "    replica_max_concurrency: 64   # old gate\nrouting:\n  policy: least-load\n"
    )
    out = set_gate_text(text, 6)
    assert "    replica_max_concurrency: 6  # old gate\n" in out
    assert "# kvgate config" in out and "# public port" in out
    assert yaml.safe_load(out) == {
        "server": {"port": 8000},
        "admission": {"queue_timeout_s": 5, "replica_max_concurrency": 6},
        "routing": {"policy": "least-load"},
    }


def test_set_gate_inserts_or_appends() -> None:
    out = set_gate_text("admission:\n  queue_timeout_s: 5\nserver:\n  port: 1\n", 3)
    assert yaml.safe_load(out) == {"admission": {"replica_max_concurrency": 3, "queue_timeout_s": 5},
                                   "server": {"port": 1}}  # fmt: skip
    out = set_gate_text("server:\n  port: 1  # keep me", 2)
    assert "# keep me" in out and yaml.safe_load(out)["admission"] == {"replica_max_concurrency": 2}
    assert yaml.safe_load(set_gate_text("", 5)) == {"admission": {"replica_max_concurrency": 5}}
    # flow style falls back to a rewrite that still sets exactly that key
    out = set_gate_text("admission: {queue_timeout_s: 5}\n", 4)
    assert yaml.safe_load(out) == {"admission": {"queue_timeout_s": 5, "replica_max_concurrency": 4}}
    with pytest.raises(GateConfigError):
        set_gate_text("- a list\n", 4)
    with pytest.raises(ValueError):
        set_gate_text("", 0)


# --- Prometheus parsing ------------------------------------------------------------------------------------------

METRICS_BEFORE = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
"""
METRICS_AFTER = METRICS_BEFORE.replace("} 100.0", "} 1100.0").replace("} 10.0", "} 760.0")


def test_parse_metrics_and_hit_rate() -> None:
    before = parse_metrics(METRICS_BEFORE)
    assert before == {"vllm:prefix_cache_queries_total": 150.0, "vllm:prefix_cache_hits_total": 10.0}
    after = parse_metrics(METRICS_AFTER)
    rep = prefix_cache_report([Scrape("u", before)], [Scrape("u", after)])
    assert rep["hits"] == 750.0 and rep["queries"] == 1000.0 and rep["hit_rate"] == 0.75
    # a restarted engine (counter went down) counts its after-value; errors are reported per URL
    rep = prefix_cache_report([Scrape("u", after), Scrape("v", error="HTTP 500")], [Scrape("u", before), Scrape("v")])
    assert rep["queries"] == 150.0 and rep["per_url"]["v"] == {"error": "HTTP 500"}
    assert replica_load(["r1", None, "r0", "r1"]) == {"-": 1, "r0": 1, "r1": 2}


def test_tables_render_with_units_and_slo_columns() -> None:
    r = RequestResult("a", "a", 0, ok=True, ttft_s=0.01, e2e_s=0.1, completion_tokens=5, itl_s=[0.02, 0.03])
    point = {
        "load": 4.0,
        "summary": summarize([r], 1.0).to_json(),
        "verdict": "sweet spot",
        "prefix_cache": {"hit_rate": 0.5},
        "requests": [],
    }
    doc = {"points": [point], "knee": {"load": 4.0}, "recommendation": {"text": "gate 4"}}
    head, (row,) = table_rows(doc)
    cells = dict(zip(head, row, strict=True))
    assert all(h in ("conc", "verdict", "plan") or h.split()[-1] in ("ms", "%", "tok/s", "req/s", "seqs") for h in head)
    assert cells["conc"] == "4*" and cells["hit rate %"] == "50.0" and cells["ITL p50 ms"] == "25.0"
    assert cells["TTFT p50 ms"] == "10.0" and "SLO met %" not in cells
    table = format_table(doc)
    assert "sweet spot" in table and table.endswith("gate 4")
    # with an SLO the table grows goodput columns, and the findings list the goodput knee and the plan
    point["summary"] = summarize([r], 1.0, Slo(ttft_s=0.005)).to_json()
    point["prefix_cache"] = {"hit_rate": 0.5, "per_url": {"e": {"counters": {"vllm:num_preemptions_total": 3.0}}}}
    plan = {"text": "plan: knee 4", "knee": 5, "predicted_step": 4.0, "ceiling_tok_s": 1234.0}
    doc |= {"goodput": {"text": "goodput knee"}, "plan": plan}
    head, (row,) = table_rows(doc)
    cells = dict(zip(head, row, strict=True))
    assert cells["SLO met %"] == "0.0" and cells["goodput req/s"] == "0.00" and cells["preempted seqs"] == "3"
    assert cells["plan"] == "predicted knee 5; ceiling 1,234 tok/s"  # on the predicted step and the best row
    assert format_table(doc).endswith("gate 4\ngoodput knee\nplan: knee 4")
    cmp = format_compare([("rr", doc), ("cache", {"points": []})])
    assert "rr tok/s" in cmp and "cache TTFT p50 ms" in cmp
    # a rate sweep's load 4 is not a concurrency sweep's: their own rows; two documents of one label told apart
    cmp = format_compare([("gw", doc), ("gw", {**doc, "arrival": "poisson"})])
    lines = cmp.splitlines()
    assert "gw (2) tok/s" in lines[0]
    assert {line.strip().split("  ")[0] for line in lines[1:]} == {"4 concurrent", "4 req/s"}


def test_tokenizer_text_maker_counts_model_tokens(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CharTextMaker().text(f"corpus{i}", 500) for i in range(20)], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    maker = make_text_maker(str(tmp_path))
    assert isinstance(maker, TokenizerTextMaker) and maker._tok is None  # loaded lazily
    text = maker.text("k", 120)
    assert maker._tok is not None
    assert abs(maker.count(text) - 120) <= 2  # decode + re-encode may merge at the cut
    assert maker.text("k", 120) == text and maker.text("k", 40) != text
    assert isinstance(make_text_maker(None), CharTextMaker)


def test_a_rate_sweep_finds_its_knee_by_the_time_to_first_token_jump_alone() -> None:
    """The real-engine sweep that reassured an operator: at 6 req/s TTFT p50 was 3.2 s (16x the baseline) while
    measured throughput still rose, because arrivals do not slow down when the server does."""
    points = [SweepPoint(1, 0.2, 100.0), SweepPoint(2, 0.25, 190.0), SweepPoint(6, 3.2, 400.0)]
    assert not find_knee(points).found  # the closed-loop rule needs throughput to stall
    knee = find_knee(points, open_loop=True)
    assert knee.found and knee.load == 2 and knee.saturated_at == 6


def test_a_point_that_misses_its_targets_is_never_a_sweet_spot() -> None:
    assert slo_verdict("sweet spot", 0.38, 0.9) == "misses targets (38% within)"
    assert slo_verdict("interactive", 0.97, 0.9) == "interactive"


# --- an unreachable server ---------------------------------------------------------------------------------------

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


async def test_quality_against_an_unreachable_server_says_why_each_check_failed() -> None:
    async with aiohttp.ClientSession() as http:
        checks = await run_quality(http, Target(DOWN, "m"), CharTextMaker(), headers={}, long_input_tokens=8,
                                   long_output_tokens=8, identical=2)  # fmt: skip
    loop = next(c for c in checks if c.name == "no_repetition_loop")
    assert not loop.passed
    assert loop.detail.startswith("not checked: the long generation failed (connection: ClientConnectorError")


@pytest.mark.parametrize("mode", ["sweep", "run", "quality", "report"])
@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_an_unreachable_url_exits_1_with_or_without_model(
    capsys: pytest.CaptureFixture[str], mode: str, model: list[str]
) -> None:
    """Not bad usage (2): the server is down or the URL wrong, the same whether or not --model skipped asking it."""
    load = ["--workload", "random", "-n", "2"] + (["--concurrencies", "1"] if mode in ("sweep", "report") else [])
    argv = [mode, "--url", DOWN, *model, *(load if mode != "quality" else ["--long-input", "8", "--identical", "1"])]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count(f"kvgate loadgen: cannot reach {DOWN}: ") == 1, err  # said once: a report stops after its sweep
