"""CacheAwareState end to end: request_info -> overlap -> on_routed -> on_finished, sessions, KV events from a real
ZMQ publisher, metrics on the given registry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry

from cacheindex.config import CacheConfig
from cacheindex.state import CacheAwareState, PrefixRequestInfo
from policies.base import Decision
from simengine import tokenize as sim_tokenize

BS = 4
SYSTEM = "You are a helpful assistant. " * 20


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], **extra}


@pytest.fixture
async def state() -> AsyncIterator[CacheAwareState]:
    config = CacheConfig(speculative_ttl_s=0, tokenizer_thread_min_chars=100, python_tokenizer_thread_min_chars=100)
    s = CacheAwareState(config, CollectorRegistry())  # low thresholds: long prompts take the thread-pool path
    s.add_replica("r1", model="m", block_size=BS, num_blocks=1000, kv_events_endpoint=None, tokenizer="sim")
    s.add_replica("r2", model="m", block_size=BS, num_blocks=1000, kv_events_endpoint=None, tokenizer="sim")
    await s.start()
    yield s
    await s.stop()


def sample(s: CacheAwareState, name: str, **labels: str) -> float | None:
    return s.registry.get_sample_value(name, labels)


async def info(s: CacheAwareState, body: dict[str, Any], **kw: Any) -> PrefixRequestInfo:
    args: dict[str, Any] = {"model": "m", "endpoint": "chat", "tenant": "t", "session_key": None} | kw
    return await s.request_info(body=body, **args)


async def test_request_info_uses_the_sim_tokenizer_and_block_size(state: CacheAwareState) -> None:
    i = await info(state, chat("hello"))
    tokens = sim_tokenize.tokenize_chat(chat("hello")["messages"], True)
    assert i.prompt_tokens == len(tokens) and i.block_size == BS and len(i.block_hashes) == len(tokens) // BS
    assert i.tokenizer_kind == "sim" and not i.approximate
    assert sample(state, "kvgate_prefix_requests_total", tokenizer="sim", approximate="false") == 1


@pytest.mark.parametrize(("python_min_chars", "expect_thread"), [(None, False), (100, True)])
async def test_pure_python_tokenizers_stay_on_the_loop_below_their_threshold(
    python_min_chars: int | None, expect_thread: bool
) -> None:
    """sim is a pure-Python tokenizer: a 1-2k character prompt is tokenized inline under the default thresholds
    (a thread would only add hand-off latency), in the pool once past `python_tokenizer_thread_min_chars`."""
    extra = {} if python_min_chars is None else {"python_tokenizer_thread_min_chars": python_min_chars}
    s = CacheAwareState(CacheConfig(tokenizer_thread_min_chars=100, **extra), CollectorRegistry())
    s.add_replica("r1", model="m", block_size=BS, num_blocks=100, kv_events_endpoint=None, tokenizer="sim")
    await s.start()
    try:
        tok = await s.tokenizer("sim")
        assert tok.pure_python
        threads: list[str] = []
        original = tok.tokenize_chat

        def recording(*args: Any, **kwargs: Any) -> list[int]:
            threads.append(threading.current_thread().name)
            return original(*args, **kwargs)

        tok.tokenize_chat = recording  # type: ignore[method-assign]
        i = await info(s, chat("x" * 1000))
        assert i.prompt_tokens > 0 and len(threads) == 1
        assert threads[0].startswith("kvgate-tokenize") is expect_thread
    finally:
        await s.stop()


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("chat", {"messages": [{"role": "x" * 1000, "content": "hi"}]}),
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "t", "description": "y" * 1000, "parameters": {}}}],
            },
        ),
        ("completions", {"prompt": ["z" * 1000, "short"]}),
    ],
    ids=["long-role", "long-tools", "batch-first-prompt"],
)
async def test_a_long_prompt_anywhere_in_the_request_is_tokenized_off_the_loop(
    endpoint: str, body: dict[str, Any]
) -> None:
    """The size estimate counted only message text and a batch's length: a 7 MB `role` or a batch's 7 MB first
    prompt was tokenized on the event loop (a quarter second each)."""
    s = CacheAwareState(CacheConfig(python_tokenizer_thread_min_chars=500), CollectorRegistry())
    s.add_replica("r1", model="m", block_size=BS, num_blocks=100, kv_events_endpoint=None, tokenizer="sim")
    await s.start()
    try:
        tok = await s.tokenizer("sim")
        threads: list[str] = []
        for name in ("tokenize_chat", "tokenize_text"):
            original = getattr(tok, name)

            def recording(*args: Any, _original: Any = original, **kwargs: Any) -> list[int]:
                threads.append(threading.current_thread().name)
                return list(_original(*args, **kwargs))

            setattr(tok, name, recording)
        await info(s, {"model": "m", **body}, endpoint=endpoint)
        assert threads and threads[0].startswith("kvgate-tokenize"), threads
    finally:
        await s.stop()


async def test_shared_prefix_overlaps_after_routing(state: CacheAwareState) -> None:
    first = await info(state, chat("question one"))
    assert state.overlap(first, ["r1", "r2"]) == {"r1": 0, "r2": 0}
    state.on_routed(first, Decision("r1", "cold-least-load"))
    second = await info(state, chat("another question"))
    ov = state.overlap(second, ["r1", "r2"])
    shared = len(sim_tokenize.render_chat([{"role": "system", "content": SYSTEM}], False).encode()) // (4 * BS)
    assert ov["r2"] == 0 and shared <= ov["r1"] < len(second.block_hashes)


async def test_cache_salt_separates_tenants(state: CacheAwareState) -> None:
    a = await info(state, chat("q", cache_salt="tenant-a"))
    state.on_routed(a, Decision("r1", "cold-least-load"))
    b = await info(state, chat("q", cache_salt="tenant-b"))
    assert state.overlap(b, ["r1"]) == {"r1": 0}
    assert state.overlap(await info(state, chat("q", cache_salt="tenant-a")), ["r1"])["r1"] == len(a.block_hashes)


async def test_completions_prompts(state: CacheAwareState) -> None:
    text = await info(state, {"prompt": "abcd" * 10}, endpoint="completions")
    ids = await info(state, {"prompt": sim_tokenize.tokenize_text("abcd" * 10)}, endpoint="completions")
    batch = await info(state, {"prompt": ["abcd" * 10, "zzzz"]}, endpoint="completions")
    assert text.block_hashes == ids.block_hashes == batch.block_hashes and len(text.block_hashes) == 2


async def test_untokenizable_request_routes_without_blocks(state: CacheAwareState) -> None:
    i = await info(state, {"messages": "nope"})
    assert i.block_hashes == () and i.prompt_tokens == 0
    assert sample(state, "kvgate_prefix_tokenize_errors_total", tokenizer="sim") == 1


async def test_sessions_from_header_or_user_scoped_by_tenant(state: CacheAwareState) -> None:
    i = await info(state, chat("x"), session_key="s1")
    assert state.session_replica(i) is None
    state.on_routed(i, Decision("r2", "cold-least-load"))
    assert state.session_replica(await info(state, chat("y"), session_key="s1")) == "r2"
    assert state.session_replica(await info(state, chat("y"), session_key="s1", tenant="other")) is None
    u = await info(state, chat("x", user="alice"))
    assert u.session_key == "alice"
    state.on_routed(u, Decision("r1", "cold-least-load"))
    state.remove_replica("r1")
    assert state.session_replica(u) is None
    assert sample(state, "kvgate_sessions") == 1


async def test_parity_metrics(state: CacheAwareState, caplog: pytest.LogCaptureFixture) -> None:
    first = await info(state, chat("p"))
    state.on_routed(first, Decision("r1", "cold-least-load"))
    state.on_finished(first, "r1", 0)
    second = await info(state, chat("p"))  # identical prompt: all blocks predicted, minus the last-token block
    state.on_routed(second, Decision("r1", "cache-hit"))
    n = len(second.block_hashes)
    expected = min(n, (second.prompt_tokens - 1) // BS) * BS
    state.on_finished(second, "r1", expected - 2 * BS)
    assert sample(state, "kvgate_prefix_predicted_cached_tokens_total", model="m") == expected
    assert sample(state, "kvgate_prefix_reported_cached_tokens_total", model="m") == expected - 2 * BS
    assert sample(state, "kvgate_prefix_cached_tokens_gap_count", model="m") == 2
    assert sample(state, "kvgate_prefix_cached_tokens_gap_sum", model="m") == 2 * BS
    state.on_finished(second, "r1", 5)  # already finished: ignored
    assert sample(state, "kvgate_prefix_cached_tokens_gap_count", model="m") == 2


async def test_an_overlap_asked_twice_for_a_request_follows_changes_in_between() -> None:
    """Admission's latency check and the router ask for the same request's overlap; what changed in between (a
    request routed, the replicas asked differ) is in the second answer."""
    s = CacheAwareState(CacheConfig(), CollectorRegistry())
    for rid in ("r1", "r2"):
        s.add_replica(rid, model="m", block_size=BS, num_blocks=None, kv_events_endpoint=None, tokenizer="sim")
    first = await info(s, chat("shared " * 40))
    assert s.overlap(first, ["r1", "r2"]) == {"r1": 0, "r2": 0}
    s.on_routed(await info(s, chat("shared " * 40)), Decision("r2", "cold-least-load"))
    blocks = len(first.block_hashes)
    assert s.overlap(first, ["r1", "r2"]) == {"r1": 0, "r2": blocks}  # not the answer from before the routing
    assert s.overlap(first, ["r2"]) == {"r2": blocks}
    await s.stop()


async def test_persistent_parity_gap_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    s = CacheAwareState(CacheConfig(parity_window=3), CollectorRegistry())
    s.add_replica("r1", model="m", block_size=BS, num_blocks=None, kv_events_endpoint=None, tokenizer="sim")
    for _ in range(3):
        i = await info(s, chat("same"))
        s.on_routed(i, Decision("r1", "cache-hit"))
        s.on_finished(i, "r1", i.prompt_tokens)  # engine says all cached, kvgate predicted none the first time
    s.on_routed(i := await info(s, chat("same")), Decision("r1", "cache-hit"))
    assert any("prefix prediction for m is off" in r.message for r in caplog.records)
    await s.stop()


async def test_large_prompts_tokenized_in_the_pool_match_inline(state: CacheAwareState) -> None:
    small_cfg = await info(state, chat("z" * 50))
    big = await info(state, chat("z" * 5000))
    assert big.block_hashes[: len(small_cfg.block_hashes) - 20] == small_cfg.block_hashes[:-20]


async def test_chars_fallback_for_unknown_models_and_bad_paths(tmp_path: Path) -> None:
    s = CacheAwareState(CacheConfig(tokenizers={"bad": str(tmp_path / "missing")}), CollectorRegistry())
    s.add_replica("x", model="other", block_size=None, num_blocks=None, kv_events_endpoint="tcp://h:1", tokenizer=None)
    i = await info(s, chat("hello"), model="other")
    assert i.approximate and i.tokenizer_kind == "chars" and i.block_size == 16
    j = await info(s, chat("hello"), model="bad")
    assert j.approximate
    await s.start()  # chars replicas get no KV event subscriber
    assert sample(s, "kvgate_prefix_requests_total", tokenizer="chars", approximate="true") == 2
    await s.stop()


class SignallingState(CacheAwareState):
    """The real state, telling the test when its event sink ran."""

    def __init__(self, config: CacheConfig, registry: CollectorRegistry) -> None:
        super().__init__(config, registry)
        self.batches: asyncio.Queue[str] = asyncio.Queue()

    def on_kv_events(self, replica_id: str, events: Any) -> None:
        super().on_kv_events(replica_id, events)
        self.batches.put_nowait("events")

    def on_kv_reset(self, replica_id: str, reason: str) -> None:
        super().on_kv_reset(replica_id, reason)
        self.batches.put_nowait(reason)


async def next_signal(s: SignallingState) -> str:
    async with asyncio.timeout(30):
        return await s.batches.get()


async def test_kv_events_drive_the_index() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    s = SignallingState(CacheConfig(speculative_ttl_s=1000), CollectorRegistry())
    s.add_replica(
        "r1", model="m", block_size=BS, num_blocks=100, kv_events_endpoint=pub.getsockopt_string(zmq.LAST_ENDPOINT),
        tokenizer="sim",
    )  # fmt: skip
    await s.start()
    try:
        await pub.recv()  # subscribed
        i = await info(s, chat("q", cache_salt="salt"))
        tokens = sim_tokenize.tokenize_chat(chat("q")["messages"], True)
        full = len(tokens) // BS * BS
        events: list[Any] = [
            {"type": "BlockStored", "block_hashes": [1000 + k for k in range(4)], "parent_block_hash": None,
             "token_ids": tokens[: 4 * BS], "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [["salt"], None, None, None]},
            {"type": "BlockStored", "block_hashes": [1000 + k for k in range(4, full // BS)],
             "parent_block_hash": 1003, "token_ids": tokens[4 * BS : full], "block_size": BS, "lora_id": None,
             "medium": "GPU", "lora_name": None},
        ]  # fmt: skip
        await pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), msgpack.packb([1.0, events, None])])
        removed = [{"type": "BlockRemoved", "block_hashes": [1006], "medium": "GPU"}]
        await pub.send_multipart([b"kv-events", (1).to_bytes(8, "big"), msgpack.packb([1.0, removed])])
        assert [await next_signal(s), await next_signal(s)] == ["events", "events"]
        assert sample(s, "kvgate_kv_events_total", replica="r1", type="BlockStored") == 2
        assert s.overlap(i, ["r1"]) == {"r1": 6}
        assert sample(s, "kvgate_prefix_index_blocks", replica="r1") == full // BS - 1
        # an engine restart (sequence back to 0) clears the replica
        cleared = [{"type": "AllBlocksCleared"}]
        await pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), msgpack.packb([1.0, cleared])])
        assert [await next_signal(s), await next_signal(s)] == ["restart", "events"]
        assert s.overlap(i, ["r1"]) == {"r1": 0}
    finally:
        await s.stop()
        pub.close(linger=0)
        ctx.term()


async def test_a_prompt_with_an_image_is_hashed_up_to_the_message_that_holds_it(state: CacheAwareState) -> None:
    """vLLM's blocks from an image on carry the image's own hash: two prompts alike in text but not in their images
    share only what comes before the image. Hashed as their text, they were one prompt (a predicted hit on a replica
    that recomputes everything after the system prompt)."""

    def with_image(url: str) -> dict[str, Any]:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is in it? " * 30}]
        return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]}

    cat, dog = await info(state, with_image("https://x/cat.png")), await info(state, with_image("https://x/dog.png"))
    system_only = await info(
        state, {"messages": [{"role": "system", "content": SYSTEM}], "add_generation_prompt": False}
    )
    assert cat.block_hashes == dog.block_hashes == system_only.block_hashes and cat.block_hashes
    first = {"messages": [{"role": "user", "content": with_image("https://x/cat.png")["messages"][1]["content"]}]}
    assert (await info(state, first)).block_hashes == ()  # the image in the first message: nothing before it
