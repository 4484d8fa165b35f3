"""Parsing the vLLM metrics kvgate routes on, and the replica breaker."""

from engine_pool.engine_metrics import parse_engine_metrics
from engine_pool.replica import Replica

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="512"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
"""


def test_parse_vllm_metrics() -> None:
    m = parse_engine_metrics(VLLM_TEXT, now=5.0)
    assert (m.running, m.waiting, m.kv_usage) == (3, 2, 0.25)
    assert (m.block_size, m.num_blocks) == (32, 512)
    assert (m.prefix_queries, m.prefix_hits, m.scraped_at) == (1000.0, 640.0, 5.0)


def test_data_parallel_series_are_summed_and_garbage_skipped() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:num_requests_running{engine="1"} 2\n'
        "vllm:num_requests_waiting x\n"
    )
    m = parse_engine_metrics(text)
    assert m.running == 3 and m.waiting == 0 and m.block_size is None
    assert m.ranks == (0, 1)


def test_one_data_parallel_rank_reads_only_its_own_series() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="64"} 1\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 7\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 11\n'
    )
    one = parse_engine_metrics(text, rank=1)
    assert (one.running, one.kv_usage, one.num_blocks, one.prefix_hits) == (2, 0.125, 64, 11.0)
    zero = parse_engine_metrics(text, rank=0)
    assert (zero.running, zero.kv_usage, zero.num_blocks, zero.prefix_hits) == (1, 0.5, None, 7.0)
    assert zero.ranks == one.ranks == (0, 1)  # the ranks seen, whichever is read
    assert parse_engine_metrics(VLLM_TEXT).ranks == (0,)


def test_breaker_opens_after_threshold_and_half_open_reopens() -> None:
    rep = Replica("a", "http://x", "m")
    rep.healthy = True
    assert not rep.record_failure(threshold=2, cooldown_s=5, now=0.0)
    assert rep.record_failure(threshold=2, cooldown_s=5, now=0.0)
    assert rep.breaker_open(1.0) and not rep.routable(1.0)
    assert rep.routable(6.0)  # cooldown over: trial traffic allowed
    assert rep.record_failure(threshold=2, cooldown_s=5, now=6.0)  # one failure in half-open reopens
    assert rep.breaker_open(7.0)
    rep.record_success()
    assert rep.routable(7.0)
