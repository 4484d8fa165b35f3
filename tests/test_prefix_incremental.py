"""Incremental chat tokenization: a growing conversation, tokenized turn by turn through the prefix cache, gives the
same token count and block hashes as a full tokenization, for the tiny model's template and for templates whose
boundaries are unsafe or that rewrite earlier text (those fall back, counted)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheindex.hashing import chain_hashes, context_seed
from cacheindex.incremental import ChatPrefixCache
from cacheindex.tokenizers import HfPromptTokenizer

BS = 4
SEED = context_seed("m", None, "salt")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="the tokenizer extra is not installed")
    from engine_pool.tiny_model import _build_tokenizer

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    _build_tokenizer(out, 1 << 20)
    return out


def with_template(src: Path, dst: Path, template: str) -> HfPromptTokenizer:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return HfPromptTokenizer(str(dst))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> HfPromptTokenizer:
    return HfPromptTokenizer(str(tiny_dir))


def tokens_and_hashes(
    cache: ChatPrefixCache, tok: HfPromptTokenizer, messages: Any, agp: bool, kwargs: Any, *, block_size: int, seed: int
) -> tuple[int, list[int]]:
    """A prompt through the cache at once, as the gateway does for all but a conversation's long new turn."""
    return cache.finish(cache.prepare(tok, messages, agp, kwargs, block_size=block_size, seed=seed))


def full(tok: HfPromptTokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> tuple[int, list[int]]:
    tokens = tok.tokenize_chat(messages, True, kwargs)
    return len(tokens), chain_hashes(tokens, BS, SEED)


def grow(tok: HfPromptTokenizer, conversation: list[dict[str, Any]], kwargs: dict[str, Any]) -> Counter[str]:
    """Send every prefix of the conversation that ends with a user message, in order, as an agent would; each
    must equal the full tokenization. Returns the outcomes counted."""
    outcomes: Counter[str] = Counter()
    cache = ChatPrefixCache(1 << 24, on_outcome=lambda outcome: outcomes.update([outcome]))
    for end in range(1, len(conversation) + 1):
        if conversation[end - 1]["role"] != "user":
            continue
        messages = conversation[:end]
        prompt = cache.prepare(tok, messages, True, kwargs, block_size=BS, seed=SEED)
        # after a turn's reuse, what is left is the answer and the user's reply: encoded after routing when long
        assert prompt.new_turn == (prompt.outcome == "hit"), f"turn {end}"
        assert cache.finish(prompt) == full(tok, messages, kwargs), f"turn {end}"
    return outcomes


text = st.text(alphabet=st.sampled_from("ab cdé\n日<|>{}x.!"), min_size=0, max_size=40)
content = st.one_of(
    text,
    st.lists(
        st.one_of(
            st.builds(lambda t: {"type": "text", "text": t}, text),
            st.just({"type": "image_url", "image_url": {"url": "http://x/i.png"}}),
        ),
        max_size=3,
    ),
)
turn = st.tuples(content, content)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), content), turns=st.lists(turn, min_size=1, max_size=6))
def test_incremental_equals_full_on_random_conversations(
    tiny: HfPromptTokenizer, system: Any, turns: list[tuple[Any, Any]]
) -> None:
    conversation: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    for user, assistant in turns:
        conversation += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    outcomes = grow(tiny, conversation, {})
    users = sum(m["role"] == "user" for m in conversation)
    assert outcomes["hit"] == users - 1  # every turn after the first reuses the one before
    assert outcomes["miss"] == 1


def test_a_long_history_is_encoded_once(tiny: HfPromptTokenizer) -> None:
    conversation = [{"role": "system", "content": "rules " * 200}]
    encoded: list[int] = []
    real_encode = tiny.encode

    def counting(t: str) -> list[int]:
        encoded.append(len(t))
        return real_encode(t)

    cache = ChatPrefixCache(1 << 24)
    tiny.encode = counting  # type: ignore[method-assign]
    try:
        for i in range(10):
            conversation.append({"role": "user", "content": f"question {i} " * 50})
            tokens_and_hashes(cache, tiny, conversation, True, {}, block_size=BS, seed=SEED)
            conversation.append({"role": "assistant", "content": f"answer {i} " * 50})
    finally:
        del tiny.encode
    total_text = len(tiny.render_chat(conversation, False, {})[1])
    assert sum(encoded) < 1.1 * total_text  # each character encoded about once over ten turns


def test_unsafe_boundaries_and_rewriting_templates_fall_back_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    plain = with_template(tiny_dir, tmp_path / "plain", (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    ))  # fmt: skip
    counting = with_template(tiny_dir, tmp_path / "counting", (
        "{{ bos_token }}{{ messages | length }} messages<|eot_id|>{% for m in messages %}<|start_header_id|>"
        "{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    ))  # fmt: skip
    conversation = []
    for i in range(4):
        conversation += [{"role": "user", "content": f"u{i} text"}, {"role": "assistant", "content": f"a{i}"}]
    assert grow(plain, conversation, {}) == Counter(unsafe=4)
    assert grow(counting, conversation, {}) == Counter(miss=1, rewritten=3)


def test_template_kwargs_and_salt_are_part_of_the_key(tiny: HfPromptTokenizer) -> None:
    cache = ChatPrefixCache(1 << 24)
    first = [{"role": "user", "content": "hello there"}]
    second = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    tokens_and_hashes(cache, tiny, first, True, {}, block_size=BS, seed=SEED)
    other_seed = context_seed("m", None, "another tenant")
    got = tokens_and_hashes(cache, tiny, second, True, {}, block_size=BS, seed=other_seed)
    tokens = tiny.tokenize_chat(second, True, {})
    assert got == (len(tokens), chain_hashes(tokens, BS, other_seed))


def test_the_cache_is_bounded_by_bytes(tiny: HfPromptTokenizer) -> None:
    cache = ChatPrefixCache(4096)
    for i in range(50):
        tokens_and_hashes(cache, tiny, [{"role": "user", "content": f"{i} " * 40}], True, {}, block_size=BS, seed=SEED)
    assert 0 < len(cache) < 50 and cache.bytes <= 4096


def test_prompts_that_share_only_a_system_prompt_encode_just_their_question(tiny: HfPromptTokenizer) -> None:
    system = {"role": "system", "content": "tools and rules " * 100}
    prompts = [[system, {"role": "user", "content": f"question number {i}"}] for i in range(5)]  # single-turn
    expected = [full(tiny, messages, {}) for messages in prompts]
    outcomes: Counter[str] = Counter()
    cache = ChatPrefixCache(1 << 24, on_outcome=lambda outcome: outcomes.update([outcome]))
    encoded: list[int] = []
    real_encode = tiny.encode

    def counting(t: str) -> list[int]:
        encoded.append(len(t))
        return real_encode(t)

    tiny.encode = counting  # type: ignore[method-assign]
    try:
        got = [tokens_and_hashes(cache, tiny, messages, True, {}, block_size=BS, seed=SEED) for messages in prompts]
    finally:
        del tiny.encode
    assert got == expected  # exactly what a full tokenization gives
    assert outcomes == Counter(miss=1, hit=4)
    head = len(tiny.render_chat([system], False, {})[1])
    first = sum(encoded) - sum(encoded[-4 * 2 :])  # each later prompt encodes its question and the suffix
    assert first >= head and sum(encoded[-8:]) < head / 2  # the system prompt was encoded once, by the first


def test_a_new_turn_is_known_up_to_the_answer_before_it_is_encoded(tiny: HfPromptTokenizer) -> None:
    """What routing sees of a conversation's new turn before `finish`: the blocks of everything before the last
    answer (a prefix of the whole chain), the length estimated; `finish` gives the exact whole."""
    cache = ChatPrefixCache(1 << 24)
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent with tools. " * 20},
        {"role": "user", "content": "Read the module and fix the bug."},
    ]
    tokens_and_hashes(cache, tiny, conversation, True, {}, block_size=BS, seed=SEED)
    call = {"id": "call_0", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
    conversation += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "def f(x):\n    return x + 1  # line\n" * 60},
    ]
    whole = full(tiny, conversation, {})
    prompt = cache.prepare(tiny, conversation, True, {}, block_size=BS, seed=SEED)
    assert prompt.outcome == "hit" and prompt.new_turn
    known = list(prompt.hashes)
    assert 0 < len(known) < len(whole[1]) and whole[1][: len(known)] == known
    assert abs(prompt.estimate() - whole[0]) < 0.25 * whole[0]
    assert cache.finish(prompt) == whole

    again = cache.prepare(tiny, conversation, True, {}, block_size=BS, seed=SEED)  # the same request once more
    assert not again.new_turn and again.start == again.end  # reused through its last message: nothing new
    assert cache.finish(again) == whole

    question = [*conversation[:1], {"role": "user", "content": "Another task, same system prompt."}]
    fresh = cache.prepare(tiny, question, True, {}, block_size=BS, seed=SEED)
    assert not fresh.new_turn  # a new user question after a shared system prompt is routed on all of it
    assert cache.finish(fresh) == full(tiny, question, {})
