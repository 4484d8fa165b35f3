"""Latency targets and admission by predicted latency: the async shell of `policies.latency`.

Per request: its targets (`targets`: the default, then its model's, its priority class's and its tenant's, each
field over the one before; then a looser one the client asks for by header, in milliseconds: kvgate's
`x-kvgate-slo-ttft-ms` / `x-kvgate-slo-tpot-ms` or llm-d's `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`) ->
the verdict (`judge`: a prediction on every routable candidate the router weighs for it, from what each holds and
what it has learned) -> a hold on the best replica (the KV the request will take and its predicted end, so the next
request's prediction sees it at once, before any engine reports it) -> moved if the router places it elsewhere
(`place`) -> released and learned from when it ends (`finish`: its time to first token from when it was sent, its
decode time).
Outcomes per model, priority class and tenant: met, missed (answered late), refused (`kvgate_slo_requests_total`).
Cost per request: O(candidates x their held requests) for the verdict (the candidates bounded by
`routing.max_candidates` over a large pool); O(1) for the rest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Identity
from gateway.admission.config import AdmissionConfig, LatencyTargets
from gateway.admission.metrics import AdmissionMetrics
from gateway.context import RequestContext
from gateway.errors import BadRequest
from gateway.router import Router
from kvcommon.fastmetrics import FastCounter, FastHistogram
from policies.base import RequestInfo
from policies.latency import Held, Prediction, Targets, Verdict, judge, pinned_prefix, predict

_HEADERS = {
    "ttft": ("x-kvgate-slo-ttft-ms", "x-llm-d-slo-ttft-ms"),
    "tpot": ("x-kvgate-slo-tpot-ms", "x-llm-d-slo-tpot-ms"),
}
ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _merge(base: Targets, over: LatencyTargets | None) -> Targets:
    if over is None:
        return base
    return Targets(
        base.ttft_s if over.ttft_s is None else over.ttft_s, base.tpot_s if over.tpot_s is None else over.tpot_s
    )


def _asked(headers: Mapping[str, str], kind: str) -> float | None:
    """A target the client asks for by header, in seconds (400 when it is not a positive number of ms)."""
    for name in _HEADERS[kind]:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise BadRequest(f"{name} must be a positive number of milliseconds", param=name, code="invalid_header")
        return ms / 1000.0
    return None


class LatencyGate:
    def __init__(
        self, config: AdmissionConfig, replicas: ReplicaSet, router: Router, metrics: AdmissionMetrics
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.router = router
        self.outcomes = FastCounter(
            "kvgate_slo_requests",
            "Requests by latency-target outcome (met, missed, refused), model, priority class and tenant.",
            ["model", "priority", "tenant", "outcome"],
            metrics.registry,
        )
        self.predicted = FastHistogram(
            "kvgate_predicted_ttft_seconds",
            "Time to first token predicted for admitted requests, from when they were sent.",
            ["model"],
            metrics.registry,
            ERROR_BUCKETS,
        )
        self.error = FastHistogram(
            "kvgate_ttft_prediction_error_seconds",
            "Absolute difference between observed and predicted time to first token of streams (before the margin).",
            ["model"],
            metrics.registry,
            ERROR_BUCKETS,
        )

    @property
    def enabled(self) -> bool:
        return self.config.targets.enabled

    def targets(self, identity: Identity, model: str, headers: Mapping[str, str]) -> Targets:
        cfg = self.config.targets
        found = _merge(Targets(), cfg.default)
        found = _merge(found, cfg.models.get(model))
        found = _merge(found, cfg.classes.get(identity.priority_name))
        found = _merge(found, self.config.tenant(identity.tenant).targets)
        return found.looser(_asked(headers, "ttft"), _asked(headers, "tpot"))

    def judge(self, info: RequestInfo, prompt_tokens: int, max_tokens: int | None, targets: Targets) -> Verdict:
        """The verdict on the request's routable candidates now (the router's: the model's replicas, or over a large
        pool a bounded subset, so a verdict costs the same on 16 replicas as on 1,024)."""
        now = time.monotonic()
        replicas = [r for r in self.router.candidates(info) if r.routable(now) and r.role != "prefill"]
        cached = self.router.cached_tokens(info, [r.id for r in replicas])
        predictions = []
        for r in replicas:
            found = min(cached.get(r.id, 0), prompt_tokens)
            uncached, prefix = prompt_tokens - found, pinned_prefix(info.block_hashes, info.block_size, found)
            tokens = r.latency.held_tokens(uncached, r.output_bound(prompt_tokens, max_tokens))
            predictions.append(predict(r.latency_view(), now, tokens, uncached, prefix, found if prefix else 0))
        return judge(predictions, targets)

    def hold(
        self, ctx: RequestContext, replica: Replica, prediction: Prediction, prompt_tokens: int, max_tokens: int | None
    ) -> None:
        """The request's KV and predicted end, on the replica it is predicted best on (moved by `place`)."""
        output = replica.latency.held_tokens(0, replica.output_bound(prompt_tokens, max_tokens))
        ctx.hold_output, ctx.held_on, ctx.prediction = output, replica.id, prediction
        ctx.hold = _held(prediction, output)
        replica.hold(ctx.hold)

    def finish(self, ctx: RequestContext, identity: Identity, targets: Targets | None) -> None:
        """The request ended: its hold released, its outcome counted, its latencies learned."""
        replica = self.replicas.get(ctx.held_on) if ctx.held_on is not None else None
        if replica is not None and ctx.hold is not None:
            replica.release(ctx.hold)
        ctx.held_on, ctx.hold = None, None
        # served: a 200, or a stream whose end reached a client that left before the terminator (its status is set
        # after this)
        served = ctx.status == 200 or ctx.answered
        if targets is not None and served:
            self.outcomes.labels(ctx.model, identity.priority_name, identity.tenant, _outcome(ctx, targets)).inc()
        if replica is None or not served or ctx.routed_at is None or ctx.ttft_s is None or ctx.migrations:
            return  # (a stream whose engine failed: its first token came from one replica, its end from another)
        self._learn(ctx, replica)

    def refused(self, model: str, identity: Identity) -> None:
        self.outcomes.labels(model, identity.priority_name, identity.tenant, "refused").inc()

    def _learn(self, ctx: RequestContext, replica: Replica) -> None:
        """What the answer teaches the replica's model (called as the answer ends: now is its end)."""
        assert ctx.routed_at is not None and ctx.ttft_s is not None
        learner, prediction = replica.latency, ctx.prediction
        sent_ttft = ctx.started + ctx.ttft_s - ctx.routed_at
        sent_e2e = time.monotonic() - ctx.routed_at
        computed = max(0, (ctx.prompt_tokens or 0) - (ctx.cached_tokens or 0))
        output = ctx.completion_tokens or 0
        # the batch it decoded in, as it ran (the prediction's is the batch it joined, before those after it came)
        batch = replica.mean_batch(ctx.batch_mark) if ctx.batch_mark is not None else 1.0
        if ctx.stream:
            if prediction is not None and not ctx.split:
                # the target counts from arrival, and so does the lateness, less the wait in the gateway's own fair
                # queue: that wait is granted apart (at most the target less the prediction); learned as lateness,
                # a queue's waits became the margin, left the next request nothing to wait with, and every queued
                # request timed out: the fair queue's order no longer counted and a flooding tenant won by volume
                raw = prediction.ttft_s - prediction.margin_s
                observed = ctx.ttft_s - ctx.queue_wait_s
                learner.observe_late(observed, raw)
                self.predicted.labels(ctx.model).observe(prediction.ttft_s)
                self.error.labels(ctx.model).observe(abs(observed - raw))
            if prediction is not None and prediction.wait_s == 0.0 and not ctx.split:
                learner.observe_first_token(computed, sent_ttft)
            if output > 1:
                learner.observe_decode(batch, (sent_e2e - sent_ttft) / (output - 1), output)
        elif output > 0:  # a whole answer: decode is what its predicted prefill did not take
            overhead, prefill, _, _ = learner.terms(replica.queue_price.prefill_s_per_token, None)
            decode = sent_e2e - overhead - prefill * computed
            learner.observe_decode(batch, max(0.0, decode) / output, output)


def _held(prediction: Prediction, output: int) -> Held:
    """The KV a request predicted so holds, and the cached run it pins, until its predicted end (tpot: in the batch
    it joins)."""
    end = time.monotonic() + prediction.ttft_s + output * prediction.tpot_s
    return Held(prediction.tokens, end, prediction.prefix, prediction.cached)


def place(ctx: RequestContext, replica: Replica, replicas: ReplicaSet) -> None:
    """The router placed the request on `replica`: its hold (if it has one) moves there, as that replica's own
    prediction (the KV it needs there: its prompt less what that replica holds of it, and the end predicted there).
    The hold of the replica predicted first used to move as it was: where the router found the prompt cached, a
    burst's holds counted every prompt whole, the replicas' KV looked full after a fraction of it, and admission
    sent the rest of the burst to the one replica left with room."""
    if ctx.hold is None or ctx.held_on == replica.id:
        return
    before = replicas.get(ctx.held_on) if ctx.held_on is not None else None
    if before is not None:
        before.release(ctx.hold)
    own = next((p for p in ctx.predictions if p.replica == replica.id), None)
    if own is not None:
        ctx.hold, ctx.prediction = _held(own, ctx.hold_output), own
    ctx.held_on = replica.id
    replica.hold(ctx.hold)


def _outcome(ctx: RequestContext, targets: Targets) -> str:
    if targets.ttft_s is not None and ctx.ttft_s is not None and ctx.ttft_s > targets.ttft_s:
        return "missed"
    if targets.tpot_s is not None and ctx.stream and ctx.ttft_s is not None and ctx.duration_s is not None:
        output = ctx.completion_tokens or 0
        if output > 1 and (ctx.duration_s - ctx.ttft_s) / (output - 1) > targets.tpot_s:
            return "missed"
    return "met"
