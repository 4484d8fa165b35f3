"""Per-request record: filled as the request moves through the gateway, read by the access log and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.errors import ApiShape
from policies.latency import Held, Prediction

# A speech model's encoder positions per second of audio (Whisper: 1,500 per 30-s window), what a transcription's
# usage in seconds is charged as; and the most bytes a second of audio takes in a request (16 kHz 16-bit PCM, the
# rate these models read: compressed audio is more seconds per byte), what an upload is estimated at before then
AUDIO_TOKENS_PER_S = 50
AUDIO_BYTES_PER_S = 32_000


@dataclass(slots=True)
class TraceIds:
    """A traced request's ids (gateway.tracing): its trace, the client's span, its own and the upstream call's."""

    trace_id: int
    parent_span_id: int | None  # the client's span, when it sent a traceparent
    request_span_id: int
    upstream_span_id: int

    def upstream_traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.upstream_span_id:016x}-01"


@dataclass(slots=True)
class RequestContext:
    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    tenant: str = "-"
    model: str = "-"
    replica: str = "-"
    route_reason: str = "-"
    status: int = 0
    attempts: int = 0
    stream: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    ttft_s: float | None = None
    duration_s: float | None = None
    queue_wait_s: float = 0.0
    error: str | None = None
    migrations: int = 0  # times the stream continued on another replica after its engine failed
    client_disconnected: bool = False
    answer_id: str | None = None  # the answer's `id` where the endpoint records it (stored responses)
    answered: bool = False  # the engine's whole answer reached the client (who may still leave before its end)
    events_sent: int = 0  # a stream's events written to the client (`delivered_tokens` without a usage)
    leading_events: int = 1  # of those, the events before its first token (chat's role, Messages' message_start...)
    tool_call: bool = False  # the answer ended in a tool call (watched for requests of a session only)
    split: bool = False  # a prefill replica computed the prompt and the answering replica loaded its KV
    prefill_done_at: float | None = None  # time.monotonic() when a split request's prefill step answered
    # admission by predicted latency (gateway.admission.targets): the KV the request holds and where, its prediction
    hold: Held | None = None
    held_on: str | None = None
    prediction: Prediction | None = None
    predictions: tuple[Prediction, ...] = ()  # on each replica weighed: a hold moved by the route takes its own
    hold_output: int = 0  # the output tokens the hold counts
    # the answering replica's `batch_mark` as the decode began (its first token; its send for a whole answer)
    batch_mark: tuple[float, float] | None = None
    prefer: tuple[str, ...] = ()  # where admission wants it routed first (policies.latency.judge; () = anywhere)
    extra_headers: dict[str, str] = field(default_factory=dict)  # e.g. x-ratelimit-*, added to every response
    # tracing (gateway.tracing): the ids of a sampled request, and when its stages ended (time.monotonic())
    trace: TraceIds | None = None
    client_traceparent: str | None = None  # not traced here (off, or not sampled): the client's, passed on as it came
    client_tracestate: str | None = None  # the client's, passed on with either traceparent
    admitted_at: float | None = None
    refused_at: float | None = None  # admission refused it (authentication, quota, latency targets, the queue)
    route_started: float | None = None
    routed_at: float | None = None
    sent_at: float | None = None
    api: ApiShape = "openai"  # the route's API shape: its errors and rate-limit headers (gateway.endpoints)
    # the engine computes KV for it (`Endpoint.computes_kv`): it takes a capacity slot, its tokens are counted and
    # charged, its latencies sampled; False: counting, rendering, a stored response read, a realtime session
    computed: bool = True

    def delivered_tokens(self) -> int:
        """The completion tokens as the engine reported them; for a stream cut before its final usage (the client
        left, the engine failed), one a token event after its leading ones (`leading_events`), at least the count
        the engine reported so far: what the tenant is charged."""
        if self.completion_tokens is not None and (self.answered or not self.stream):
            return self.completion_tokens
        return max(self.completion_tokens or 0, self.events_sent - self.leading_events)

    def completion_shown(self) -> int | None:
        """The completion tokens the access log and traces show: a stream's delivered ones (`delivered_tokens`), a
        whole answer's as its usage reports them (None: it reports none)."""
        return self.delivered_tokens() if self.events_sent else self.completion_tokens

    def cache_hits(self) -> int:
        """The prompt tokens its engine found cached: what metrics count as hits and quotas charge less for; none
        for a split request, whose cached tokens (as the engine reports them) are the KV its prefill step computed
        and handed over."""
        return 0 if self.split else self.cached_tokens or 0

    def set_usage(self, usage: object) -> None:
        """Token counts from an answer's `usage`: chat and completions' names, the Responses API's, or the Messages
        API's, whose `input_tokens` are only the uncached ones (the prompt is those plus `cache_read_input_tokens`
        and `cache_creation_input_tokens`, as vLLM reports them); a transcription's audio seconds (`"type":
        "duration"`) as the prompt positions its encoder computed (`AUDIO_TOKENS_PER_S`)."""
        if not isinstance(usage, dict):
            return
        if usage.get("type") == "duration" and isinstance(seconds := usage.get("seconds"), int | float):
            usage = {"prompt_tokens": round(seconds * AUDIO_TOKENS_PER_S)}  # a transcription's: its audio
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        cache_read = usage.get("cache_read_input_tokens")
        if isinstance(prompt, int) and isinstance(cache_read, int):  # Anthropic's usage
            created = usage.get("cache_creation_input_tokens")
            prompt += cache_read + (created if isinstance(created, int) else 0)
        self.prompt_tokens = prompt if isinstance(prompt, int) else self.prompt_tokens
        self.completion_tokens = completion if isinstance(completion, int) else self.completion_tokens
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        if isinstance(cache_read, int):
            self.cached_tokens = cache_read
        elif isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]
        elif self.prompt_tokens is not None and self.cached_tokens is None:
            self.cached_tokens = 0
