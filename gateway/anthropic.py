"""The Anthropic Messages API (`POST /v1/messages`) as the chat request vLLM renders for it, for prefix hashing.

vLLM serves the Messages API itself (0.32: `vllm/entrypoints/anthropic/serving.py`, `to_chat_completion_request`)
by turning the request into a chat completion and templating that; kvgate hashes the same chat request, so a
`/v1/messages` prompt and its cached prefix are predicted as chat's are. The conversion, as vLLM does it:
- the top-level `system` (a string, or text blocks joined without a separator) is the first message, `system`;
  text that starts with Claude Code's `x-anthropic-billing-header` (a per-request hash) is left out;
- a `system` message inside `messages` stays a system message where it is (its text, the same header left out);
- a message's string content stays a string; its blocks become: `text` -> a text part (empty ones dropped),
  `image` -> an image part (a placeholder here: kvgate's rendering drops images, as it does for chat), `thinking`
  -> the message's `reasoning`, `tool_use` -> an OpenAI `tool_calls` entry (arguments: its `input` as JSON),
  `tool_result` in a user message -> a `tool` message placed before it (text items joined with a newline; its
  images a user message after it), in an assistant message -> the text part "Tool result: ..."; one text part
  alone becomes string content, and a user message left with nothing is dropped;
- `tools` -> OpenAI function tools (`input_schema` as `parameters`, `"type": "object"` when it names none);
  `cache_salt` and `chat_template_kwargs` as they are.
`metadata.user_id` (Anthropic's caller id; Claude Code's carries its session) is the view's `user`, which keeps a
session on its replica where no session header does (`cache.session_from_user`).
Not reproduced (the prediction then misses from that point on; the answer is the engine's either way): inline
system messages merged into the first one for a chat template that requires system-first ordering (vLLM probes its
template for that), `thinking` and `output_config.effort` (a `reasoning_effort` for the template), tool additions
and removals inside messages.
What vLLM's request model refuses is refused here first, with the param named (400 in Anthropic's shape): no
`messages` array, a message that is not an object with a role of user / assistant / system and string or block
content, a block without a known `type`, a missing or non-positive `max_tokens`, a `system` or `tools` of the wrong
type. Cost: one pass over the messages and their blocks (O(body)); image data is never copied.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import BadRequest
from gateway.request_parse import as_int

_ROLES = frozenset({"user", "assistant", "system"})
_BLOCKS = frozenset(
    {"text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking", "tool_addition",
     "tool_removal"}
)  # fmt: skip
_BILLING = "x-anthropic-billing-header"
_IMAGE = {"type": "image_url", "image_url": {"url": ""}}  # a placeholder: kvgate's rendering drops images


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """`content` as a list of blocks, each an object with a known `type`; BadRequest otherwise."""
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or an array of content blocks", param=param)
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind not in _BLOCKS:
            raise BadRequest(
                f"{param}[{i}] must be a content block with a known 'type' ({', '.join(sorted(_BLOCKS))})",
                param=f"{param}[{i}]",
            )
    return content


def _system_text(content: Any, param: str) -> str:
    """The text of a system prompt (string or text blocks), less Claude Code's billing header."""
    if isinstance(content, str):
        return "" if content.startswith(_BILLING) else content
    parts = [
        b["text"]
        for b in _blocks(content, param)
        if b["type"] == "text" and isinstance(b.get("text"), str) and b["text"] and not b["text"].startswith(_BILLING)
    ]
    return "".join(parts)


def _tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """A user message's `tool_result` block: a `tool` message (then its images as a user message)."""
    content = block.get("content")
    images: list[dict[str, Any]] = []
    references: list[dict[str, Any]] = []
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                value = item.get("text", "")
                texts.append(value if isinstance(value, str) else str(value))
            elif kind == "image":
                images.append(_IMAGE)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        out.append({"role": "user", "content": images})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _message(role: str, blocks: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """One user or assistant message of content blocks, appended to `out` (after the tool messages it holds)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                parts.append({"type": "text", "text": text})
        elif kind == "image":
            if block.get("source"):
                parts.append(_IMAGE)
        elif kind == "thinking":
            thinking = block.get("thinking")
            if isinstance(thinking, str):
                reasoning.append(thinking)
        elif kind == "tool_use":
            arguments = block.get("input") or {}
            calls.append(
                {
                    "id": block.get("id") or "",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": orjson.dumps(arguments).decode()},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                _tool_result(block, out)
            else:
                content = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(content) if content else ''}"})
    message: dict[str, Any] = {"role": role}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        message["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if role != "user" or "content" in message:
        out.append(message)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        schema = tool.get("input_schema") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}] must have a string 'name' and an object 'input_schema'", param=f"tools[{i}]")
        function: dict[str, Any] = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": schema if "type" in schema else {**schema, "type": "object"},
        }
        for optional in ("strict", "defer_loading"):
            if tool.get(optional) is not None:
                function[optional] = tool[optional]
        out.append({"type": "function", "function": function})
    return out


def messages_as_chat(body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat request vLLM renders for a `/v1/messages` body (see the module's docstring); BadRequest for what
    vLLM's request model refuses; None when no message is left to hash."""
    max_tokens = as_int(body.get("max_tokens"))
    if max_tokens is None or max_tokens < 1:
        raise BadRequest("'max_tokens' is required and must be an integer >= 1", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if not isinstance(system, str | list):
            raise BadRequest("'system' must be a string or an array of text blocks", param="system")
        if text := _system_text(system, "system"):
            out.append({"role": "system", "content": text})
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequest(f"{param} must be an object with a role of user, assistant or system", param=param)
        content = msg.get("content")
        if role == "system":
            if not isinstance(content, str | list):
                raise BadRequest(f"{param}.content must be a string or an array", param=f"{param}.content")
            if text := _system_text(content, f"{param}.content"):
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        else:
            _message(role, _blocks(content, f"{param}.content"), out)
    view: dict[str, Any] = {"model": body.get("model"), "messages": out, "cache_salt": body.get("cache_salt")}
    if body.get("tools") is not None:
        view["tools"] = _tools(body["tools"])
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        view["chat_template_kwargs"] = kwargs
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user:
        view["user"] = user
    return view if out else None
