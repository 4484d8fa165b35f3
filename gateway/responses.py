"""OpenAI's Responses API (`POST /v1/responses`) as the chat request vLLM renders for it, for prefix hashing.

vLLM serves the Responses API itself (0.32: `entrypoints/openai/responses/utils.py` `construct_input_messages` and
`construct_tool_dicts`, `renderers/online_renderer.py` `render_responses`) by turning the input into chat messages
and templating them; kvgate hashes the same chat request, so an agent's Responses prompt (the Codex CLI's) and its
cached prefix are predicted as chat's are. The conversion, as vLLM does it:
- `instructions` -> the first message, `system`; a string `input` -> one user message;
- input items, in order: a message (any role, string or text-part content) as it is; `reasoning` -> an assistant
  message's `reasoning` (its first content text, else its first summary text); `function_call` -> an assistant
  `tool_calls` entry (a namespaced function named `<namespace>__<name>`); `custom_tool_call` -> one whose
  arguments are `{"input": ...}` as JSON; a reasoning or a tool call joins the assistant message just before it
  when that one has none yet; an assistant output message -> its first text part as content (also joining the
  assistant message before it when that one has no content); `function_call_output` / `custom_tool_call_output`
  -> a `tool` message;
- `tools` -> the function tools the template sees (`responses_tools`): a function as it is, a namespace's functions
  flattened, a custom tool as a one-string function; built-in tools (web search, MCP, ...) are never shown;
- the rendered template is encoded with the tokenizer's special tokens added (`add_special_tokens`: vLLM's
  Responses tokenization default, where chat adds none), so a template that writes BOS itself gets a second one.
No view (no prediction; the answer is the engine's either way) when the prompt is not all in the body
(`previous_response_id`: the engine prepends a stored conversation, and the request goes to its holder anyway),
for an item vLLM refuses (encrypted reasoning, an unknown type), or without a message.
Cost: one pass over the items (O(body)).
"""

from __future__ import annotations

import json
from typing import Any

# the one-string function vLLM shows a model for a `custom` tool (vLLM 0.32 `tool_parsers.utils`)
_CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}


def _chat_tool(tool: dict[str, Any], name: Any, parameters: Any) -> dict[str, Any]:
    keys = ("description", "strict", "defer_loading")
    return {"type": "function", "function": {"name": name, "parameters": parameters, **{k: tool.get(k) for k in keys}}}


def responses_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses `tools` as the chat tools vLLM renders for them (vLLM 0.32 `get_function_tools`, in request order)."""
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_chat_tool(tool, tool.get("name"), tool.get("parameters")))
        elif kind == "custom":
            out.append(_chat_tool({"description": tool.get("description")}, tool.get("name"), _CUSTOM_TOOL_PARAMETERS))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            space = tool.get("name")
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    out.append(_chat_tool(inner, f"{space}__{inner.get('name')}", inner.get("parameters")))
    return out


class _Refused(Exception):
    """An input item vLLM refuses: no view."""


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments")
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
    elif item.get("namespace"):
        name = f"{item['namespace']}__{name}"
    return {"id": item.get("call_id"), "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any]) -> str:
    if item.get("encrypted_content"):
        raise _Refused("encrypted reasoning")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict):
            return str(parts[0].get("text") or "")
    return ""


def _output_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _add(messages: list[dict[str, Any]], item: Any) -> None:
    """`item` as vLLM turns it into chat messages (`_construct_message_from_response_item`): a new message, or one
    more field of the assistant message before it."""
    if not isinstance(item, dict):
        raise _Refused("not an object")
    kind = item.get("type", "message")
    last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        if last is not None:
            last.setdefault("tool_calls", []).append(_tool_call(item))
        else:
            messages.append({"role": "assistant", "tool_calls": [_tool_call(item)]})
    elif kind == "reasoning":
        if last is not None and last.get("reasoning") is None:
            last["reasoning"] = _reasoning(item)
        else:
            messages.append({"role": "assistant", "reasoning": _reasoning(item)})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif kind == "message" and item.get("role") == "assistant":
        text = _output_text(item.get("content"))
        if text is None:
            raise _Refused("an assistant message without text")
        if last is not None and last.get("content") is None:
            last["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
    elif kind == "message" and isinstance(item.get("role"), str):
        messages.append({"role": item["role"], "content": item.get("content")})
    else:
        raise _Refused(f"input item type {kind!r}")


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any] | None:
    """A Responses API body as the chat request vLLM renders for it (the module's conversion); None without one."""
    if body.get("previous_response_id") is not None:
        return None
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        try:
            for item in items:
                _add(messages, item)
        except _Refused:
            return None
    if not messages or messages[-1]["role"] == "system":
        return None
    view = {"model": body.get("model"), "messages": messages, "cache_salt": body.get("cache_salt")}
    if isinstance(tools := body.get("tools"), list) and tools:
        view["tools"] = responses_tools(tools)
    return {**view, "add_special_tokens": True}
