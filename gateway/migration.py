"""Request migration: a chat or completions stream whose engine fails after the first token continues on another
replica, in the same client stream (retry.migrate_streams).

While a stream is relayed, `Relayed` keeps the events that reached the client (references to the bytes already
read, bounded by `retry.migration_buffer_bytes`; past it the stream is not migratable) and the last usage the engine
reported with a token (the gateway asks for `continuous_usage_stats` on such streams: `engine_body`); nothing is
parsed on the way. When the engine fails mid-stream, `continuation` parses those events once: the text delivered
and the number of tokens as the engine counted them (its last usage; one per content event only from an engine that
reports none), and builds the request that continues the answer: for
completions the prompt followed by the text; for chat the partial assistant message continued
(`continue_final_message: true`, `add_generation_prompt: false`, as vLLM takes it); `max_tokens` (or
`max_completion_tokens`) less the tokens delivered. At temperature 0 the continued answer is the undisturbed one.
The continuation's opening role is dropped from its first chat events (`without_role`: the field, not the event,
which may carry the first token too), and its usage is told as the whole answer's: the tokens delivered move from
its prompt to the completion (`whole_usage`). Requests that cannot be continued
exactly are not migrated: n > 1, tools, echo, suffix, batched or token-id prompts, logprobs of the prompt.
Cost: one list append per relayed event; O(delivered bytes) once per migration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.request_parse import ParsedRequest, encode, engine_fields


@dataclass(slots=True)
class Relayed:
    """The events of one stream relayed so far (their bytes, not copies)."""

    limit_bytes: int
    events: list[bytes] = field(default_factory=list)
    size: int = 0
    tokens_before: int = 0  # tokens delivered by earlier engines of this stream (after a migration)
    migrations: int = 0
    usage: bytes | None = None  # the current engine's last usage object sent with a token (JSON, not parsed)
    text_before: str = ""  # the text delivered by earlier engines of this stream

    def add(self, events: list[bytes], size: int) -> None:
        """Keep `events` (`size` bytes in all) while within the bound."""
        if self.size <= self.limit_bytes:
            self.events.extend(events)
            self.size += size

    @property
    def within_bound(self) -> bool:
        return self.size <= self.limit_bytes


def migratable(parsed: ParsedRequest) -> bool:
    """Whether a request's stream can be continued exactly on another engine."""
    body = parsed.body
    if parsed.kind not in ("chat", "completions") or body.get("n") not in (None, 1) or body.get("prompt_logprobs"):
        return False
    if parsed.kind == "chat":
        return not body.get("tools") and isinstance(body.get("messages"), list)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str) and not body.get("echo") and body.get("suffix") is None


def _delivered_text(kind: str, events: list[bytes]) -> tuple[str, int, bool]:
    """The text the events carried, how many events carried some, and whether the answer had finished (a
    `finish_reason`: nothing to continue)."""
    parts: list[str] = []
    finished = False
    for event in events:
        start = event.find(b"{")
        if start < 0:
            continue
        try:
            payload = orjson.loads(event[start:])
            choice = payload["choices"][0]
            text = choice["delta"].get("content") if kind == "chat" else choice.get("text")
            finished = finished or choice.get("finish_reason") is not None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue  # a usage-only event, an error event: no text
        if isinstance(text, str) and text:
            parts.append(text)
    return "".join(parts), len(parts), finished


def _engine_tokens(usage: bytes | None) -> int | None:
    try:
        count = orjson.loads(usage)["completion_tokens"] if usage is not None else None
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    return count if isinstance(count, int) and count >= 0 else None


def continuation(parsed: ParsedRequest, relayed: Relayed) -> bytes | None:
    """The body that continues the answer from everything relayed so far, built from the client's request as the
    gateway sends it (`engine_fields`); None when nothing is left to generate (the answer finished, or max_tokens
    reached). Moves this engine's text and tokens into `relayed`'s totals."""
    text, events, finished = _delivered_text(parsed.kind, relayed.events)
    if finished:
        return None
    reported = _engine_tokens(relayed.usage)
    relayed.tokens_before += reported if reported is not None else events
    relayed.text_before += text
    relayed.events.clear()
    relayed.size, relayed.usage = 0, None
    body = engine_fields(parsed, usage_stats=True)
    limit_key = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if limit_key is not None:
        left = int(body[limit_key]) - relayed.tokens_before
        if left < 1:
            return None
        body[limit_key] = left
    if parsed.kind == "completions":
        prompt = body["prompt"]
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + relayed.text_before
    else:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict) and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + relayed.text_before}  # the client's own prefill
        else:
            messages.append({"role": "assistant", "content": relayed.text_before})
        body["messages"] = messages
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    return encode(body, parsed)


def without_role(event: bytes) -> bytes:
    """A continuation's chat event without the assistant role the client already has: the field is removed and
    the event kept when it carries anything else (its first token, a finish reason); b"" when the role was all."""
    try:
        payload = orjson.loads(event[event.index(b"{") :])
        choices = payload["choices"]
    except (ValueError, KeyError, TypeError):
        return event
    kept = False
    for choice in choices if isinstance(choices, list) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict):
            delta.pop("role", None)
            kept = kept or any(v not in (None, "") for v in delta.values()) or choice.get("finish_reason") is not None
    if not kept and not payload.get("usage"):
        return b""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


_USAGE_KEY = b',"usage":'


def split_usage(event: bytes) -> tuple[bytes, bytes] | None:
    """A token event's trailing usage (continuous usage stats, the object's last key as vLLM writes it): (the
    event without it, the usage object's bytes), by three searches and no parsing; None for any other shape, and
    for the final usage-only event (no choices), which is the answer's usage, not a running count."""
    cut = event.rfind(_USAGE_KEY)
    if cut < 0 or not event.endswith(b"}\n\n") or b'"choices"' in event[cut:] or b'"choices":[]' in event:
        return None
    return event[:cut] + b"}\n\n", event[cut + len(_USAGE_KEY) : -3]


def whole_usage(usage: dict[str, Any], tokens_before: int) -> dict[str, Any]:
    """A continuation's usage as the whole answer's: its prompt held the tokens delivered before. The completion
    count is exact; the prompt's is the continuation's less those tokens, exact when the engine tokenizes the text
    delivered into the tokens it generated (a BPE tokenizer may merge them differently at the seam)."""
    out = dict(usage)
    if isinstance(out.get("prompt_tokens"), int):
        out["prompt_tokens"] = max(0, out["prompt_tokens"] - tokens_before)
    if isinstance(out.get("completion_tokens"), int):
        out["completion_tokens"] += tokens_before
    if isinstance(out.get("prompt_tokens"), int) and isinstance(out.get("completion_tokens"), int):
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    details = out.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], out["prompt_tokens"])}
    return out
