"""OpenAI request parsing and response shapes of the simulated engine (vLLM's field names; no aiohttp here).

Only the fields that change the simulation are read (``model``, ``messages`` / ``prompt``, ``max_tokens`` /
``max_completion_tokens``, ``n``, ``stream``, ``stream_options``); every other field is accepted and ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from simengine.config import SimConfig
from simengine.tokenize import MAX_TOKEN_ID, tokenize_chat, tokenize_text

Kind = Literal["chat", "completion"]


class OpenAIError(Exception):
    """A request error rendered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "BadRequestError", param)


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: Kind
    model: str
    tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    remote_decode: bool = False  # kv_transfer_params.do_remote_decode: a prefill step whose decode runs elsewhere
    tool: str | None = None  # chat's tool_choice "required" or a named function: the answer calls this tool


def check_model(body: Mapping[str, Any], cfg: SimConfig, adapters: Collection[str]) -> str:
    """The model a body names: the served model (when it names none) or one of the loaded `adapters`."""
    model = body.get("model")
    if model is None:
        return cfg.model
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != cfg.model and model not in adapters:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be an integer", name)
    return value


def token_list(value: list[Any], param: str) -> list[int]:
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
            raise bad_request(f"token ids must be integers in [0, {MAX_TOKEN_ID}]", param)
    return list(value)


def prompt_tokens(body: Mapping[str, Any], *, allow_ids: bool = True) -> list[int]:
    """Tokens of a completions/tokenize ``prompt``: a string, a list of token ids, or a one-element list of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize_text(prompt)
    if allow_ids and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return token_list(prompt, "prompt")
    if isinstance(prompt, list):
        raise bad_request("batched prompts are not supported by the simulator: send one prompt", "prompt")
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt")


def chat_tokens(body: Mapping[str, Any], default_generation_prompt: bool = True) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    add_gen = body.get("add_generation_prompt", default_generation_prompt)
    if not isinstance(add_gen, bool):
        raise bad_request("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    continue_final = body.get("continue_final_message", False)
    if not isinstance(continue_final, bool):
        raise bad_request("'continue_final_message' must be a boolean", "continue_final_message")
    if continue_final and add_gen:  # vLLM's own check
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    try:
        return tokenize_chat(messages, add_gen, continue_final)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


def _joined(content: Any) -> Any:
    """A content of text parts (any of Responses' text part types) as one string; anything else as it is."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def _response_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """One input item as vLLM 0.32 turns it into chat messages (`construct_chat_messages_with_tool_call`): a message
    as it is (an assistant one: its first text part); a reasoning item or a tool call joins the assistant message
    just before it when that one has none yet, else starts one; a tool call's output is a `tool` message."""
    kind, role = item.get("type", "message"), item.get("role")
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = {"id": item.get("call_id"), "name": item.get("name")}  # the template renders no tool calls
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise bad_request("Encrypted content is not supported.", where)
        if last is not None and last.get("reasoning") is None:
            last["reasoning"] = True
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": True})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": _joined(item.get("output"))})
    elif kind == "message" and role == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _joined(content[:1]) if isinstance(content, list) else None
        if not isinstance(text, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts", where)
        if last is not None and last.get("content") is None:
            last["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
    elif kind == "message" and isinstance(role, str):
        content = _joined(item.get("content"))
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts", where)
        messages.append({"role": role, "content": content})
    else:
        raise bad_request(f"Unsupported input item type: {kind}", where)


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses API body, as vLLM builds them: `instructions` as the system message, then
    `input` (a string: one user message; or items: messages whose content is a string or text parts, reasoning,
    tool calls and their outputs, `_response_item`)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of messages", "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", f"input[{i}]")
        _response_item(messages, item, f"input[{i}]")
    return [{k: m[k] for k in ("role", "content")} for m in messages]


def forced_tool(body: Mapping[str, Any]) -> str | None:
    """The tool a chat request makes the model call, as vLLM's guided tool choice does: with `tool_choice`
    "required" the first of `tools`, with a named function that one; None when the model may answer in text."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not isinstance(tools, list) or not tools:
        return None
    if choice == "required":
        function = tools[0].get("function") if isinstance(tools[0], dict) else None
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
    else:
        return None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("a forced tool call needs a function name", "tool_choice")
    return name


def parse_generation(kind: Kind, body: Any, cfg: SimConfig, adapters: Collection[str]) -> GenRequest:
    """Validate a chat or completions body; raises `OpenAIError`."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = check_model(body, cfg, adapters)
    tokens = chat_tokens(body) if kind == "chat" else prompt_tokens(body)
    if not tokens:
        raise bad_request("the prompt must not be empty", "messages" if kind == "chat" else "prompt")
    if len(tokens) >= cfg.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, your request has "
            f"{len(tokens)} input tokens. Please reduce the length of the input messages.",
            "messages" if kind == "chat" else "prompt",
        )
    max_tokens = _int_field(body, "max_completion_tokens") if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    if max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    max_tokens = min(max_tokens, cfg.max_model_len - len(tokens))
    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise bad_request("the simulator only supports n=1", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    options = options or {}
    if options and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    return GenRequest(
        kind=kind,
        model=model,
        tokens=tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        # vLLM's should_include_usage: the running usage only with the usage event asked for too
        continuous_usage=bool(options.get("include_usage")) and bool(options.get("continuous_usage_stats")),
        remote_decode=isinstance(transfer := body.get("kv_transfer_params"), dict)
        and bool(transfer.get("do_remote_decode")),
        tool=forced_tool(body) if kind == "chat" else None,
    )


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class ResponseWriter:
    """Builds the JSON bodies and SSE events of one response (ids and timestamps fixed per response)."""

    def __init__(self, req: GenRequest, response_id: str, fingerprint: str | None = None) -> None:
        self.req = req
        self.id = response_id
        self.fingerprint = fingerprint
        self.created = int(time.time())
        self.object = "chat.completion" if req.kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        # fast path for the common stream event (not last, no usage): a prebuilt JSON prefix and suffix
        head = dumps({"id": self.id, "object": self.chunk_object, "created": self.created, "model": req.model})
        opener = '"delta":{"content":' if req.kind == "chat" else '"text":'
        closer = "}" if req.kind == "chat" else ""
        if req.tool is not None:  # a tool call's arguments, streamed: {"input": "<the generated text>"}
            opener, closer = '"delta":{"tool_calls":[{"index":0,"function":{"arguments":', "}}]}"
        self._tok_pre = f'data: {head[:-1]},"choices":[{{"index":0,{opener}'
        self._tok_post = f'{closer},"logprobs":null,"finish_reason":null}}]}}\n\n'

    def _call(self, arguments: str) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-tool-{self.id}",
            "type": "function",
            "function": {"name": self.req.tool, "arguments": arguments},
        }

    def full(self, text: str, use: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.req.kind == "chat":
            tool = self.req.tool
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if tool is None else None,
                "refusal": None,
                "tool_calls": [] if tool is None else [self._call(dumps({"input": text}))],
                "reasoning": None,
            }
            finish = "length" if tool is None else "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": use,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }

    def _event(self, choices: list[dict[str, Any]], use: dict[str, Any] | None, fingerprint: bool = False) -> str:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if use is not None:
            chunk["usage"] = use
        if fingerprint and self.fingerprint is not None:
            chunk["system_fingerprint"] = self.fingerprint
        return f"data: {dumps(chunk)}\n\n"

    def first_event(self, prompt_tokens: int, role_in_first_token: bool = False) -> str:
        """Chat streams open with an empty assistant delta (or the role comes with the first token); completions
        streams have no opening event."""
        if self.req.kind != "chat":
            return ""
        opening = ""
        if not role_in_first_token:
            use = usage(prompt_tokens, 0, 0) if self.req.continuous_usage else None
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
            opening = self._event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], use)
        if self.req.tool is None:
            return opening
        delta = {"tool_calls": [{"index": 0, **self._call('{"input":"')}]}  # the call, then its arguments in pieces
        if role_in_first_token:
            delta = {"role": "assistant", **delta}
        return opening + self._event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], None)

    def token_event(self, text: str, last: bool, use: dict[str, Any] | None, with_role: bool = False) -> str:
        tool = self.req.tool
        if tool is not None:  # a piece of the call's arguments: the text as JSON string content
            text = json.dumps(text)[1:-1] + ('"}' if last else "")
        if not last and not self.req.continuous_usage and not with_role:
            return self._tok_pre + json.dumps(text) + self._tok_post
        finish = ("length" if tool is None else "tool_calls") if last else None
        if self.req.kind == "chat":
            delta: dict[str, Any]
            if tool is not None:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            else:
                delta = {"role": "assistant", "content": text} if with_role else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if last:
            choice["stop_reason"] = None
        # vLLM stamps the fingerprint on the finish event unless a usage event follows (then on that one)
        return self._event([choice], use if self.req.continuous_usage else None, last and not self.req.include_usage)

    def usage_event(self, use: dict[str, Any]) -> str:
        return self._event([], use, fingerprint=True)
