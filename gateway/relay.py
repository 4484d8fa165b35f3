"""A stream's two halves: reading the engine's SSE events (`SseSplitter`) and writing the client's (`ClientEvents`).

The proxy (`gateway.proxy`) reads chunks from the engine, splits them into whole events, lets `ClientEvents` turn
them into what the client gets, and writes those. `ClientEvents` records what the request learns on the way (usage,
a stored response's id, the end of the answer) and, for a stream that may continue elsewhere, what was relayed
(`gateway.migration.Relayed`). A continuation's events go into the client's started stream without the assistant
role the client already has, its usage told as the whole answer's; a Messages stream's continuation (chat events)
is told in Anthropic's shape (`gateway.migration.MessagesSeam`). A stream is complete with its API's last event
(`end_marker`): `data: [DONE]` for chat and completions, `message_stop` for the Messages API; an error event of
the engine's (vLLM's `data: {"error": ...}` before its `[DONE]`, the Messages API's `error`) ends it as failed;
other streams end with their body. A stream cut when only that last event
was missing (the engine died as it finished) gets it from the gateway (`ClientEvents.closing`).

Cost per event: one `bytes.find` for its end; one substring check for usage, one a write for an error event
(and, on a stream that may migrate, one `rfind` that moves the engine's continuous usage out of the event, and a
continuation's one `replace` that gives its events the stream's chunk id); where the client did not ask for usage,
one substring check for a finish reason (that event waits for the usage event's `system_fingerprint`); events that
carry a final usage object are
parsed. No event is copied beyond the one join per write.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Protocol

import orjson

from engine_pool.http_client import UpstreamConnectionError
from gateway.answers import answer_id, ends_in_tool_call, split_usage, usage_event, whole_usage, without_role
from gateway.exchange import Exchange
from gateway.migration import Relayed
from gateway.request_parse import ParsedRequest, as_int

DONE = b"data: [DONE]"
_OPENAI_ERROR = b'data: {"error"'  # an error event of a chat or completions stream (vLLM's, mid-stream)
MESSAGE_STOP = b"event: message_stop"
# the Responses API's terminal events: after one the answer is whole (a client may leave before the body's end)
RESPONSE_END = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")
# what vLLM's Responses stream sends before the engine has run anything (its first events come before the queue and
# the prefill): held until the answer's first event, so the stream still starts only with the engine's work
_PREAMBLE = (b"event: response.created", b"event: response.in_progress")
ANTHROPIC_ERROR = b"event: error"
# the stream's last event itself, written by the gateway when the engine's stream was cut right before it
_CLOSING = {DONE: DONE + b"\n\n", MESSAGE_STOP: MESSAGE_STOP + b'\ndata: {"type":"message_stop"}\n\n'}


def end_marker(parsed: ParsedRequest) -> bytes | tuple[bytes, ...] | None:
    """The start of the event that completes a stream of this request (any of several); None: the stream ends with
    its body."""
    if parsed.api == "anthropic":
        return MESSAGE_STOP
    if parsed.records_id:  # the Responses API (the route whose answers are stored responses)
        return RESPONSE_END
    return DONE if parsed.kind in ("chat", "completions") else None


_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def sequence_number(event: bytes) -> int | None:
    """A Responses stream event's `sequence_number`, None when it has none."""
    found = _SEQUENCE.search(event)
    return int(found.group(1)) if found else None


_KEEP = (b"", b"")  # no renaming


def _renaming(event: bytes, relayed: Relayed) -> tuple[bytes, bytes]:
    """From an attempt's first event: the stream's chunk id when it is the first engine's (kept, nothing renamed),
    else (a continuation) its id and the stream's, for its events to carry the stream's."""
    own = _chunk_id(event)
    if relayed.answer_id is None:
        relayed.answer_id = own
        return _KEEP
    return (own, relayed.answer_id) if own and relayed.answer_id and own != relayed.answer_id else _KEEP


def _chunk_id(event: bytes) -> bytes:
    """A chat or completions event's `"id":"..."` (empty when it has none)."""
    start = event.find(b'"id":"')
    end = event.find(b'"', start + 6) if start >= 0 else -1
    return event[start : end + 1] if end >= 0 else b""


def _prompt_tokens(usage: bytes) -> int | None:
    try:
        count = orjson.loads(usage).get("prompt_tokens")
    except (ValueError, AttributeError):
        return None
    return count if isinstance(count, int) and count >= 0 else None


def _leading_events(parsed: ParsedRequest) -> int:
    """The events of a stream before its first token, as vLLM streams them: chat's role, the Messages API's
    message_start and content_block_start, the Responses API's created, in_progress, output item and content part
    added; none for completions."""
    if parsed.api == "anthropic":
        return 2
    if parsed.records_id:
        return 4
    return 1 if parsed.kind == "chat" else 0


def _one_choice(parsed: ParsedRequest) -> bool:
    """A stream of one choice: `n` 1 and, for completions, one prompt (a batch of prompts streams a choice each)."""
    body = parsed.body
    if as_int(body.get("n", 1)) not in (1, None):
        return False
    prompt = body.get("prompt")
    return parsed.kind != "completions" or not isinstance(prompt, list) or len(prompt) <= 1 or type(prompt[0]) is int


def _stamped(held: list[bytes], usage: bytes) -> list[bytes]:
    """The held finish events with the usage event's `system_fingerprint` (where vLLM puts it when no usage event
    follows), as they came when it carries none."""
    try:
        payload = orjson.loads(usage[usage.index(b"{") :])
        fingerprint = payload.get("system_fingerprint") if isinstance(payload, dict) else None
        if not isinstance(fingerprint, str):
            return held
        stamped = []
        for event in held:
            data = orjson.loads(event[event.index(b"{") :])
            data["system_fingerprint"] = fingerprint
            stamped.append(b"data: " + orjson.dumps(data) + b"\n\n")
    except ValueError:
        return held
    return stamped


class Observer(Protocol):
    def observe(self, value: float) -> None: ...


# The largest SSE event an engine may send (a stream's echo or logprobs of a long prompt are megabytes): past it the
# stream fails as cut (every buffer has a bound; a misbehaving engine's endless event is not kept).
MAX_EVENT_BYTES = 64 << 20


class SseSplitter:
    """Whole SSE events (each ending with a blank line) out of the chunks an engine sends; a partial event waits for
    the next chunk, kept as its pieces and joined once, when its end arrives: O(chunk) per chunk (re-joining and
    re-scanning the partial event for every chunk was quadratic: 99 s of the event loop for one 100 MiB event).
    UpstreamConnectionError past `MAX_EVENT_BYTES`."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # the partial event's pieces
        self._size = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        parts = self._parts
        if not parts:
            if chunk.endswith(b"\n\n") and chunk.find(b"\n\n") == len(chunk) - 2:  # one whole event
                return [chunk]
            buf = chunk
        elif b"\n\n" in chunk or (parts[-1].endswith(b"\n") and chunk.startswith(b"\n")):
            buf = b"".join(parts) + chunk
        else:  # still within the partial event
            self._keep(chunk)
            return []
        events: list[bytes] = []
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            events.append(buf[start : end + 2])
            start = end + 2
        parts.clear()
        self._size = 0
        if start < len(buf):
            self._keep(buf[start:] if start else buf)
        return events

    def _keep(self, piece: bytes) -> None:
        self._size += len(piece)
        if self._size > MAX_EVENT_BYTES:
            raise UpstreamConnectionError(f"the engine sent an event of more than {MAX_EVENT_BYTES} bytes")
        self._parts.append(piece)


class ClientEvents:
    """The client's side of one attempt's stream."""

    __slots__ = (
        "_continuing", "_ex", "_held", "_itl", "_last_write", "_renamed", "_stamp", "_tools", "done", "end", "failed",
        "last",
    )  # fmt: skip

    def __init__(self, ex: Exchange, itl: Observer) -> None:
        self._ex = ex
        self._itl = itl
        self._continuing = ex.out.started  # a continuation: the client has the stream's opening already
        self._tools = ex.info.session_key is not None  # watch for a tool call: its session will be back
        self._last_write = 0.0
        parsed = ex.parsed
        # the usage the gateway asked for and the client did not: vLLM then puts its system_fingerprint on the usage
        # event the client does not get, not on the finish event; the finish event waits for it (`_stamped`)
        self._stamp = parsed.kind in ("chat", "completions") and not parsed.include_usage and _one_choice(parsed)
        self._held: list[bytes] = []
        self._renamed: tuple[bytes, bytes] | None = None  # a continuation's chunk id -> the stream's (first engine's)
        self.end = end_marker(parsed)
        if not self._continuing:
            ex.ctx.leading_events = _leading_events(parsed)
        self.done = False  # the answer's end reached the client (`end`); it may leave before the terminator
        self.failed = False  # the engine ended the stream with its own error event
        self.last = b""  # the last event the client got

    def take(self, events: list[bytes]) -> list[bytes]:
        """What the client gets of the engine's `events` (possibly nothing)."""
        ex = self._ex
        relayed = ex.relayed
        out: list[bytes] = []
        before = relayed.tokens_before if relayed is not None else 0
        held, stamp = self._held, self._stamp
        for event in events:
            if self._tools and ends_in_tool_call(event):
                self._tools, ex.ctx.tool_call = False, True
            if relayed is not None:
                if relayed.seam is not None:  # a Messages stream continued through chat
                    out.extend(self._from_chat(event, relayed))
                    continue
                renamed = self._renamed
                if renamed is None:
                    renamed = self._renamed = _renaming(event, relayed)
                if renamed[0]:
                    event = event.replace(renamed[0], renamed[1], 1)
            if self.end is MESSAGE_STOP and event.startswith(DONE):  # an engine's chat terminator after message_stop
                continue
            if b'"usage"' in event and not event.startswith(DONE):
                if held and b'"choices":[]' in event:  # the usage event after the held finish event
                    out.extend(_stamped(held, event))
                    held.clear()
                cut = split_usage(event) if relayed is not None and ex.parsed.kind != "json" else None
                if cut is not None and relayed is not None:  # the engine's running count, asked for by the gateway
                    relayed.usage = cut[1]
                    if not relayed.prompt_read:  # the prompt it computed, known before the answer's end
                        relayed.prompt_read = True
                        if ex.ctx.prompt_tokens is None:
                            ex.ctx.prompt_tokens = _prompt_tokens(cut[1])
                    if not ex.parsed.continuous_usage:  # ... and not by the client
                        event = cut[0]
                    elif before:
                        event = usage_event(event, ex.ctx, False, before)
                else:
                    event = usage_event(event, ex.ctx, not ex.parsed.include_usage, before)
            if self._continuing and b'"role"' in event:
                event = without_role(event)
            if ex.parsed.stores_answer and ex.ctx.answer_id is None and b'"response"' in event:
                ex.ctx.answer_id = answer_id(event[event.find(b"{") :])
                if ex.ctx.answer_id is not None and ex.on_answer_id is not None:
                    ex.on_answer_id(ex.ctx.answer_id)
            if event:
                if held:  # another event after it: the finish event goes out as it came
                    out.extend(held)
                    held.clear()
                if stamp and b'"finish_reason":"' in event:
                    held.append(event)
                    continue
                out.append(event)
        if out:
            self._continuing = False
        return out

    def preamble(self, events: list[bytes]) -> bool:
        """Whether every one of `events` is a Responses stream's preamble (`_PREAMBLE`): sent before the engine ran
        anything, they do not start the client's stream (a replica that then fails is still retried, and the first
        token is waited for `first_byte_s`, not `stream_idle_s`)."""
        return self.end is RESPONSE_END and all(e.startswith(_PREAMBLE) for e in events)

    def flush(self) -> list[bytes]:
        """What `take` holds back, for the client when the engine's stream ends without the usage event."""
        held = self._held[:]
        self._held.clear()
        return held

    def _from_chat(self, event: bytes, relayed: Relayed) -> list[bytes]:
        """A chat continuation's event as the Anthropic events the client gets; its usage recorded as the whole
        answer's (`MessagesSeam`)."""
        assert relayed.seam is not None
        cut = split_usage(event)
        if cut is not None:  # the running count: what a further migration starts from
            event, relayed.usage = cut
        translated, usage = relayed.seam.translate(event, relayed.tokens_before, self._ex.ctx.prompt_tokens)
        if usage is not None:
            self._ex.ctx.set_usage(whole_usage(usage, relayed.tokens_before, self._ex.ctx.prompt_tokens))
        return translated

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        """The client's response begins (unless a continuation joins a stream already begun)."""
        ex = self._ex
        self._last_write = time.monotonic()
        if not ex.out.started:
            await ex.out.start_stream(
                status, {**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            ex.ctx.ttft_s = self._last_write - ex.ctx.started

    async def write(self, events: list[bytes], first: bool) -> None:
        now = time.monotonic()
        self.last = events[-1]
        end = self.end
        # any event of the batch (chunks that arrived together are one batch: an end event may come with more)
        ends = end is not None and any(e.startswith(end) for e in events)
        if not first and not ends:  # a gap between tokens (the answer's closing events are not one)
            self._itl.observe(now - self._last_write)
        self._last_write = now
        data = b"".join(events)
        self._ex.ctx.events_sent += len(events)
        if self._ex.relayed is not None:
            self._ex.relayed.add(events, len(data))
        await self._ex.out.write(data)
        if end is DONE and _OPENAI_ERROR in data:  # vLLM's own error event (then `[DONE]`); a JSON string
            self.failed = True  # escapes its quotes, so only an event can hold these bytes
        if ends:
            self.done = self._ex.ctx.answered = True
        elif end is MESSAGE_STOP and any(e.startswith(ANTHROPIC_ERROR) for e in events):
            self.failed = True

    def closing(self) -> bytes | None:
        """The stream's last event when everything of the answer but that event reached the client (the engine's
        stream was cut between them: the answer is whole), else None. Whole: a Messages stream's last event was
        `message_delta` (its stop reason and usage); a chat or completions stream's (of one choice) carried a
        `finish_reason` (and the client asked for no usage event), or was the usage event after it. Read when a
        stream is cut, not per event."""
        end, last = self.end, self.last
        closing = _CLOSING.get(end) if isinstance(end, bytes) else None
        if closing is None or not last or self.failed:
            return None
        if end is MESSAGE_STOP:
            return closing if last.startswith(b"event: message_delta") else None
        if not _one_choice(self._ex.parsed):  # another choice may still be open
            return None
        try:
            payload = orjson.loads(last[last.index(b"{") :])
        except ValueError:
            return None
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list):
            return None
        if not choices:  # the usage event after the last choice's finish
            return closing if isinstance(payload.get("usage"), dict) else None
        if not all(isinstance(c, dict) and c.get("finish_reason") for c in choices):
            return None
        if self._ex.parsed.include_usage:  # the usage event the client asked for was still to come: not whole
            return None
        return closing
