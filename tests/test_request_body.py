"""Reading and writing request and response bodies on the hot path: orjson with the standard library's behaviour
kept (`parse_request`, `engine_body`) and the usage object read without parsing the whole answer (`usage_of`)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.answers import ends_in_tool_call, usage_of
from gateway.body import deeper_than, nested_deeper, scan_value, structure_of
from gateway.config_load import ConfigError, load_config
from gateway.errors import BadRequest
from gateway.request_parse import decode, engine_body, parse_request
from simengine import SimConfig
from tests.conftest import gateway_over_sims

BIG = 1180591620717411303424  # beyond 64 bits: orjson reads it as a float
DEPTH = 64  # server.max_json_depth's default


@pytest.mark.parametrize(
    "raw",
    [
        b'\xef\xbb\xbf{"model":"m","prompt":"x"}',  # a byte order mark
        '{"model":"m","prompt":"x"}'.encode("utf-16"),
        b'{"model":"m","prompt":"x","temperature":NaN}',
        b'{"model":"m","prompt":"\\ud800"}',  # a lone surrogate
    ],
)
def test_what_orjson_refuses_the_standard_library_reads(raw: bytes) -> None:
    parsed = parse_request("completions", raw, max_depth=DEPTH)
    assert parsed.stdlib_json and parsed.model == "m"


def test_invalid_json_is_still_a_400() -> None:
    with pytest.raises(BadRequest) as info:
        parse_request("completions", b'{"model": "m",', max_depth=DEPTH)
    assert info.value.code == "invalid_json"


def test_the_engine_gets_the_clients_bytes_unless_the_gateway_changes_a_field() -> None:
    raw = b'{"model":"m","prompt":"x","seed":%d}' % BIG
    assert engine_body(parse_request("completions", raw, max_depth=DEPTH), raw, salted=False) is raw


def test_a_streams_usage_option_is_spliced_in() -> None:
    raw = b' {"model":"m","prompt":"x","stream":true,"seed":%d}' % BIG
    sent = json.loads(engine_body(parse_request("completions", raw, max_depth=DEPTH), raw, salted=False))
    assert sent["stream_options"] == {"include_usage": True} and sent["seed"] == BIG


@pytest.mark.parametrize("seed", [BIG, -(2**63) - 1], ids=["beyond-64-bits", "below-int64"])
def test_a_rewrite_keeps_every_value_exactly(seed: int) -> None:
    raw = b'{"model":"m","prompt":"x","stream":true,"stream_options":{"x":1},"seed":%d}' % seed
    parsed = parse_request("completions", raw, max_depth=DEPTH)
    parsed.body["cache_salt"] = "kvgate:abc"
    sent = json.loads(engine_body(parsed, raw, salted=True))
    assert sent["seed"] == seed and sent["cache_salt"] == "kvgate:abc"
    assert sent["stream_options"] == {"x": 1, "include_usage": True}


@pytest.mark.parametrize(
    "answer",
    [
        {"id": "c", "usage": {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 16}}, "kv": None},
        {"usage": {"prompt_tokens": 2, "prompt_tokens_details": None, "completion_tokens": 1}},
        {"usage": {"a": {"b": {"c": 1}}, "d": {"e": 2}, "prompt_tokens": 3}, "after": {"f": {}}},
        {"usage": {}},
        {"usage": {"note": "}{", "prompt_tokens": 5}},  # braces in a string: the fallback reads it
    ],
)
def test_the_usage_object_is_read_whole(answer: dict[str, object]) -> None:
    assert usage_of(json.dumps(answer).encode()) == answer["usage"]


def test_no_usage_or_a_truncated_one_reads_as_none() -> None:
    assert usage_of(b'{"id":"c"}') is None
    assert usage_of(b'{"usage":{"prompt_tokens":2') is None


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\ ', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="[]{}k", max_size=3), inner, max_size=3)
    ),
    max_leaves=40,
)


@settings(max_examples=300, derandomize=True)
@given(json_values, st.integers(min_value=0, max_value=8))
def test_nesting_check_agrees_with_the_parsed_depth(value: object, limit: int) -> None:
    raw = json.dumps(value).encode()  # brackets inside strings must not count
    assert nested_deeper(raw, limit) == (_depth(value) > limit)
    assert scan_value(value, limit) == (_depth(value) > limit, False)  # the check on a decoded value agrees
    if _depth(value) > limit:  # the parser refuses what the check finds too deep, and reads the rest as it was
        with pytest.raises(BadRequest, match="nested deeper"):
            decode(raw, limit)
    else:
        assert decode(raw, limit)[0] == value


@pytest.mark.parametrize(
    ("value", "rounded"),
    [([1, 2.5, {"a": [-(2.0**63) - 4096]}], True), ({"t": [1e300]}, True), ([2**63, 1.5e18, 0.5], False)],
)
def test_a_float_an_integer_literal_may_have_become_is_found_at_any_depth(value: object, rounded: bool) -> None:
    assert scan_value(value, DEPTH) == (False, rounded)


@pytest.mark.parametrize("arrays", [10, 100_000], ids=["walked", "too-many-to-walk"])
def test_an_integer_beyond_64_bits_is_read_exactly_however_many_arrays_the_body_has(arrays: int) -> None:
    raw = b'{"model":"m","prompt":"x","extra":[%s],"seed":%d}' % (b",".join([b"[]"] * arrays), BIG)
    parsed = parse_request("completions", raw, max_depth=DEPTH)
    assert parsed.body["seed"] == BIG and parsed.stdlib_json


def test_a_body_of_millions_of_small_arrays_is_checked_in_steps_per_chunk_not_per_array() -> None:
    """6 MB of `[]` (2 million arrays at depth 2) once held the event loop a second past orjson's own time: the check
    walked the decoded value one Python step per array. Now the text is checked, a few Python lines per 256 KiB
    (counted over the whole parse, not timed)."""
    raw = b'{"model":"m","prompt":"x","extra":[' + b"[]," * 2_000_000 + b"[]]}"
    lines, parsed = _lines_run(
        parse_request, "completions", raw, max_depth=DEPTH, within=lambda f: "/gateway/" in f.f_code.co_filename
    )
    assert parsed.model == "m" and lines < 1000
    deep = b'{"model":"m","extra":[' + b"[]," * 1_000_000 + b"[" * (DEPTH + 1) + b"]" * (DEPTH + 1) + b"]}"
    with pytest.raises(BadRequest, match="nested deeper"):
        parse_request("completions", deep, max_depth=DEPTH)


@pytest.mark.parametrize(
    "body",
    [
        '{"model": ' + "[" * 5000 + "]" * 5000 + ', "prompt": "x"}',
        '{"model": "sim", "messages": [{"role": "user", "content": ' + "[" * 1000 + "]" * 1000 + "}]}",
        '{"model": "sim", "prompt": "x", "extra": ' + '{"a": ' * 1000 + "1" + "}" * 1000 + "}",
        '{"model": "sim", "prompt": ' + "[" * 100_000,  # not even valid JSON
    ],
)
async def test_deeply_nested_bodies_are_400_and_never_reach_an_engine(body: str, http: aiohttp.ClientSession) -> None:
    sim = SimConfig(model="sim", instant=True)
    async with gateway_over_sims([sim], admin={"key": "adm"}) as (gw, sims):
        for path, headers in (("/v1/chat/completions", {}), ("/admin/reload", {"Authorization": "Bearer adm"})):
            async with http.post(gw.url + path, data=body.encode(), headers=headers) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["code"] == "too_deep"
        assert sims[0].engine.stats.started + sims[0].engine.stats.rejected == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","cache_salt":"kvgate:other-tenant","prompt":"x","cache_salt":"mine"}',
        b'{"model":"a","model":"b","prompt":"x"}',
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"messages":[]}',
        # a conversation's "role": "user" values beside a key given twice (once with a space before its colon)
        b'{"model":"m","user":"a","messages":[{"role":"user","content":"x"},{"role": "user","content":"y"}],'
        b'"user" :"b"}',
    ],
)
def test_a_body_with_a_duplicate_key_is_refused(raw: bytes) -> None:
    endpoint = "chat" if b"messages" in raw else "completions"
    with pytest.raises(BadRequest) as caught:
        parse_request(endpoint, raw, max_depth=DEPTH)
    assert caught.value.code == "duplicate_key"


def test_repeated_field_names_inside_strings_are_fine() -> None:
    raw = b'{"model":"m","prompt":"say \\"model\\" and \\"model\\" again"}'
    assert parse_request("completions", raw, max_depth=DEPTH).model == "m"


def test_cache_isolation_needs_a_secret() -> None:
    with pytest.raises(ConfigError, match="cache_salt_secret"):
        load_config(overrides={"admission": {"tenants": {"t": {"cache_isolation": True}}}}, environ={})
    cfg = {"tenants": {"t": {"cache_isolation": True}}, "cache_salt_secret": "s"}
    assert load_config(overrides={"admission": cfg}, environ={}).admission.cache_salt_secret == "s"


# The nesting check on any bytes: what a parser that reads strings and escapes byte by byte finds, in a few Python
# steps per 256 KiB of structure (counted, not timed).


def _reference_deeper(raw: bytes, limit: int) -> bool:
    """Byte by byte: a backslash followed by a backslash or a quote is one escape, wherever it stands (outside a
    string, where a parser would stop, it reads the same); any other backslash escapes nothing that matters."""
    depth, inside, at = 0, False, 0
    while at < len(raw):
        byte = raw[at]
        at += 1
        if byte == 0x5C and raw[at : at + 1] in (b"\\", b'"'):
            at += 1
        elif byte == 0x22:
            inside = not inside
        elif inside:
            continue
        elif byte in b"[{":
            depth += 1
            if depth > limit:
                return True
        elif byte in b"]}" and depth:
            depth -= 1
    return False


def _lines_run(
    function: Callable[..., Any], *args: Any, within: Callable[[FrameType], bool] | None = None, **kwargs: Any
) -> tuple[int, Any]:
    """(Python lines executed inside `function`'s own frame, or with `within` in the frames it accepts, its result):
    a count of operations."""
    code, lines = function.__code__, [0]
    counted = within or (lambda frame: frame.f_code is code)

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        if not counted(frame):
            return None
        if event == "line":
            lines[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        result = function(*args, **kwargs)
    finally:
        sys.settrace(None)
    return lines[0], result


structural_bytes = st.binary(max_size=65_536) | st.lists(
    st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"\\\\", b'\\"', b"a", b" ", b"\xff"]), max_size=16_384
).map(b"".join)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(structural_bytes, st.integers(min_value=0, max_value=70))
def test_nesting_check_on_any_bytes_agrees_in_a_few_steps_per_chunk(raw: bytes, limit: int) -> None:
    assert nested_deeper(raw, limit) == _reference_deeper(raw, limit)
    structure = structure_of(raw)
    assert len(structure) <= len(raw)
    assert _lines_run(deeper_than, structure, limit)[0] <= 12 * (len(structure) // 2**18 + 1)  # per chunk, not byte


@pytest.mark.parametrize("letters", [26, 40])
async def test_an_unterminated_string_after_many_brackets_does_not_hold_the_gateway(
    letters: int, http: aiohttp.ClientSession
) -> None:
    hostile = b"[]" * 70 + b'"' + bytes(range(ord("a"), ord("a") + 26)) * 2  # 167 bytes at 26 letters
    hostile = hostile[: 141 + letters]
    normal = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 2}).encode()
    async with gateway_over_sims([SimConfig(model="sim", instant=True)]) as (gw, _):
        url = gw.url + "/v1/chat/completions"
        # Two connections: aiohttp's session opens one per concurrent request.
        hostile_post = asyncio.ensure_future(http.post(url, data=hostile))
        async with http.post(gw.url + "/v1/completions", data=normal) as resp:
            assert resp.status == 200, await resp.text()
        async with await hostile_post as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("answer", "tool_call"),
    [
        (b'{"choices":[{"index":0,"message":{"tool_calls":[]},"finish_reason":"tool_calls"}]}', True),
        (b'data: {"choices":[{"index":0,"delta":{},"finish_reason": "tool_calls"}]}\n\n', True),
        (b'{"type":"message","content":[{"type":"tool_use"}],"stop_reason":"tool_use"}', True),
        (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use"}}\n\n', True),
        (b'data: {"type":"response.output_item.added","item":{"type":"function_call","name":"run"}}\n\n', True),
        (b'{"choices":[{"index":0,"message":{"content":"x"},"finish_reason":"stop"}]}', False),
        (b'{"type":"message","stop_reason":"end_turn"}', False),
        # the words inside the model's text are escaped: not a key of the answer
        (
            b'{"choices":[{"message":{"content":"\\"finish_reason\\":\\"tool_calls\\""},"finish_reason":"length"}]}',
            False,
        ),
        (b'data: {"type":"response.created","response":{"tools":[{"type":"function","name":"run"}]}}\n\n', False),
    ],
)
def test_an_answer_ending_in_a_tool_call_is_recognised(answer: bytes, tool_call: bool) -> None:
    assert ends_in_tool_call(answer) is tool_call


async def test_a_body_its_content_encoding_does_not_decode_is_a_400() -> None:
    async with gateway_over_sims([SimConfig(model="sim", instant=True)]) as (gw, _), aiohttp.ClientSession() as http:
        body = json.dumps({"model": "sim", "prompt": "x", "max_tokens": 2}).encode()
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        async with http.post(gw.url + "/v1/completions", data=body, headers=headers) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_http_request"
        async with http.post(gw.url + "/v1/completions", data=body) as resp:  # the connection still serves
            assert resp.status == 200


@pytest.mark.parametrize(
    ("prompt", "read"),
    [
        ([0.0, 5.0, 17.0], [0, 5, 17]),  # token ids as vLLM's request model reads them (pydantic's lax int)
        ([[0.0, 5.0], [17]], [[0, 5], [17]]),
        ([True, 5, 17], [1, 5, 17]),
        (["5", "17"], ["5", "17"]),  # strings: a batch of text prompts
    ],
)
def test_a_prompt_vllm_accepts_is_accepted_and_read_as_vllm_reads_it(prompt: Any, read: Any) -> None:
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    parsed = parse_request("completions", raw, max_depth=DEPTH)
    assert parsed.body["prompt"] == read and engine_body(parsed, raw, salted=False) is raw  # the engine's bytes


@pytest.mark.parametrize("prompt", [[0.5, 5], [[1], []], [], [None], {"a": 1}])
def test_a_prompt_vllm_refuses_is_refused(prompt: Any) -> None:
    with pytest.raises(BadRequest, match="'prompt' must be"):
        parse_request("completions", json.dumps({"model": "m", "prompt": prompt}).encode(), max_depth=DEPTH)


@pytest.mark.parametrize("prompt", [{}, {"prompt": None}])
def test_prompt_embeds_need_no_prompt(prompt: dict[str, Any]) -> None:
    """vLLM's --enable-prompt-embeds: embeddings instead of a prompt; the engine reads them (and says when off)."""
    raw = json.dumps({"model": "m", "prompt_embeds": "AAAA", **prompt}).encode()
    assert parse_request("completions", raw, max_depth=DEPTH).body["prompt_embeds"] == "AAAA"
    with pytest.raises(BadRequest, match="'prompt' is required"):
        parse_request("completions", json.dumps({"model": "m"}).encode(), max_depth=DEPTH)


@pytest.mark.parametrize(
    ("options", "include_usage", "continuous"),
    [
        ({"include_usage": "false"}, False, False),  # pydantic's lax bool, as vLLM's request model reads it
        ({"include_usage": "true", "continuous_usage_stats": 0}, True, False),
        ({"include_usage": 1, "continuous_usage_stats": "yes"}, True, True),
        ({}, False, False),
    ],
)
def test_stream_options_flags_are_read_as_vllm_reads_them(
    options: dict[str, Any], include_usage: bool, continuous: bool
) -> None:
    raw = json.dumps({"model": "m", "prompt": "p", "stream": "yes", "stream_options": options}).encode()
    parsed = parse_request("completions", raw, max_depth=DEPTH)
    assert (parsed.stream, parsed.include_usage, parsed.continuous_usage) == (True, include_usage, continuous)


def test_a_stream_option_vllm_would_refuse_is_a_400_naming_it() -> None:
    raw = json.dumps({"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": "maybe"}})
    with pytest.raises(BadRequest) as refused:
        parse_request("completions", raw.encode(), max_depth=DEPTH)
    assert refused.value.param == "stream_options.include_usage"
