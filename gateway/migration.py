"""Request migration: a chat or completions stream whose engine fails after the first token continues on another
replica, in the same client stream (retry.migrate_streams).

While a stream is relayed, `Delivered` keeps the events that reached the client (references to the bytes already
read, bounded by `retry.migration_buffer_bytes`; past it the stream is not migratable); nothing is parsed on the
way. When the engine fails mid-stream, `continuation` parses those events once: the text delivered and the number
of tokens (one content event per token, as vLLM streams), and builds the request that continues the answer: for
completions the prompt followed by the text; for chat the partial assistant message continued
(`continue_final_message: true`, `add_generation_prompt: false`, as vLLM takes it); `max_tokens` (or
`max_completion_tokens`) less the tokens delivered. At temperature 0 the continued answer is the undisturbed one.
The continuation's first chat event (the assistant role) is dropped, and its usage is told as the whole answer's:
the tokens delivered move from its prompt to the completion (`whole_usage`). Requests that cannot be continued
exactly are not migrated: n > 1, tools, echo, suffix, batched or token-id prompts, logprobs of the prompt.
Cost: one list append per relayed event; O(delivered bytes) once per migration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Delivered:
    """The events of one stream relayed so far (their bytes, not copies)."""

    limit_bytes: int
    events: list[bytes] = field(default_factory=list)
    size: int = 0
    tokens_before: int = 0  # tokens delivered by earlier engines of this stream (after a migration)
    migrations: int = 0

    def add(self, events: list[bytes], size: int) -> None:
        """Keep `events` (`size` bytes in all) while within the bound."""
        if self.size <= self.limit_bytes:
            self.events.extend(events)
            self.size += size

    @property
    def within_bound(self) -> bool:
        return self.size <= self.limit_bytes


def migratable(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether a request's stream can be continued exactly on another engine."""
    if endpoint not in ("chat", "completions") or body.get("n") not in (None, 1) or body.get("prompt_logprobs"):
        return False
    if endpoint == "chat":
        return not body.get("tools") and isinstance(body.get("messages"), list)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str) and not body.get("echo") and body.get("suffix") is None


def _delivered_text(endpoint: str, events: list[bytes]) -> tuple[str, int, bool]:
    """The text the events carried, how many events carried some (tokens), and whether the answer had finished
    (a `finish_reason`: nothing to continue)."""
    parts: list[str] = []
    finished = False
    for event in events:
        start = event.find(b"{")
        if start < 0:
            continue
        try:
            payload = json.loads(event[start:])
            choice = payload["choices"][0]
            text = choice["delta"].get("content") if endpoint == "chat" else choice.get("text")
            finished = finished or choice.get("finish_reason") is not None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue  # a usage-only event, an error event: no text
        if isinstance(text, str) and text:
            parts.append(text)
    return "".join(parts), len(parts), finished


def continuation(endpoint: str, sent: bytes, delivered: Delivered) -> tuple[bytes, int] | None:
    """The body that continues the answer from what was delivered (`sent`: the body the engine got), and the
    tokens delivered by this engine; None when nothing is left to generate (the answer finished, or max_tokens
    reached) or the body cannot be rebuilt."""
    text, tokens, finished = _delivered_text(endpoint, delivered.events)
    if finished:
        return None
    try:
        body = json.loads(sent)
    except ValueError:
        return None
    limit_key = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if limit_key is not None:
        left = int(body[limit_key]) - tokens
        if left < 1:
            return None
        body[limit_key] = left
    if endpoint == "completions":
        prompt = body["prompt"]
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
    else:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict) and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + text}  # the client's own prefill, continued
        else:
            messages.append({"role": "assistant", "content": text})
        body["messages"] = messages
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    delivered.events.clear()
    delivered.size = 0
    return json.dumps(body, separators=(",", ":")).encode(), tokens


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
