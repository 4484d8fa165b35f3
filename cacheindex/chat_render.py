"""OpenAI chat messages -> the conversation vLLM hands to `tokenizer.apply_chat_template`.

vLLM (0.32, `vllm/renderers/chat_utils.py` and `renderers/hf.py`) does not pass the request's messages to the chat
template as they are; kvgate must normalize them the same way or its token ids (and so its block hashes) differ from
the engine's and every overlap silently reads zero. What vLLM does, and what is reproduced here:
- content format: it parses the Jinja template and looks for a loop over a message's `content`. Such a template
  ("openai" format) receives content as a list of `{"type": "text", "text": ...}` parts (a string content becomes
  one part, None becomes []); any other template ("string" format) receives the text parts joined with "\n".
- `tool` messages whose content is a list of text parts get it joined with "\n".
- assistant `tool_calls`: arguments given as a JSON string are parsed to a dict (invalid or non-object -> {});
  an empty `tool_calls` list is dropped.
- a `developer` message becomes `system` when the template never mentions "developer", and all system messages are
  then merged (joined with "\n\n") into the first position.
- `tools`: each as its `ChatCompletionToolsParam.model_dump()` (`engine_tools`): the function's name, description
  and parameters (null where absent), then `strict` and `defer_loading` only where set; nothing else the client
  sent. A template that writes `tools | tojson` sees exactly these keys.
Non-text content parts (images, audio) are dropped here; a prompt that has any is hashed only up to the message
that holds the first (`first_media`): the blocks after it are the media's, which kvgate does not predict.

Complexity: O(size of the messages); template detection is cached per template string by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2
import jinja2.nodes as jn

ContentFormat = Literal["string", "openai"]

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_NOT_MEDIA = _TEXT_PART_TYPES | {"refusal"}


def _is_name(node: jn.Node, names: set[str]) -> bool:
    return isinstance(node, jn.Name) and node.name in names


def _strip(node: jn.Node) -> jn.Node:
    """Peel filters, tests and slices: `message['content'] | list` -> `message['content']`."""
    while True:
        if isinstance(node, jn.Filter | jn.Test) and node.node is not None:
            node = node.node
        elif isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
            node = node.node
        else:
            return node


def _is_content_of(node: jn.Node, names: set[str]) -> bool:
    node = _strip(node)
    if isinstance(node, jn.Getitem):
        return _is_name(node.node, names) and isinstance(node.arg, jn.Const) and node.arg.value == "content"
    if isinstance(node, jn.Getattr):
        return _is_name(node.node, names) and node.attr == "content"
    return False


def detect_content_format(chat_template: str) -> ContentFormat:
    """The content format vLLM would detect: "openai" when the template loops over a message's content (or a
    variable named `content`), else "string".
    A simplified port of vLLM's `_detect_content_format`; an unparsable template counts as "string"."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateError:
        return "string"
    # names bound to `messages` (or a slice/filter of it), then loop variables over those
    message_lists = {"messages"}
    for assign in ast.find_all(jn.Assign):
        if isinstance(assign.target, jn.Name) and _is_name(_strip(assign.node), message_lists):
            message_lists.add(assign.target.name)
    message_vars: set[str] = set()
    for loop in ast.find_all(jn.For):
        if _is_name(_strip(loop.iter), message_lists) and isinstance(loop.target, jn.Name):
            message_vars.add(loop.target.name)
    for assign in ast.find_all(jn.Assign):  # {% set message = messages[0] %}
        if isinstance(assign.target, jn.Name):
            rhs = _strip(assign.node)
            if isinstance(rhs, jn.Getitem) and _is_name(rhs.node, message_lists):
                message_vars.add(assign.target.name)
    content_vars = {"content"}
    for assign in ast.find_all(jn.Assign):  # {% set content = message['content'] %}
        if isinstance(assign.target, jn.Name) and _is_content_of(assign.node, message_vars):
            content_vars.add(assign.target.name)
    for loop in ast.find_all(jn.For):
        if _is_content_of(loop.iter, message_vars) or _is_name(_strip(loop.iter), content_vars):
            return "openai"
    return "string"


def first_media(messages: Sequence[Any]) -> int | None:
    """The index of the first message holding a part other than text (an image, audio, a video, a file), None when
    none does. vLLM's block hashes from such a part on carry the media's own hash, which the text alone cannot
    give: only the messages before it are hashed (two prompts alike in text but not in their images are not one).
    O(parts)."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, str):
            for part in content:
                kind = part.get("type", "text") if isinstance(part, Mapping) else "text"
                if not isinstance(kind, str) or kind not in _NOT_MEDIA:
                    return i
    return None


def text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") in _TEXT_PART_TYPES:
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
            elif isinstance(part, Mapping) and part.get("type") == "refusal":
                refusal = part.get("refusal")
                if isinstance(refusal, str):
                    texts.append(refusal)
        return texts
    raise ValueError("message content must be a string, a list of content parts or null")


def engine_tools(tools: Any) -> list[dict[str, Any]]:
    """Chat `tools` as vLLM gives them to the chat template; ValueError on a tool without a function name."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError("each tool needs a function with a string name")
        around = tool.get("defer_loading")  # vLLM's validator hands the tool's own to a function without one
        defer = function.get("defer_loading")
        defined = {k: function.get(k) for k in ("name", "description", "parameters")}
        if function.get("strict") is not None:
            defined["strict"] = function["strict"]
        if (defer if defer is not None else around) is not None:
            defined["defer_loading"] = defer if defer is not None else around
        entry: dict[str, Any] = {"type": "function", "function": defined}
        if around is not None:
            entry["defer_loading"] = around
        out.append(entry)
    return out


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list) or not calls:
        return None
    out: list[dict[str, Any]] = []
    for item in calls:
        if not isinstance(item, Mapping):
            raise ValueError("assistant tool_calls entries must be objects")
        call = dict(item)
        function = call.get("function")
        if isinstance(function, Mapping):
            function = dict(function)
            args = function.get("arguments")
            parsed: Any = {}
            if isinstance(args, Mapping):
                parsed = dict(args)
            elif isinstance(args, str) and args:
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = {}
            function["arguments"] = parsed if isinstance(parsed, dict) else {}
            call["function"] = function
        out.append(call)
    return out


def normalize_conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, chat_template: str | None
) -> list[dict[str, Any]]:
    """The conversation vLLM would render for `messages`; raises ValueError on a malformed message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("'messages' must be a list of message objects")
    conversation: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        role: str = message["role"]
        texts = text_parts(message.get("content"))
        content: Any
        if content_format == "openai" and role != "tool":
            content = [{"type": "text", "text": t} for t in texts]
        else:
            content = "\n".join(texts)
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"))
            if calls is not None:
                out["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        conversation.append(out)
    if any(m["role"] == "developer" for m in conversation) and not _mentions_developer(chat_template):
        conversation = _developer_to_system(conversation)
    return conversation


def _mentions_developer(chat_template: str | None) -> bool:
    return chat_template is not None and ('"developer"' in chat_template or "'developer'" in chat_template)


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    merged: list[str] = []
    for i in systems:
        content = converted[i]["content"]
        text = "\n".join(p["text"] for p in content) if isinstance(content, list) else content
        if text:
            merged.append(text)
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(merged)}, *rest]
