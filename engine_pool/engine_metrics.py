"""The vLLM metrics kvgate routes and supervises on, out of an engine's /metrics page (the replica set scrapes it
every `health.metrics_interval_s`; the degradation watcher reads the result).

Only the few families below are read, with the project's one Prometheus text reader (`kvcommon.promtext`: lines of
other families are skipped without building objects, O(lines) string checks per page), and summed over label sets.
A data-parallel engine (`--data-parallel-size N`) reports one series per rank, labelled `engine="<rank>"`: the
replica of one rank reads only its own (`rank`), and every parse counts the ranks it saw (how the replica set finds
that one URL holds several caches).
"""

from __future__ import annotations

import time

from engine_pool.replica import EngineMetrics
from kvcommon.promtext import samples
from policies.queue_price import EngineCounters

_WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_sum",  # the name before vLLM 0.11
    "vllm:time_per_output_token_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:request_generation_tokens_sum",
    "vllm:request_generation_tokens_count",
)
# cumulative counters summed into EngineMetrics.counters (QueuePrice's inputs), by family name
_COUNTERS = {
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:time_per_output_token_seconds_sum": "itl_sum",
    "vllm:time_per_output_token_seconds_count": "itl_count",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens",
    "vllm:request_generation_tokens_sum": "output_tokens",
    "vllm:request_generation_tokens_count": "finished",
}


def parse_engine_metrics(text: str, *, now: float | None = None, rank: int | None = None) -> EngineMetrics:
    """Sum over label sets; with `rank`, only that data-parallel rank's series (label `engine`)."""
    m = EngineMetrics(scraped_at=time.monotonic() if now is None else now)
    running = waiting = 0.0
    usage: list[float] = []
    counters = dict.fromkeys(_COUNTERS.values(), 0.0)
    own, ranks = None if rank is None else str(rank), set[str | None]()
    for name, labels, value in samples(text, _WANTED):
        engine = labels.get("engine")
        ranks.add(engine)
        if own is not None and engine != own:
            continue
        if name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage.append(value)
        elif name == "vllm:cache_config_info":
            if "block_size" in labels and labels["block_size"].isdigit():
                m.block_size = int(labels["block_size"])
            if labels.get("num_gpu_blocks", "").isdigit():
                m.num_blocks = int(labels["num_gpu_blocks"])
        elif name == "vllm:prefix_cache_queries_total":
            m.prefix_queries += value
        elif name == "vllm:prefix_cache_hits_total":
            m.prefix_hits += value
        elif name == "vllm:time_to_first_token_seconds_sum":
            m.ttft_sum += value
        elif name == "vllm:time_to_first_token_seconds_count":
            m.ttft_count += value
        elif name in _COUNTERS:
            counters[_COUNTERS[name]] += value
    m.running = int(running)
    m.counters = EngineCounters(running=running, **counters)
    m.waiting = int(waiting)
    m.kv_usage = max(usage) if usage else 0.0
    m.ranks = tuple(sorted(int(r) for r in ranks if r is not None and r.isdigit()))
    return m
