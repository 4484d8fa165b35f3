"""What the load generator measures beyond latency: SLOs and goodput, the goodput knee, bursty arrivals, datasets
(ShareGPT, JSONL), warm-up requests left out, the plan's prediction beside the measured knee, the sustained run's
windows, the progress bar, and the one-command capacity report; literal values first, then against the simulated
engine."""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadgen import cli, knees, predicted, report
from loadgen.capacity import sustained_windows
from loadgen.client import RequestResult, Target
from loadgen.datasets import DatasetError, DatasetWorkload, parse_jsonl, parse_sharegpt
from loadgen.runner import Arrival, Progress, run_setting
from loadgen.stats import Slo, find_goodput_knee, parse_slo, summarize
from loadgen.text import CharTextMaker
from loadgen.workloads import random_requests
from simengine import SimConfig, run_sim_engine

M = CharTextMaker()
FAST = SimConfig(block_size=16, overhead_ms=0.5, prefill_us_per_token=2.0, decode_ms=0.5, decode_ms_per_seq=0.0)


# --- SLOs and goodput --------------------------------------------------------------------------------------------


def test_parse_slo_units_and_errors() -> None:
    assert parse_slo("ttft=500ms,tpot=50ms,e2e=2s") == Slo(ttft_s=0.5, tpot_s=0.05, e2e_s=2.0)
    assert parse_slo("ttft=250") == Slo(ttft_s=0.25)  # a bare number is milliseconds, as vLLM's --goodput
    assert parse_slo(" tpot = 900us ") == Slo(tpot_s=pytest.approx(0.0009))
    for bad, msg in (("", "at least one"), ("itl=5ms", "expected ttft"), ("ttft=fast", "positive duration"),
                     ("ttft=0ms", "positive duration"), ("ttft=1s,ttft=2s", "given twice")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_slo(bad)
    assert cli.main(["run", "--url", "http://127.0.0.1:9", "--slo", "ttft=soon"]) == 2


def _r(ok: bool = True, ttft: float | None = 0.1, tpot: float | None = 0.01, e2e: float = 1.0) -> RequestResult:
    return RequestResult("s", "u", 0, ok=ok, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, completion_tokens=10)


def test_a_request_is_good_when_it_succeeded_within_every_bound() -> None:
    slo = Slo(ttft_s=0.2, tpot_s=0.02, e2e_s=2.0)
    assert slo.met(_r())
    assert not slo.met(_r(ok=False))
    assert not slo.met(_r(ttft=0.3)) and not slo.met(_r(tpot=0.03)) and not slo.met(_r(e2e=2.5))
    assert not slo.met(_r(ttft=None))  # no token streamed: no TTFT to meet the bound with
    assert slo.met(_r(tpot=None))  # a one-token answer has no time between tokens
    assert Slo(e2e_s=2.0).met(_r(ttft=9.0))  # only the bounds given count
    results = [_r(), _r(ttft=0.3), _r(ok=False), _r()]
    s = summarize(results, 2.0, slo)
    assert s.slo_attainment == 0.5 and s.goodput_req_per_s == 1.0  # 2 good of 4 (the failure counts), over 2 s
    assert summarize(results, 2.0).slo_attainment is None


def test_the_goodput_knee_is_the_load_before_attainment_falls_below_the_target() -> None:
    knee = find_goodput_knee([(8, 0.7), (1, 1.0), (4, 0.95), (2, 0.99), (16, 0.95)])
    assert knee.found and knee.load == 4 and knee.saturated_at == 8 and "0.70 < 0.9" in knee.reason
    none = find_goodput_knee([(1, 0.95), (2, 0.5)], min_attainment=0.99)  # the lowest already misses: no knee
    assert (none.found, none.load, none.saturated_at) == (False, 1, 1)
    assert none.reason == "SLO attainment 0.95 < 0.99 at 1"
    open_ended = find_goodput_knee([(1, 1.0), (2, 0.92)])
    assert not open_ended.found and open_ended.load == 2


def test_when_no_load_meets_the_slo_the_json_and_the_text_agree_there_is_no_goodput_knee() -> None:
    doc = {"arrival": "closed", "points": [
        {"load": 1, "verdict": "sweet spot", "summary": {"slo_attainment": 0.5, "goodput_req_per_s": 0.5}},
        {"load": 2, "verdict": "queueing", "summary": {"slo_attainment": 0.25, "goodput_req_per_s": 0.25}},
    ]}  # fmt: skip
    doc["recommendation"] = {"replica_max_concurrency": 2, "replicas": 1, "found": True, "load": 2, "text": "gate 2"}
    assert knees.apply_goodput(doc, argparse.Namespace(slo=Slo(ttft_s=0.5), slo_attainment=0.9), 2) is None
    knee = doc["goodput"]["knee"]
    assert (knee["found"], knee["load"], knee["saturated_at"]) == (False, 1, 1)
    assert doc["goodput"]["text"].startswith("no load tested is within targets (SLO attainment 0.50 < 0.9 at 1;")
    assert not doc["recommendation"]["found"] and "nothing recommended" in doc["recommendation"]["text"]


def sweep_point(load: float, ttft_p50_s: float, tok_s: float, attainment: float, e2e_s: float = 1.0) -> dict[str, Any]:
    summary = {
        "requests": 10,
        "succeeded": 10,
        "refused": 0,
        "ttft_s": {"p50": ttft_p50_s},
        "e2e_s": {"mean": e2e_s},
        "output_tok_per_s": tok_s,
        "slo_attainment": attainment,
        "goodput_req_per_s": attainment * load,
    }
    return {"load": load, "summary": summary, "replica_load": {"r0": 1, "r1": 1}}  # fmt: skip


def sweep_args(**slo: Any) -> argparse.Namespace:
    return argparse.Namespace(knee_ttft_factor=3.0, knee_min_gain=0.1, min_success=0.99, replicas=None,
                              slo=Slo(**slo) if slo else None, slo_attainment=0.9)  # fmt: skip


def test_with_an_slo_the_recommended_gate_is_the_goodput_knees_where_that_is_lower() -> None:
    """Throughput saturates past 8 (TTFT p50 jumps at 16), but from 4 on fewer than 90% of requests meet a 50 ms
    TTFT target: the gate to write keeps the SLO (2 in flight over 2 replicas: 1 each), not the knee's 8 (4 each)."""

    def points(*attainment: float) -> list[dict[str, Any]]:
        shape = [(1, 0.02, 100), (2, 0.03, 190), (4, 0.04, 370), (8, 0.05, 700), (16, 0.9, 710)]
        return [sweep_point(*p, att) for p, att in zip(shape, attainment, strict=True)]

    missed = (1.0, 0.95, 0.8, 0.6, 0.1)  # within a 50 ms target
    plain = {"arrival": "closed", "points": points(*missed)}
    assert knees.apply_goodput(plain, sweep_args(), knees.apply_knee(plain, sweep_args(), False)) == 4
    doc = {"arrival": "closed", "points": points(*missed)}
    args = sweep_args(ttft_s=0.05)
    assert knees.apply_goodput(doc, args, knees.apply_knee(doc, args, False)) == 1
    rec = doc["recommendation"]
    assert (rec["replica_max_concurrency"], rec["load"], rec["found"]) == (1, 2, True)
    assert rec["text"].startswith("SLO met up to concurrency 2 (the throughput knee at 8)")
    assert doc["knee"]["load"] == 8  # the throughput knee itself is still reported as measured
    lenient = {"arrival": "closed", "points": points(1.0, 1.0, 1.0, 0.95, 0.1)}  # a 1 s target: met up to 8
    args = sweep_args(ttft_s=1.0)  # the throughput knee's gate stands
    assert knees.apply_goodput(lenient, args, knees.apply_knee(lenient, args, False)) == 4


# --- arrivals ----------------------------------------------------------------------------------------------------


async def test_burstiness_shapes_the_gaps_between_arrivals_at_the_same_mean() -> None:
    # gamma gaps of shape k have a coefficient of variation 1 / sqrt(k): 2 at k = 0.25, 0.5 at k = 4; the mean gap
    # is 1 / rate either way (instant engine, 200 arrivals at 100 req/s)
    cv = {}
    async with run_sim_engine(SimConfig(instant=True)) as server, aiohttp.ClientSession() as http:
        for k in (0.25, 4.0):
            setting = await run_setting(
                http, Target(server.url, "sim-model"),
                lambda seed: random_requests(M, seed=seed, num_requests=200, input_tokens=(8, 8), output_tokens=(2, 2)),
                Arrival("poisson", rate=100.0, burstiness=k), seed=1,
            )  # fmt: skip
            starts = sorted(r.start_s for r in setting.results)
            gaps = [b - a for a, b in itertools.pairwise(starts)]
            assert statistics.mean(gaps) == pytest.approx(0.01, rel=0.3), k
            cv[k] = statistics.stdev(gaps) / statistics.mean(gaps)
    assert cv[0.25] > 1.4 and cv[4.0] < 0.75, cv
    with pytest.raises(ValueError, match="burstiness"):
        async with aiohttp.ClientSession() as http:
            await run_setting(http, Target("http://127.0.0.1:9", "m"), lambda s: iter(()),
                              Arrival("poisson", rate=1.0, burstiness=0.0))  # fmt: skip


# --- datasets ----------------------------------------------------------------------------------------------------

SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "x" * 40},
        {"from": "gpt", "value": "y" * 80}, {"from": "human", "value": "z" * 8}, {"from": "gpt", "value": "w" * 12},
    ]},
    {"id": "b", "conversations": [{"from": "human", "value": "q" * 400}, {"from": "gpt", "value": "r" * 4}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "no question"}, {"from": "narrator", "value": "?"}]},
    {"id": "d", "conversations": [{"from": "user", "value": "unanswered"}]},
]  # fmt: skip


def test_sharegpt_conversations_become_sessions_with_lengths_from_the_data() -> None:
    convs = parse_sharegpt(SHAREGPT)
    assert len(convs) == 3  # "c" has no user turn
    first = convs[0].turns
    assert first[0].messages == (("system", "be brief"), ("user", "x" * 40)) and first[0].reply == "y" * 80
    assert first[1].messages == (("user", "z" * 8),) and first[1].reply == "w" * 12
    work = DatasetWorkload(M, convs, max_turns=2, default_output_len=7, max_output_tokens=15)
    specs = {(s.session_id, s.turn): s for s in work.specs(seed=3)}
    assert set(specs) == {("ds0", 0), ("ds0", 1), ("ds1", 0), ("ds2", 0)}
    assert specs["ds0", 0].max_tokens == 15 and not specs["ds0", 0].final  # 80 chars = 20 tokens, clamped to 15
    assert specs["ds0", 1].max_tokens == 3 and specs["ds0", 1].final  # 12 chars = 3 tokens
    assert specs["ds2", 0].max_tokens == 7  # no reply in the data: --output-len
    assert specs["ds0", 0].est_prompt_tokens == 2 + 10  # "be brief" + 40 chars
    orders = {tuple(s.session_id for s in work.specs(seed)) for seed in range(6)}
    assert len(orders) > 1  # each seed samples its own order
    short = DatasetWorkload(M, convs, max_input_tokens=50)
    assert {s.session_id for s in short.specs(0)} == {"ds0", "ds2"}  # the 400-char prompt is skipped, not cut
    with pytest.raises(DatasetError, match="entry 0"):
        parse_sharegpt([{"id": "x"}], "f.json")
    with pytest.raises(DatasetError, match="JSON list"):
        parse_sharegpt({"conversations": []})


def test_jsonl_prompts_strings_objects_and_errors() -> None:
    lines = ['"plain prompt"', "", '{"prompt": "p2", "output_len": 5}',
             '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}']  # fmt: skip
    convs = parse_jsonl(lines, "p.jsonl")
    assert [c.turns[0].messages for c in convs] == [(("user", "plain prompt"),), (("user", "p2"),),
                                                     (("system", "s"), ("user", "u"))]  # fmt: skip
    specs = sorted(DatasetWorkload(M, convs, default_output_len=9).specs(0), key=lambda s: s.session_id)
    assert [s.max_tokens for s in specs] == [9, 5, 9]
    for bad, msg in (("{oops", "line 1: not JSON"), ("[1]", "line 1: expected a string"),
                     ('{"prompt": "p", "output_len": 0}', "positive"), ('{"text": "p"}', "'prompt'")):  # fmt: skip
        with pytest.raises(DatasetError, match=msg):
            parse_jsonl([bad], "p.jsonl")


# --- prediction beside measurement, sustained windows, progress ---------------------------------------------------

KVGATE_PAGE = """\
# TYPE kvgate_prefix_index_capacity_blocks gauge
kvgate_prefix_index_capacity_blocks{block_size="16",replica="r0",source="engine"} 110.0
kvgate_prefix_index_capacity_blocks{block_size="16",replica="r1",source="engine"} 54.0
kvgate_prefix_index_capacity_blocks{block_size="16",replica="r2",source="estimated"} 999.0
"""
VLLM_PAGE = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="4096"} 1.0
"""


def test_the_predicted_knee_from_engine_capacities_and_from_a_plan_file(tmp_path: Path) -> None:
    caps = predicted.parse_capacities(KVGATE_PAGE, "http://gw/metrics")
    assert caps == [predicted.Capacity("r0", 110, 16), predicted.Capacity("r1", 54, 16)]  # estimates are no plan
    assert predicted.parse_capacities(VLLM_PAGE, "u") == [predicted.Capacity("u", 4096, 32)]
    # 426 tokens per sequence = 27 blocks of 16: 110 // 27 + 54 // 27 = 4 + 2
    assert predicted.from_capacities(caps, 425.4).knee == 6
    assert predicted.from_capacities(predicted.parse_capacities(VLLM_PAGE, "u"), 2048).knee == 64
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"predicted_knee": 5, "decode_tok_s_aggregate": 100.0, "context": 2048}))
    p = predicted.from_plan_file(str(plan), replicas=2)
    assert p.knee == 10 and p.ceiling_tok_s == 200.0
    cmp = predicted.compare(p, [1, 2, 4, 8, 16], knee_load=16, ceiling_tok_s=150.0)
    assert cmp["predicted_step"] == 8 and cmp["steps_apart"] == 1 and cmp["within_one_step"]
    far = predicted.compare(p, [1, 2, 4, 8, 16], knee_load=2, ceiling_tok_s=150.0)
    assert far["steps_apart"] == 2 and not far["within_one_step"] and "NOT within" in far["text"]
    assert predicted.compare(predicted.Prediction(0, None, "x"), [1, 2], 1, 1.0)["predicted_step"] == 1
    # a sweep that found no knee confirms nothing (it read as "0 step(s) apart, within one step")
    past = predicted.compare(p, [1, 2], knee_load=None, ceiling_tok_s=150.0)
    assert past["within_one_step"] is None and past["measured_knee"] is None and "not compared" in past["text"]
    early = predicted.compare(p, [1, 2, 4, 8, 16, 32], knee_load=None, ceiling_tok_s=150.0)
    assert early["within_one_step"] is False and "NOT within" in early["text"]
    plan.write_text("{}")
    with pytest.raises(ValueError, match="kvgate plan --json"):
        predicted.from_plan_file(str(plan), 1)


def test_a_rate_sweep_compares_the_plan_in_sequences_in_flight(tmp_path: Path) -> None:
    """The plan's knee is a concurrency; a rate sweep's loads are req/s. At a mean latency of 0.25 s the rates 4, 8,
    16, 32 and 64 req/s hold 1, 2, 4, 8 and 16 requests in flight (Little's law): a plan of 4 sequences is the
    16 req/s step, where the sweep's knee is, 0 steps apart (compared with the rates it was 2 steps apart, at 4)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"predicted_knee": 4, "decode_tok_s_aggregate": 100.0, "context": 2048}))
    doc = {"arrival": "poisson", "recommendation": {"replicas": 1},
           "knee": {"index": 2, "load": 16, "found": True, "saturated_at": 32},
           "points": [{"load": r, "summary": {"e2e_s": {"mean": 0.25}, "output_tok_per_s": 10.0 * r}}
                      for r in (4, 8, 16, 32, 64)]}  # fmt: skip
    args = argparse.Namespace(plan=str(plan))
    knees.plan_beside(doc, args, predicted.read_plan_file(str(plan)))
    got = doc["plan"]
    assert (got["predicted_step"], got["measured_knee"], got["steps_apart"], got["within_one_step"]) == (
        16,
        16,
        0,
        True,
    )
    assert got["text"] == ("plan: knee 4 in flight (a rate sweep: rate x mean latency) (tested step 4), measured 4: "
                           "0 step(s) apart, within one step")  # fmt: skip
    # the chart's rate axis marks the plan at the 16 req/s step, not at 4 req/s (its knee read as a rate)
    assert report.plan_marker(doc) == (16.0, "plan 4 in flight (at 16 req/s)")
    assert report.plan_marker({**doc, "arrival": "closed"}) == (4.0, "plan 4")


async def test_a_bad_plan_is_refused_before_any_load_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "nothing.json").write_text(json.dumps({"predicted_knee": 0, "decode_tok_s_aggregate": 0.0}))
    async with run_sim_engine(FAST) as server:
        base = ["sweep", "--url", server.url, "--workload", "random", "-n", "4", "--concurrencies", "1,2"]
        bad = [["--plan", str(tmp_path / "missing.json")], ["--plan", str(tmp_path / "nothing.json")],
               ["--plan", "auto", "--metrics-url", "http://127.0.0.1:9/metrics"]]  # fmt: skip
        for flags in bad:
            assert await asyncio.to_thread(cli.main, [*base, *flags]) == 2
        started = server.engine.stats.started
    err = capsys.readouterr().err
    assert started == 0  # refused up front: the whole sweep was sent and thrown away before
    assert "missing.json: not the JSON of `kvgate plan --json`" in err and "its predicted_knee is 0" in err
    assert "--plan auto: no --metrics-url reports a KV capacity" in err


def test_sustained_windows_and_the_steady_verdict() -> None:
    # one request a second, each streaming 10 tokens in the half second before it ends at t = 1..30 s
    row = {"ok": True, "ttft_s": 0.1, "e2e_s": 0.6, "completion_tokens": 10}
    rows = [{**row, "start_s": t - 0.6} for t in range(1, 31)]
    w = sustained_windows(rows, 30.0, 10.0)
    assert w["tok_per_s"] == pytest.approx([10.0, 10.0, 10.0]) and w["steady"]
    # a request streaming across a window boundary counts in both, by time
    (spread,) = (sustained_windows([{**rows[0], "start_s": 9.0, "ttft_s": 0.5, "e2e_s": 1.5}], 20.0, 10.0),)
    assert spread["tok_per_s"] == pytest.approx([0.5, 0.5])
    stalled = [r for r in rows if not 10 <= r["start_s"] < 20]
    assert not sustained_windows(stalled, 30.0, 10.0)["steady"]
    assert sustained_windows(rows, 5.0, 10.0) == {"window_s": 10.0, "tok_per_s": [], "mean_tok_per_s": 0.0,
                                                  "max_deviation": None, "steady": False}  # fmt: skip
    assert w["mean_tok_per_s"] == pytest.approx(10.0)


def test_progress_is_a_bar_on_a_terminal_and_a_line_in_a_log() -> None:
    term = io.StringIO()
    bar = Progress(True, "c=4", stream=term, interval_s=0.0, bar=True, total=10)
    bar.update(3, 1, 2, 1.5, 60)
    bar.close()
    out = term.getvalue()
    assert "c=4" in out and "3 done, 1 failed, 2 in flight" in out and "30%" in out and "\x1b[" in out
    log = io.StringIO()
    line = Progress(True, "c=4", stream=log, interval_s=0.0, bar=False)
    line.update(3, 1, 2, 1.5, 60)
    line.close()
    assert log.getvalue() == "\r[c=4] 3 done, 1 failed, 2 in flight,     40.0 tok/s,    1.5 s\n"


# --- against the simulated engine --------------------------------------------------------------------------------


async def test_sweep_with_slo_plan_and_warmup_on_an_engine_whose_kv_runs_out_at_4(tmp_path: Path) -> None:
    # 64 sequence slots but KV for 4 requests: 110 blocks of 16, a request holds 27 (a 400-token prompt plus its
    # chat template and 16 output tokens). From 8 on half the requests wait a whole request time for blocks (30 ms
    # per token), so the measured knee is 4, where the engine's reported capacity predicts it, and a 200 ms TTFT
    # bound is met by half the requests at 8: the goodput knee is 4 too.
    cfg = SimConfig(max_num_seqs=64, num_blocks=110, block_size=16, overhead_ms=1.0, prefill_us_per_token=25.0,
                    decode_ms=30.0, decode_ms_per_seq=0.0)  # fmt: skip
    out = tmp_path / "sweep"
    async with run_sim_engine(cfg) as server:
        argv = ["sweep", "--url", server.url, "--workload", "random", "--input-len", "400:400",
                "--random-output-len", "16:16", "-n", "24", "--concurrencies", "1,2,4,8", "--warmup", "2",
                "--slo", "ttft=200ms", "--plan", "auto", "--metrics-url", f"{server.url}/metrics",
                "--out", str(out), "--no-charts"]  # fmt: skip
        assert await asyncio.to_thread(cli.main, argv) == 0
        started = server.engine.stats.started
    doc = json.loads((out / "result.json").read_text())
    assert started == 4 * (24 + 2)  # the warm-up requests reached the engine...
    for p in doc["points"]:  # ...and no figure counts them
        assert p["summary"]["requests"] == 24 and p["warmup_requests"] == 2
        assert p["prefix_cache"]["queries"] == p["summary"]["prompt_tokens"]
        assert len(p["itl_cdf_s"]) == 101 and p["itl_cdf_s"][0] <= p["itl_cdf_s"][50] <= p["itl_cdf_s"][100]
    assert doc["knee"]["load"] == 4 and doc["knee"]["found"]
    assert doc["plan"]["knee"] == 4 and doc["plan"]["within_one_step"] and doc["plan"]["steps_apart"] == 0
    assert doc["goodput"]["knee"]["load"] == 4
    attained = [p["summary"]["slo_attainment"] for p in doc["points"]]
    assert attained[:3] == [1.0, 1.0, 1.0] and attained[3] < 0.9
    html = (out / "report.html").read_text()
    assert "SLO met %" in html and "plan: knee 4" in html and "goodput knee at concurrency 4" in html


async def test_a_sharegpt_run_and_the_one_command_capacity_report(tmp_path: Path) -> None:
    data = tmp_path / "sharegpt.json"
    convs = [{"conversations": [{"from": "human", "value": f"question {i} " + "words " * (10 + i)},
                                {"from": "gpt", "value": "answer " * (2 + i % 5)}]} for i in range(30)]  # fmt: skip
    data.write_text(json.dumps(convs))
    out = tmp_path / "report"
    async with run_sim_engine(FAST) as server:
        run = ["run", "--url", server.url, "--workload", "sharegpt", "--dataset", str(data), "-n", "12", "-c", "4",
               "--out", str(tmp_path / "run"), "--no-charts"]  # fmt: skip
        assert await asyncio.to_thread(cli.main, run) == 0
        argv = ["report", "--url", server.url, "--workload", "sharegpt", "--dataset", str(data), "-n", "12",
                "--concurrencies", "1,2,4", "--duration", "3", "--slo", "ttft=2s", "--long-input", "300",
                "--long-output", "32", "--identical", "2", "--out", str(out), "--no-charts"]  # fmt: skip
        rc = await asyncio.to_thread(cli.main, argv)
    point = json.loads((tmp_path / "run" / "result.json").read_text())["points"][0]
    rows = point["requests"]
    assert len(rows) == 12 and all(r["ok"] for r in rows)
    # lengths from the data: "answer " x n is 7n characters = ceil(7n / 4) tokens, engine-counted with ignore_eos
    wanted = {f"ds{i}": -(-len("answer " * (2 + i % 5)) // 4) for i in range(30)}
    assert all(r["completion_tokens"] == wanted[r["session_id"]] for r in rows)
    doc = json.loads((out / "result.json").read_text())
    assert doc["mode"] == "report" and {"sweep", "sustained", "quality", "headline"} <= set(doc)
    sustained = doc["sustained"]
    assert sustained["points"][0]["load"] == doc["sweep"]["knee"]["load"]
    assert sustained["points"][0]["summary"]["wall_s"] >= 3.0 and sustained["sustained"]["window_s"] == 0.5
    assert len(doc["quality"]["quality"]) == 4 and rc == (
        0 if all(c["passed"] for c in doc["quality"]["quality"]) else 1
    )
    html = (out / "report.html").read_text()
    for part in ("kvgate capacity report", "sustained at", "window s", "quality checks", "goodput knee", "ITL p99"):
        assert part in html, part
    # a report compares with a run by its sweep (it was a KeyError traceback)
    cmp = ["compare", str(out / "result.json"), str(tmp_path / "run" / "result.json"), "--out", str(tmp_path / "c")]
    assert cli.main([*cmp, "--no-charts"]) == 0
    assert "report" in (tmp_path / "c" / "compare.html").read_text()
