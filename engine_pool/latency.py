"""One replica's latency model, learned online; the predictions and the admission verdict are `policies.latency`.

Samples are the gateway's own answers (`observe_first_token`, `observe_decode`): a stream's time to first token
measured from when the gateway sent it, against the prompt tokens the engine computed (prompt less cached, from the
answer's usage); and its decode seconds per token against the batch it ran in (answers of at least
`MIN_DECODE_TOKENS` tokens): the mean of the gateway's requests running on the replica over its decode
(`Replica.mean_batch`), not the batch it joined (a burst's first request would read as decoding alone). Only
requests predicted to start at once (no wait for KV room) teach the prefill line, so queueing never reads as
prefill.

Estimator: a Theil-Sen line (the median of pairwise slopes, then the median intercept) over the last `WINDOW`
samples of each kind, refitted once half of them are new: robust to the outliers a noisy engine gives (a pause, a
preemption, a scrape that lagged) up to about 29% of the window, and it forgets an engine that changed within
`WINDOW` answers; samples whose x all lie within `MIN_DX` of one another (prompts of one length, a replica that only
ever ran one sequence) say nothing of a slope, and the line stays unknown. Until it is known, the engine's own
counters are the prior where known (`QueuePrice`, learned from its /metrics, for prefill and the per-sequence cost;
the mean inter-token latency since the engine started, warm-up included, for the decode step: without it a first
burst's requests would all be predicted to end at once), else 0: a model that knows nothing predicts no cost beyond
the wait for KV room, so it never refuses on a guess. The KV a request holds: its prompt plus its max_tokens, or
plus the mean output seen (`mean_output`: the plain mean of the first answers, then an exponentially weighted one;
`DEFAULT_OUTPUT` before any) when it gave none.
The margin: the `MARGIN_QUANTILE` of how much later than predicted the last `WINDOW` first tokens came (0 while they
came early), added to every prediction (`policies.latency`).
Costs: O(1) per sample; a refit O(WINDOW^2) (496 slopes, in numpy: about 35 us) once half the samples are new (every
4 while there are fewer than 8, every 16 in a full window: at a thousand answers a second, refits every 4 samples in
Python were 5% of the gateway's CPU); reading the model O(1), the margin O(WINDOW log WINDOW) after a new sample.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 32
MIN_SAMPLES = 4
MARGIN_QUANTILE = 0.95
OUTPUT_WEIGHT = 0.1  # of each answer in the mean output
DEFAULT_OUTPUT = 256  # tokens a request without max_tokens is taken to produce until answers say otherwise
# an answer shorter than this says little of the decode step (a whole answer's few tokens carry its HTTP and
# scheduling noise, seconds spread over 4 tokens read as a slow engine): it teaches the mean output only
MIN_DECODE_TOKENS = 16
MIN_DX = 0.5  # samples nearer than this (a measured mean batch: 1.0 and 1.02) say nothing of a slope
_PAIRS = np.triu_indices(WINDOW, 1)  # every pair of a full window's samples


class _Line:
    """y = intercept + slope x, fitted by Theil-Sen over a window of (x, y) samples; slope and intercept >= 0."""

    __slots__ = ("_since_fit", "intercept", "samples", "slope")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.slope: float | None = None
        self.intercept: float | None = None

    def add(self, x: float, y: float) -> None:
        self.samples.append((x, y))
        self._since_fit += 1
        n = len(self.samples)
        if n >= MIN_SAMPLES and self._since_fit >= max(MIN_SAMPLES, n // 2):
            self._fit()

    def _fit(self) -> None:
        xy = np.array(self.samples)
        x, y = xy[:, 0], xy[:, 1]
        i, j = _PAIRS if len(x) == WINDOW else np.triu_indices(len(x), 1)
        dx = x[j] - x[i]
        pair = np.abs(dx) >= MIN_DX
        self._since_fit = 0
        if not pair.any():  # samples of one x say nothing of a slope: the line stays unknown (its prior is used)
            return
        slope = max(0.0, float(np.median((y[j] - y[i])[pair] / dx[pair])))
        self.slope = slope
        self.intercept = max(0.0, float(np.median(y - slope * x)))


class LatencyLearner:
    """The learned terms of one replica's latency model (seconds)."""

    __slots__ = ("_answers", "_decode", "_late", "_margin", "_prefill", "changes", "mean_output")

    def __init__(self) -> None:
        self._prefill = _Line()  # time to first token against computed prompt tokens
        self._decode = _Line()  # seconds per output token against the batch
        self._late: deque[float] = deque(maxlen=WINDOW)  # observed - predicted time to first token
        self._margin: float | None = None
        self.mean_output = float(DEFAULT_OUTPUT)
        self._answers = 0
        self.changes = 0  # observations so far: what was read of the terms holds until it moves

    def observe_late(self, observed_s: float, predicted_s: float) -> None:
        """A first token against its prediction (without the margin)."""
        self._late.append(observed_s - predicted_s)
        self._margin = None
        self.changes += 1

    def margin(self) -> float:
        """Read per request and replica: kept until the next lateness sample."""
        if self._margin is None:
            ordered = sorted(self._late)
            n = len(ordered)
            self._margin = max(0.0, ordered[min(n - 1, int(MARGIN_QUANTILE * n))]) if n >= MIN_SAMPLES else 0.0
        return self._margin

    def observe_first_token(self, computed_tokens: int, ttft_s: float) -> None:
        """A request that started at once: its time to first token from when it was sent."""
        if ttft_s >= 0 and computed_tokens >= 0:
            self._prefill.add(float(computed_tokens), ttft_s)
            self.changes += 1

    def observe_decode(self, batch: float, s_per_token: float, output_tokens: int) -> None:
        """A finished request: its decode seconds per token, the batch it ran in, the tokens it produced."""
        self.changes += 1
        if s_per_token >= 0 and batch >= 1 and output_tokens >= MIN_DECODE_TOKENS:
            self._decode.add(float(batch), s_per_token)
        if output_tokens > 0:  # the first answers' plain mean (the default is a guess), then weighted to the recent
            self._answers += 1
            weight = max(OUTPUT_WEIGHT, 1.0 / self._answers)
            self.mean_output += weight * (output_tokens - self.mean_output)

    @property
    def output_learned(self) -> bool:
        """Whether `mean_output` comes from answers (else it is `DEFAULT_OUTPUT`, a guess)."""
        return self._answers > 0

    @property
    def decode_learned(self) -> bool:
        return self._decode.slope is not None

    def terms(
        self,
        prior_prefill_s_per_token: float | None,
        prior_step_per_seq_s: float | None,
        prior_step_s: float | None = None,
    ) -> tuple[float, float, float, float]:
        """(overhead, prefill per token, decode step of one, per further sequence), the priors until learned."""
        p, d = self._prefill, self._decode
        if p.slope is not None and p.intercept is not None:
            overhead, prefill = p.intercept, p.slope
        else:
            overhead, prefill = 0.0, prior_prefill_s_per_token or 0.0
        if d.slope is not None and d.intercept is not None:
            step, per_seq = d.intercept, d.slope
        else:
            step, per_seq = prior_step_s or 0.0, prior_step_per_seq_s or 0.0
        return overhead, prefill, step, per_seq

    def held_tokens(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The KV a request holds at most: its prompt and what it may produce."""
        return prompt_tokens + (max_tokens if max_tokens is not None else round(self.mean_output))
