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
The continuation's opening role is dropped from its first chat events (`gateway.answers.without_role`: the
field, not the event, which may carry the first token too), and its usage is told as the whole answer's: the tokens
delivered move from its prompt to the completion (`gateway.answers.whole_usage`). Requests that cannot be continued
exactly are not migrated: n > 1, tools, structured output, echo, suffix, batched or token-id prompts, logprobs of
the prompt (`min_tokens`, like `max_tokens`, counts from the continuation's start).
A Messages API stream (`/v1/messages`) is continued through chat: vLLM's Messages route cannot continue an assistant
turn (it renders a trailing assistant message with a new generation prompt), so the continuation is the chat
request vLLM renders for the body (`gateway.anthropic.messages_as_chat`) with the text delivered as the assistant's
message continued, sent to `/v1/chat/completions`, and its events are told to the client in Anthropic's shape
(`MessagesSeam`: text deltas into the open text block, then the block's stop, `message_delta` with the whole
answer's output tokens and `message_stop`); only a text conversation (no image or tool block) with no field the
chat request would not carry (tools, thinking, structured output) is, and only while the answer is one text block
(a reasoning model's thinking block, a tool call: the stream ends with an error event instead).
An answer that needs no continuation (`Relayed.ended`: its finish reason delivered with the usage the client asked
for still to come, its max_tokens reached, or a continuation refused because the answer so far fills the context)
ends as its engine would have ended it: `closing` writes its finish reason, its usage and its last event.
Cost: one list append per relayed event; O(delivered bytes) once per migration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.anthropic import messages_as_chat
from gateway.request_parse import ParsedRequest, encode, engine_fields

CHAT_PATH = "/v1/chat/completions"  # where a Messages stream continues
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}  # chat's finish_reason as Anthropic's stop_reason


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


@dataclass(slots=True)
class MessagesSeam:
    """A Messages stream continued through chat: the continuation's chat events as the client's Anthropic ones."""

    index: int  # the client's open text block
    stop_reason: str | None = None
    stop_sequence: str | None = None  # the stop string the continuation matched (its choice's `stop_reason`)
    completion: int = 0  # the continuation's own output tokens (its usage)
    cached: int | None = None  # the continuation's cached prompt tokens (its usage), when the engine reports them
    failed: bool = False  # the continuation ended with the engine's error event: told as Anthropic's, nothing after

    def translate(
        self, event: bytes, tokens_before: int, prompt_tokens: int | None = None
    ) -> tuple[list[bytes], dict[str, Any] | None]:
        """The Anthropic events for one chat event, and the usage it carried (None if none). `prompt_tokens`: the
        client's prompt as its message_start counted it; the closing message_delta then splits it into uncached and
        cached as vLLM's does (the cached tokens the continuation's, at most the prompt: `whole_usage`), so the
        client's usage is the one the gateway records. The engine's error event (vLLM's, mid-stream) is Anthropic's
        `error` event, and ends the client's stream: not a clean `end_turn` on an answer cut short."""
        if self.failed:
            return [], None
        if event.startswith(b"data: [DONE]"):
            totals = {"output_tokens": tokens_before + self.completion}
            if prompt_tokens is not None and self.cached is not None:
                cached = min(self.cached, prompt_tokens)
                totals = {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached, **totals}
            stopped = {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": self.stop_sequence}
            end = {"delta": stopped, "usage": totals}
            stop = _sse("content_block_stop", {"index": self.index})
            return [stop, _sse("message_delta", end), _sse("message_stop", {})], None
        try:
            payload = orjson.loads(event[event.index(b"{") :])
        except ValueError:
            return [], None
        if isinstance(payload, dict) and isinstance(error := payload.get("error"), dict):
            self.failed = True
            message = error.get("message") if isinstance(error.get("message"), str) else "the engine failed"
            return [b"event: error\ndata: " + orjson.dumps({"type": "error", "error": {
                "type": "api_error", "message": message}}) + b"\n\n"], None  # fmt: skip
        usage = payload.get("usage") if isinstance(payload, dict) else None
        out: list[bytes] = []
        for choice in payload.get("choices") or () if isinstance(payload, dict) else ():
            chunk = choice.get("delta") if isinstance(choice, dict) else None
            text = chunk.get("content") if isinstance(chunk, dict) else None
            if isinstance(text, str) and text:
                text_delta = {"index": self.index, "delta": {"type": "text_delta", "text": text}}
                out.append(_sse("content_block_delta", text_delta))
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.stop_reason = _STOP_REASONS.get(choice["finish_reason"], "end_turn")
                if choice["finish_reason"] == "stop" and isinstance(matched := choice.get("stop_reason"), str):
                    self.stop_reason, self.stop_sequence = "stop_sequence", matched  # vLLM: the stop string met
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached = details["cached_tokens"]
            return out, usage
        return out, None


@dataclass(slots=True)
class Relayed:
    """The events of one stream relayed so far (their bytes, not copies)."""

    limit_bytes: int
    events: list[bytes] = field(default_factory=list)
    size: int = 0
    tokens_before: int = 0  # tokens delivered by earlier engines of this stream (after a migration)
    migrations: int = 0
    usage: bytes | None = None  # the current engine's last usage object sent with a token (JSON, not parsed)
    answer_id: bytes | None = None  # the first engine's chunk `id` (`"id":"..."`): a continuation's events carry it
    prompt_read: bool = False  # the prompt count was read from a running usage (once a stream)
    text_before: str = ""  # the text delivered by earlier engines of this stream
    seam: MessagesSeam | None = None  # a Messages stream continued through chat
    # why the answer needs no continuation, once `continuation` or the refused one found it: "finished" (its finish
    # reason reached the client) or "length" (max_tokens, or the context, reached); `closing` then ends it
    ended: str | None = None
    template: bytes | None = None  # the last chat or completions event delivered with a choice (closing's model)

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
    if parsed.api == "anthropic":  # the Messages API: text answers, continued through chat (see the module's doc)
        messages = body.get("messages")
        if not body.keys() <= _MESSAGES_CARRIED or not isinstance(messages, list) or not messages:
            return False  # a field the chat continuation would not carry (tools, thinking, output_config, ...)
        if not _text_only(body.get("system")) or not all(
            isinstance(m, dict) and _text_only(m.get("content")) for m in messages
        ):
            return False  # images, tool turns: the chat view hashes them, it does not render them for an engine
        # the client's own prefill is not continued; a body without a chat view (routed by load) makes no
        # continuation (`continuation` returns None): the stream then ends with an error event
        return messages[-1].get("role") != "assistant"
    if parsed.kind not in ("chat", "completions") or body.get("n") not in (None, 1) or body.get("prompt_logprobs"):
        return False
    if any(body.get(k) is not None for k in _CONSTRAINTS) or body.get("response_format") not in (None, _TEXT):
        return False  # a grammar would start over on the continuation: the joined answer would not match it
    if parsed.kind == "chat":
        return not body.get("tools") and isinstance(body.get("messages"), list)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str) and not body.get("echo") and body.get("suffix") is None


# the Messages fields a continuation through chat carries (`_messages_continuation`); a body with any other is not
# migrated
_MESSAGES_CARRIED = frozenset(
    {"model", "messages", "system", "max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences",
     "metadata", "cache_salt"}
)  # fmt: skip


# structured output (vLLM's and its older guided decoding fields): its grammar cannot be resumed mid-answer
_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_TEXT = {"type": "text"}  # the response_format that constrains nothing


def _text_only(content: object) -> bool:
    """A Messages `system` or message content of text alone (absent, a string, or text blocks)."""
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content)


def _delivered_text(kind: str, events: list[bytes]) -> tuple[str, int, bool, bool]:
    """The text the events carried, how many events carried some, whether the answer had finished (a
    `finish_reason`: nothing to continue), and whether a chat answer carried reasoning (an engine's reasoning
    parser's `reasoning_content` / `reasoning`: a continuation would think again from scratch, its budget spent)."""
    parts: list[str] = []
    finished = reasoned = False
    for event in events:
        start = event.find(b"{")
        if start < 0:
            continue
        try:
            payload = orjson.loads(event[start:])
            choice = payload["choices"][0]
            delta = choice["delta"] if kind == "chat" else None
            text = delta.get("content") if delta is not None else choice.get("text")
            reasoned = reasoned or (
                delta is not None and bool(delta.get("reasoning_content") or delta.get("reasoning"))
            )
            finished = finished or choice.get("finish_reason") is not None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue  # a usage-only event, an error event: no text
        if isinstance(text, str) and text:
            parts.append(text)
    return "".join(parts), len(parts), finished, reasoned


def _last_choice(events: list[bytes]) -> bytes | None:
    """The last of the events that carries a choice (a usage-only or error event carries none)."""
    for event in reversed(events):
        if b'"choices":[{' in event or b'"choices": [{' in event:
            return event
    return None


def _delivered_messages_text(events: list[bytes]) -> tuple[str, int, bool, int]:
    """A Messages stream's text, its count of text deltas, whether the answer cannot be continued (its text block or
    the message stopped, or it opened a block other than text: a reasoning model's thinking, a tool call, which a
    chat continuation cannot go on with) and the index of its text block."""
    parts: list[str] = []
    finished, index = False, 0
    for event in events:
        if event.startswith((b"event: content_block_stop", b"event: message_delta", b"event: message_stop")):
            finished = True
        elif event.startswith(b"event: content_block_start"):
            try:
                block = orjson.loads(event[event.index(b"{") :])["content_block"]["type"]
            except (ValueError, KeyError, TypeError):
                block = None
            finished = finished or block != "text"
        elif event.startswith(b"event: content_block_delta"):
            try:
                payload = orjson.loads(event[event.index(b"{") :])
                delta, index = payload["delta"], payload.get("index", index)
                text = delta.get("text") if delta.get("type") == "text_delta" else None
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if isinstance(text, str) and text:
                parts.append(text)
    return "".join(parts), len(parts), finished, index


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
    index, reasoned = 0, False
    if parsed.api == "anthropic":  # what the client got is in Anthropic's shape, continuations' events included
        text, events, finished, index = _delivered_messages_text(relayed.events)
    else:
        text, events, finished, reasoned = _delivered_text(parsed.kind, relayed.events)
        relayed.template = _last_choice(relayed.events) or relayed.template
    reported = _engine_tokens(relayed.usage)
    relayed.tokens_before += reported if reported is not None else events
    relayed.text_before += text
    relayed.events.clear()
    relayed.size, relayed.usage = 0, None
    if finished:  # a Messages answer's stopped or other block cannot be closed here (`closing`)
        relayed.ended = "finished" if parsed.api == "openai" else None
        return None
    if reasoned:  # not continued (and not `ended`): the stream ends with its error event
        return None
    if parsed.api == "anthropic":
        return _messages_continuation(parsed, relayed, index)
    body = engine_fields(parsed, usage_stats=True)
    limit_key = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if limit_key is not None:
        left = int(body[limit_key]) - relayed.tokens_before
        if left < 1:
            relayed.ended = "length"
            return None
        body[limit_key] = left
    if isinstance(body.get("min_tokens"), int):  # counted from the continuation's start, as max_tokens is
        body["min_tokens"] = max(0, body["min_tokens"] - relayed.tokens_before)
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


def _messages_continuation(parsed: ParsedRequest, relayed: Relayed, index: int) -> bytes | None:
    """The chat request that continues a Messages answer (its body's chat view, the text delivered as the assistant
    message continued, the sampling fields it names), with the seam that tells its events in Anthropic's shape."""
    body = parsed.body
    if relayed.seam is None:
        relayed.seam = MessagesSeam(index)
    left = int(body["max_tokens"]) - relayed.tokens_before
    if left < 1:
        relayed.ended = "length"
        return None
    chat = messages_as_chat(body)
    if chat is None:
        return None
    out: dict[str, Any] = {
        "model": parsed.model,
        "messages": [*chat["messages"], {"role": "assistant", "content": relayed.text_before}],
        "max_tokens": left, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "continue_final_message": True, "add_generation_prompt": False,
    }  # fmt: skip
    for name, chat_name in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                            ("stop_sequences", "stop"), ("cache_salt", "cache_salt")):  # fmt: skip
        if body.get(name) is not None:
            out[chat_name] = body[name]
    return encode(out, parsed)


# an engine's refusal of a prompt that alone fills its context, with the context's length and the prompt's: vLLM's
# ("maximum context length is L tokens. However, your prompt contains [at least] N input tokens", "The decoder
# prompt (length N) is longer than the maximum model length of L"), its older one ("... L tokens. However, you
# requested M tokens (N in the messages, K in the completion)"), the simulator's ("... your request has N input
# tokens")
_CONTEXT = re.compile(r"maximum context length is (\d+) tokens.*?(?<!\d)(\d+) (?:input tokens|in the messages)", re.S)
_MODEL_LENGTH = re.compile(r"prompt \(length (\d+)\) is longer than the maximum model length of (\d+)")


def context_full(status: int, message: str) -> bool:
    """Whether an engine refused a continuation because its prompt alone (the answer so far) fills the context: the
    answer then ends as it would have, at its length (a refusal of the prompt with its max_tokens is not one)."""
    if status != 400:
        return False
    if found := _CONTEXT.search(message):
        return int(found[2]) >= int(found[1])
    if found := _MODEL_LENGTH.search(message):
        return int(found[1]) > int(found[2])
    return False


def closing(parsed: ParsedRequest, relayed: Relayed, prompt_tokens: int | None) -> tuple[bytes, dict[str, int]] | None:
    """The events that end, as its engine would have, a stream whose answer needs no continuation
    (`relayed.ended`), and the whole answer's usage; None where the gateway cannot write them (a Messages answer
    that stopped or opened another block, a chat or completions stream with no choice delivered). Chat and
    completions: the finish reason `length` (unless delivered), the usage event when the client asked for one, then
    `[DONE]`, each on the model of the last event delivered (its id, created, model); Messages: the text block's
    stop, `message_delta` with `max_tokens` and the output tokens, `message_stop`."""
    if relayed.ended is None:
        return None
    usage = {"completion_tokens": relayed.tokens_before}
    if prompt_tokens is not None:
        usage = {"prompt_tokens": prompt_tokens, **usage, "total_tokens": prompt_tokens + relayed.tokens_before}
    if parsed.api == "anthropic":
        seam = relayed.seam
        if seam is None or relayed.ended != "length":
            return None
        seam.stop_reason, seam.completion = "max_tokens", 0
        return b"".join(seam.translate(b"data: [DONE]", relayed.tokens_before, prompt_tokens)[0]), usage
    try:
        base = orjson.loads(relayed.template[relayed.template.index(b"{") :]) if relayed.template else None
    except ValueError:
        base = None
    if not isinstance(base, dict):
        return None
    for name in ("usage", "prompt_token_ids", "prompt_text"):  # the answer's first event may carry the latter two
        base.pop(name, None)
    out = []
    if relayed.ended == "length":  # the finish chunk as vLLM writes it
        if parsed.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        choice["stop_reason"] = None
        out.append(b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n")
    if parsed.include_usage and prompt_tokens is not None:
        out.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out), usage
