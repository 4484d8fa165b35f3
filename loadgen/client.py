"""Async streaming client for an OpenAI-compatible endpoint (kvgate or a bare vLLM), one request at a time.

Per request it measures, from the moment the request is written: time to first token (first streamed chunk that
carries generated text), end-to-end latency (the `[DONE]` line or the end of the stream), TPOT =
(e2e - ttft) / (completion_tokens - 1), and reads prompt / cached / completion tokens from the final usage chunk
(`stream_options.include_usage`). When the server sends no usage, completion tokens fall back to the number of
text-bearing chunks and `usage_present` is False. Errors are classified, never raised: `http_<status>` or the
OpenAI error `type` of the body, `timeout`, `connection`, `stream_error` (an error object inside the stream) and
`incomplete_stream` (no `[DONE]`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

Message = tuple[str, str]  # (role, content)
REPLICA_HEADER = "x-kvgate-replica"
_MAX_ERROR_CHARS = 300
MAX_ITL_SAMPLES = 1024  # per request: bounds what a long run keeps in memory


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload. For turn > 0 the runner prepends the session's history (earlier messages and
    the assistant's answers) to `messages`."""

    session_id: str
    user_id: str
    turn: int
    messages: tuple[Message, ...]
    max_tokens: int
    arrival_s: float | None = None  # offset from the start of the run (trace replay); None = arrival process
    think_s: float = 0.0  # pause after the previous turn's answer before this turn is sent
    headers: tuple[tuple[str, str], ...] = ()
    send_user: bool = False  # send OpenAI's `user` field = user_id (chat apps do; kvgate keys sessions on it)
    est_prompt_tokens: int = 0  # workload's own estimate of the new text, for reporting
    group: int | None = None  # shared-prefix group
    final: bool = True  # last turn of its session
    # an agent's step: the request offers a tool and requires a call of it (tool_choice "required"); the answer is
    # a tool call, whose result the session's next turn brings
    tool_call: bool = False


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    endpoint: Literal["chat", "completions"] = "chat"
    timeout_s: float = 600.0
    ignore_eos: bool = True
    temperature: float | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


@dataclass(slots=True)
class RequestResult:
    session_id: str
    user_id: str
    turn: int
    tenant: str = ""
    start_s: float = 0.0  # offset from the start of the setting
    ok: bool = False
    status: int = 0  # HTTP status; 0 when no response arrived
    error_type: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tpot_s: float | None = None
    # gaps between content chunks (one per token when streamed), the first MAX_ITL_SAMPLES of them
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage_present: bool = False
    finish_reason: str | None = None
    refused: bool = False  # a 429 or 503 with Retry-After: the server shed it (admission), it did not fail it
    replica: str | None = None
    chunks: int = 0
    text: str = ""  # generated text; kept out of the JSON rows

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "user_id": self.user_id,
            "turn": self.turn,
            "tenant": self.tenant,
            "start_s": round(self.start_s, 6),
            "ok": self.ok,
            "status": self.status,
            "refused": self.refused,
            "error_type": self.error_type,
            "error": self.error,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "tpot_s": self.tpot_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "usage_present": self.usage_present,
            "finish_reason": self.finish_reason,
            "replica": self.replica,
            "output_chars": len(self.text),
        }


AGENT_TOOL = {"type": "function", "function": {"name": "run", "description": "run a command",
                                               "parameters": {"type": "object"}}}  # fmt: skip


def build_body(
    target: Target, messages: tuple[Message, ...], max_tokens: int, tool_call: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    if target.endpoint == "chat":
        body["messages"] = [{"role": role, "content": content} for role, content in messages]
        if tool_call:
            body["tools"], body["tool_choice"] = [AGENT_TOOL], "required"
    else:
        body["prompt"] = "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"
    body.update(target.extra_body)
    return body


def _arguments(delta: Mapping[str, Any]) -> str:
    """The tool-call arguments a chat delta carries: generated tokens like content (a tool call's first token is its
    time to first token)."""
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return ""
    functions = (c.get("function") for c in calls if isinstance(c, Mapping))
    return "".join(str(f.get("arguments") or "") for f in functions if isinstance(f, Mapping))


def _chunk_text(chunk: Mapping[str, Any], endpoint: str) -> tuple[str, str | None]:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], Mapping):
        return "", None
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = (delta.get("content") or _arguments(delta)) if isinstance(delta, Mapping) else ""
    else:
        text = choice.get("text") or ""
    return str(text), choice.get("finish_reason")


def _error_of(body: bytes, status: int) -> tuple[str, str]:
    text = body.decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return f"http_{status}", text[:_MAX_ERROR_CHARS]
    err = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(err, Mapping):
        etype = err.get("type") or f"http_{status}"
        return f"http_{status}:{etype}", str(err.get("message", ""))[:_MAX_ERROR_CHARS]
    return f"http_{status}", text[:_MAX_ERROR_CHARS]


def _read_usage(result: RequestResult, usage: Mapping[str, Any]) -> None:
    result.usage_present = True
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        result.cached_tokens = int(details.get("cached_tokens") or 0)


async def _consume_stream(
    resp: aiohttp.ClientResponse, result: RequestResult, endpoint: str, t0: float
) -> tuple[bool, list[str]]:
    """Reads SSE lines until [DONE]; returns (done_seen, text pieces). Records the time to the first content
    chunk and the gap before each later one (`itl_s`)."""
    pieces: list[str] = []
    last = 0.0
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True, pieces
        try:
            chunk = json.loads(data)
        except ValueError:
            result.error_type, result.error = "stream_error", f"bad chunk: {data[:100]!r}"
            return False, pieces
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            err = chunk["error"]
            result.error_type = "stream_error"
            result.error = str(err.get("message") if isinstance(err, Mapping) else err)[:_MAX_ERROR_CHARS]
            return False, pieces
        text, finish = _chunk_text(chunk, endpoint)
        if text:
            now = time.perf_counter() - t0
            if result.ttft_s is None:
                result.ttft_s = now
            elif len(result.itl_s) < MAX_ITL_SAMPLES:
                result.itl_s.append(now - last)
            last = now
            pieces.append(text)
            result.chunks += 1
        if finish:
            result.finish_reason = str(finish)
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            _read_usage(result, usage)
    return False, pieces


async def send_request(
    http: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    messages: tuple[Message, ...],
    *,
    headers: Mapping[str, str] | None = None,
    tenant: str = "",
    start_s: float = 0.0,
) -> RequestResult:
    """Streams one request; never raises for server or network failures (see the module header)."""
    result = RequestResult(spec.session_id, spec.user_id, spec.turn, tenant=tenant, start_s=start_s)
    hdrs = dict(spec.headers)
    hdrs.update(headers or {})
    body = build_body(target, messages, spec.max_tokens, spec.tool_call)
    if spec.send_user:
        body["user"] = spec.user_id
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    t0 = time.perf_counter()
    try:
        async with http.post(target.url, json=body, headers=hdrs, timeout=timeout) as resp:
            result.status = resp.status
            result.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status != 200:
                result.error_type, result.error = _error_of(await resp.read(), resp.status)
                result.refused = resp.status in (429, 503) and "Retry-After" in resp.headers
            else:
                done, pieces = await _consume_stream(resp, result, target.endpoint, t0)
                result.text = "".join(pieces)
                if done and result.error_type is None:
                    result.ok = True
                elif result.error_type is None:
                    result.error_type, result.error = "incomplete_stream", "stream ended without [DONE]"
    except TimeoutError:
        result.error_type, result.error = "timeout", f"no complete answer within {target.timeout_s:g} s"
    except aiohttp.ClientError as exc:
        result.error_type, result.error = "connection", f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    result.e2e_s = time.perf_counter() - t0
    if not result.usage_present:
        result.completion_tokens = result.chunks
    if result.ttft_s is not None and result.completion_tokens > 1:
        result.tpot_s = (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)
    return result


async def fetch_model(http: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]) -> str:
    """The first model id served at base_url/v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    async with http.get(url, headers=dict(headers), timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise ValueError(f"{url} lists no models")
    return str(models[0]["id"])
