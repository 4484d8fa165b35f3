"""Prompt tokenizers: the HF path reproduces vLLM's chat rendering; sim and chars behave as documented."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cacheindex.chat_render import detect_content_format, engine_tools, normalize_conversation
from cacheindex.hashing import chain_hashes
from cacheindex.incremental import ChatPrefixCache
from cacheindex.tokenizers import (
    CharsPromptTokenizer,
    HfPromptTokenizer,
    SimPromptTokenizer,
    build_tokenizer,
)
from gateway.responses import responses_as_chat, responses_tools
from simengine import tokenize as sim_tokenize

# Formats vLLM 0.32's own `_detect_content_format` returns for these templates (checked offline; importing vLLM
# in a test takes ~20 s).
TEMPLATES = {
    "plain": ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}", "string"),
    "attr_loop": (
        "{% for m in messages %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "set_content": (
        "{% for m in messages %}{% set content = m['content'] %}{% for c in content %}{{ c['text'] }}{% endfor %}"
        "{% endfor %}",
        "openai",
    ),
    "sliced": (
        "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
        "{% for p in message['content'] | list %}{{ p }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "string_test": (
        "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
        "{% endfor %}",
        "string",
    ),
    "broken": ("{% for message in messages %}", "string"),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="the tokenizer extra is not installed")
    from engine_pool.tiny_model import _build_tokenizer

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    _build_tokenizer(out, 4096)
    return out


@pytest.fixture(scope="module")
def hf(hf_dir: Path) -> HfPromptTokenizer:
    return HfPromptTokenizer(str(hf_dir))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_detection_matches_vllm(name: str) -> None:
    template, expected = TEMPLATES[name]
    assert detect_content_format(template) == expected


def test_tiny_template_is_openai_format(hf: HfPromptTokenizer) -> None:
    assert hf.content_format == "openai"


def test_chat_matches_hf_apply_chat_template_on_vllm_conversation(hf: HfPromptTokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Tell me about caches."},
    ]
    ids = hf.tokenize_chat(messages)
    # what vLLM hands transformers: content as text parts, apply_chat_template(tokenize=True) encodes the
    # rendered text with add_special_tokens=False
    conversation = normalize_conversation(messages, "openai", None)
    expected = hf._tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == list(expected)
    bos = hf._tok.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS only, no second one from the tokenizer
    assert hf._tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_generation_prompt_and_continue_final_message(hf: HfPromptTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with_prompt = hf.tokenize_chat(messages, True)
    without = hf.tokenize_chat(messages, False)
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    cont = hf.tokenize_chat(messages, True, {"continue_final_message": True})
    assert not hf._tok.decode(cont).endswith("assistant<|end_header_id|>\n\n")


def test_string_and_part_content_render_alike_for_this_template(hf: HfPromptTokenizer) -> None:
    a = hf.tokenize_chat([{"role": "user", "content": "x\ny"}])
    b = hf.tokenize_chat([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}])
    assert a == b


def test_completions_text_gets_bos(hf: HfPromptTokenizer) -> None:
    ids = hf.tokenize_text("hello world")
    assert ids[0] == hf._tok.bos_token_id
    assert hf.tokenize_text("hello world", add_special_tokens=False) == ids[1:]


def test_reserved_template_kwargs_are_ignored(hf: HfPromptTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert hf.tokenize_chat(messages, True, {"tokenize": True, "return_dict": True}) == hf.tokenize_chat(messages)


def test_developer_becomes_system_and_systems_merge() -> None:
    conv = normalize_conversation(
        [
            {"role": "system", "content": "a"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": [{"type": "text", "text": "b"}]},
        ],
        "openai",
        "{{ messages }}",
    )
    assert conv == [
        {"role": "system", "content": "a\n\nb"},
        {"role": "user", "content": [{"type": "text", "text": "u"}]},
    ]
    kept = normalize_conversation([{"role": "developer", "content": "d"}], "string", "{% if r == 'developer' %}")
    assert kept == [{"role": "developer", "content": "d"}]


def test_tool_messages_and_tool_calls_normalized_like_vllm() -> None:
    conv = normalize_conversation(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
            {
                "role": "tool",
                "tool_call_id": "1",
                "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
            },
            {"role": "assistant", "content": "ok", "tool_calls": []},
        ],
        "openai",
        None,
    )
    assert conv[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert conv[1] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "1"}
    assert "tool_calls" not in conv[2]


def test_malformed_messages_raise_value_error(hf: HfPromptTokenizer) -> None:
    with pytest.raises(ValueError):
        hf.tokenize_chat([{"content": "no role"}])
    with pytest.raises(ValueError):
        hf.tokenize_chat("not a list")  # type: ignore[arg-type]


def test_sim_tokenizer_is_the_simulators() -> None:
    tok = build_tokenizer("sim")
    assert isinstance(tok, SimPromptTokenizer) and not tok.approximate
    messages = [{"role": "user", "content": "hello there"}]
    assert tok.tokenize_chat(messages) == sim_tokenize.tokenize_chat(messages, True)
    assert tok.tokenize_text("abcdefgh") == sim_tokenize.tokenize_text("abcdefgh")


def test_chars_tokenizer_is_deterministic_and_prefix_preserving() -> None:
    tok = build_tokenizer("chars", chunk_chars=4)
    assert isinstance(tok, CharsPromptTokenizer) and tok.approximate and tok.kind == "chars"
    a = tok.tokenize_text("abcdefghij")
    assert len(a) == 3 and a == tok.tokenize_text("abcdefghij")
    b = tok.tokenize_text("abcdefghXYZW")
    assert a[:2] == b[:2] and a[2] != b[2]
    short = tok.tokenize_chat([{"role": "user", "content": "hello"}], False)
    longer = tok.tokenize_chat([{"role": "user", "content": "hello"}, {"role": "user", "content": "more"}], False)
    assert longer[: len(short) - 1] == short[:-1]


def test_hf_dir_that_does_not_exist_fails_to_load(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the tokenizer extra is not installed")
    with pytest.raises(OSError):
        build_tokenizer(str(tmp_path / "missing"))


def test_add_special_tokens_puts_the_tokenizers_bos_before_the_templates(hf: HfPromptTokenizer) -> None:
    """vLLM encodes a Responses prompt's rendered template with the tokenizer's special tokens added (chat: a
    request's `add_special_tokens`): this template writes BOS itself, so the prompt starts with two."""
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "hi"}]
    _, text = hf.render_chat(messages, True, {})
    kwargs = {"add_special_tokens": True}
    ours = hf.tokenize_chat(messages, True, kwargs)
    assert ours == hf._tok.encode(text, add_special_tokens=True)
    assert ours[:2] == [hf._tok.bos_token_id] * 2 and ours[1:] == hf.tokenize_chat(messages)
    cache = ChatPrefixCache(1 << 20)  # the incremental path: each turn as the whole prompt encodes
    turns = [messages, [*messages, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]]
    for turn in turns:
        count, hashes = cache.finish(cache.prepare(hf, turn, True, kwargs, block_size=4, seed=1))
        whole = hf.tokenize_chat(turn, True, kwargs)
        assert count == len(whole) and hashes == chain_hashes(whole, 4, 1)


# An agent's tool loop as Responses input items, and the chat messages vLLM 0.32 makes of them (its own
# `construct_input_messages` of the `ResponsesRequest`, checked offline)
ITEMS = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
    {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
    {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
    {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "*** Begin Patch"},
    {"type": "custom_tool_call_output", "call_id": "c3", "output": "done"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Here."}, {"type": "output_text", "text": "More."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
]  # fmt: skip
VLLM_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"content": [{"text": "Rules.", "type": "input_text"}], "role": "developer", "type": "message"},
    {"content": [{"text": "list files", "type": "input_text"}], "role": "user", "type": "message"},
    {"role": "assistant", "reasoning": "think", "tool_calls": [
        {"id": "c1", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}, "type": "function"},
        {"id": "c2", "function": {"name": "agents__spawn", "arguments": "{}"}, "type": "function"}]},
    {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
    {"role": "tool", "content": [{"text": "ok", "type": "input_text"}], "tool_call_id": "c2"},
    {"role": "assistant", "tool_calls": [{"id": "c3", "function": {"name": "apply_patch",
                                                                   "arguments": '{"input": "*** Begin Patch"}'},
                                          "type": "function"}]},
    {"role": "tool", "content": "done", "tool_call_id": "c3"},
    {"role": "assistant", "content": "Here."},
    {"content": [{"text": "thanks", "type": "input_text"}], "role": "user", "type": "message"},
]  # fmt: skip


def test_a_responses_tool_loop_is_viewed_as_vllm_renders_it() -> None:
    view = responses_as_chat({"model": "m", "instructions": "Be brief.", "input": ITEMS, "tools": [{"type": "mcp"}]})
    assert view is not None
    assert view["add_special_tokens"] is True and view["tools"] == []  # no function tool: the template sees none
    for fmt in ("openai", "string"):
        assert normalize_conversation(view["messages"], fmt, None) == normalize_conversation(VLLM_MESSAGES, fmt, None)
    refused = [{"type": "reasoning", "encrypted_content": "x", "summary": []}, {"type": "item_reference", "id": "r"}]
    for item in refused:  # vLLM answers these 400: nothing to predict
        assert responses_as_chat({"model": "m", "input": [ITEMS[1], item]}) is None


# vLLM 0.32's own answers for these tools (checked offline: `construct_tool_dicts` of a `ResponsesRequest`, and
# `ChatCompletionToolsParam.model_validate(tool).model_dump()`), compared with their key order
RESPONSES_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "spawn", "description": "Spawn one.", "strict": False,
         "parameters": {"type": "object", "properties": {}}}]},
    {"type": "custom", "name": "apply_patch", "description": "Patch files."},
    {"type": "web_search", "external_web_access": False},
    {"type": "function", "name": "later", "parameters": None, "defer_loading": True},
]  # fmt: skip
VLLM_RESPONSES_TOOLS = (
    '[{"type": "function", "function": {"name": "exec_command", "description": "Runs a command.", "parameters": '
    '{"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}, "strict": false}}, '
    '{"type": "function", "function": {"name": "agents__spawn", "description": "Spawn one.", "parameters": '
    '{"type": "object", "properties": {}}, "strict": false}}, {"type": "function", "function": {"name": '
    '"apply_patch", "description": "Patch files.", "parameters": {"type": "object", "properties": {"input": '
    '{"type": "string", "description": "The freeform text payload for this tool."}}, "required": ["input"], '
    '"additionalProperties": false}}}, {"type": "function", "function": {"name": "later", "description": null, '
    '"parameters": null, "defer_loading": true}}]'
)
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "extra": 1}},
    {"type": "function", "defer_loading": True, "function": {"name": "g", "description": "d", "strict": True}},
]
VLLM_CHAT_TOOLS = (
    '[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}, '
    '{"type": "function", "function": {"name": "g", "description": "d", "parameters": null, "strict": true, '
    '"defer_loading": true}, "defer_loading": true}]'
)


def test_tools_reach_the_template_as_vllm_gives_them() -> None:
    assert json.dumps(engine_tools(responses_tools(RESPONSES_TOOLS))) == VLLM_RESPONSES_TOOLS
    assert json.dumps(engine_tools(CHAT_TOOLS)) == VLLM_CHAT_TOOLS
    with pytest.raises(ValueError):
        engine_tools([{"type": "function"}])
