"""The route table: every endpoint of vLLM's OpenAI-compatible server that kvgate serves, one line each.

Every entry goes through the one request path (`CompletionService.handle`): tenant authentication, body limits,
admission and quotas (tokens from the answer's `usage` where it has one), routing, retries before the first byte,
cancellation, metrics (labelled with `name`) and the access log. `body` says how the request is read:
- "chat" / "completions": validated as OpenAI's chat and completions requests, prefix-hashed for cache-aware
  routing, streams relayed event by event and required to end with `[DONE]`;
- "json": any JSON object with a `model` (optional where `model_optional`, as in vLLM's request models: the pool's
  only model is meant then, and a pool of several answers 400),
  routed by load, a `"stream": true` answer relayed as it comes; with a `view` routed cache-aware as the chat
  request (responses, messages) or the completions prompt (generate's token ids) it stands for;
- "multipart": a multipart/form-data body (audio), read whole up to `server.max_body_bytes` and forwarded as the
  client sent it; only its `model` and `stream` fields are read;
- "held": a call about a stored response (`{response_id}` in the path): sent to the replica that created it
  (`records_id` endpoints remember which replica answered which id), 404 when no replica is known to hold it.
`api` is the shape of the route's answers: "openai", or "anthropic" (the Messages API, which vLLM serves itself):
the key also in `x-api-key`, errors in Anthropic's shape (`gateway.errors`), `anthropic-ratelimit-*` headers
beside `x-ratelimit-*`, and a stream complete only with its `message_stop` event (`gateway.relay`).
`forward_headers` are request headers the engine gets as the client sent them (the engine reads them).
The engine is asked at the same path. A new vLLM endpoint is one more line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.anthropic import messages_as_chat
from gateway.errors import ApiShape
from gateway.request_parse import BodyKind, generate_as_prompt
from gateway.responses import responses_as_chat

ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # the `endpoint` label of metrics and the access log
    path: str  # on the gateway and on the engine
    body: BodyKind
    model_optional: bool = False
    method: str = "POST"
    records_id: bool = False  # the answer's `id` names state the replica keeps (vLLM's stored responses)
    # the body as the chat request or completions prompt (`view_kind`) it stands for, for cache-aware routing of an
    # endpoint whose prompt hits the prefix cache; None from the view: routed by load
    view: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
    view_kind: BodyKind = "chat"
    api: ApiShape = "openai"
    forward_headers: tuple[str, ...] = ()
    # False: the route computes no KV (counting, rendering, tokenizing): it takes no capacity slot, is not held to
    # latency targets and charges no tokens (it still counts as a request of the tenant's)
    computes_kv: bool = True


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", "/v1/chat/completions", "chat", model_optional=True),
    Endpoint("completions", "/v1/completions", "completions", model_optional=True),
    Endpoint("responses", "/v1/responses", "json", model_optional=True, records_id=True, view=responses_as_chat),
    Endpoint("responses", "/v1/responses/{response_id}", "held", method="GET", computes_kv=False),
    Endpoint("responses", "/v1/responses/{response_id}/cancel", "held", computes_kv=False),
    # the Messages API: routed cache-aware as the chat request vLLM turns it into; counting tokens computes no KV
    # (routing it cache-aware would teach the index blocks no engine holds): routed by load
    Endpoint(
        "messages",
        "/v1/messages",
        "json",
        view=messages_as_chat,
        api="anthropic",
        forward_headers=ANTHROPIC_HEADERS,
    ),
    Endpoint(
        "count_tokens",
        "/v1/messages/count_tokens",
        "json",
        api="anthropic",
        forward_headers=ANTHROPIC_HEADERS,
        computes_kv=False,
    ),
    # vLLM's token-in, token-out route (`--enable-scale-out`; RL rollout frameworks drive it): cache-aware on the
    # token ids it carries
    Endpoint(
        "generate",
        "/inference/v1/generate",
        "json",
        model_optional=True,
        view=generate_as_prompt,
        view_kind="completions",
    ),
    Endpoint("chat_batch", "/v1/chat/completions/batch", "json"),
    Endpoint("cohere_chat", "/cohere/v2/chat", "json"),
    Endpoint("generative_scoring", "/generative_scoring", "json"),
    # rendering a prompt (and its inverse) computes no KV: routed by load
    Endpoint("render", "/v1/chat/completions/render", "json", computes_kv=False),
    Endpoint("render", "/v1/completions/render", "json", computes_kv=False),
    Endpoint("render", "/v1/responses/render", "json", computes_kv=False),
    Endpoint(
        "render", "/v1/messages/render", "json", api="anthropic", forward_headers=ANTHROPIC_HEADERS, computes_kv=False
    ),
    Endpoint("render", "/cohere/v2/chat/render", "json", computes_kv=False),
    Endpoint("derender", "/v1/chat/completions/derender", "json", model_optional=True, computes_kv=False),
    Endpoint("derender", "/v1/completions/derender", "json", model_optional=True, computes_kv=False),
    Endpoint("embeddings", "/v1/embeddings", "json", model_optional=True),
    Endpoint("embeddings", "/v2/embed", "json"),
    Endpoint("invocations", "/invocations", "json", model_optional=True),
    Endpoint("tokenize", "/tokenize", "json", model_optional=True, computes_kv=False),
    Endpoint("detokenize", "/detokenize", "json", model_optional=True, computes_kv=False),
    Endpoint("pooling", "/pooling", "json", model_optional=True),
    Endpoint("classify", "/classify", "json", model_optional=True),
    Endpoint("score", "/score", "json", model_optional=True),
    Endpoint("score", "/v1/score", "json", model_optional=True),
    Endpoint("rerank", "/rerank", "json", model_optional=True),
    Endpoint("rerank", "/v1/rerank", "json", model_optional=True),
    Endpoint("rerank", "/v2/rerank", "json", model_optional=True),
    Endpoint("transcriptions", "/v1/audio/transcriptions", "multipart", model_optional=True),
    Endpoint("translations", "/v1/audio/translations", "multipart", model_optional=True),
)
CHAT, COMPLETIONS = ENDPOINTS[0], ENDPOINTS[1]
API_BY_PATH: dict[str, ApiShape] = {e.path: e.api for e in ENDPOINTS}  # the middleware's errors, by route
_NAME_BY_PATH: dict[str, str] = {e.path: e.name for e in ENDPOINTS}


def endpoint_label(path: str | None) -> str:
    """The `endpoint` label of a request refused before its handler, by its route (None: no route took it): the
    endpoint's name, `admin` for the admin API, `gateway` for the gateway's own routes, `unrouted`."""
    if path is None:
        return "unrouted"
    return _NAME_BY_PATH.get(path) or ("admin" if path.startswith("/admin") else "gateway")
