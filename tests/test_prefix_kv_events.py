"""KV events: vLLM's wire format decoded; a real ZMQ publisher drives the subscriber through gaps, restarts and
replay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from cacheindex.kv_events import (
    AllBlocksClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    KvEvent,
    KvEventDecodeError,
    KvEventSubscriber,
    decode_kv_event_batch,
)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    # exactly what vLLM 0.32's msgspec encoder produces for BlockStored (checked against vllm.distributed.kv_events)
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def batch(*events: Any) -> bytes:
    payload: bytes = msgpack.packb([1.5, list(events), None])
    return payload


def test_decode_map_encoded_events() -> None:
    ts, events = decode_kv_event_batch(
        batch(stored([1, 2], None, [1, 2, 3, 4]), {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
              {"type": "AllBlocksCleared"}, {"type": "SomethingNew"})
    )  # fmt: skip
    assert ts == 1.5
    assert events == [
        BlockStoredEvent([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, None),
        BlockRemovedEvent([3], "GPU", None),
        AllBlocksClearedEvent(),
    ]


def test_decode_tagged_array_events_and_bytes_hashes() -> None:
    _, events = decode_kv_event_batch(
        msgpack.packb(
            [2.0, [["BlockStored", [b"\x01" * 32], b"\x02" * 32, [5, 6], 2, None, None], ["BlockRemoved", [7]]]]
        )
    )
    assert events == [BlockStoredEvent([b"\x01" * 32], b"\x02" * 32, [5, 6], 2), BlockRemovedEvent([7])]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, [{"type": "BlockStored"}]])])
def test_decode_errors(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_kv_event_batch(payload)


class Sink:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.changed = asyncio.Event()

    def on_kv_events(self, replica_id: str, events: Sequence[KvEvent]) -> None:
        self.log.append(("events", [e.block_hashes for e in events if isinstance(e, BlockStoredEvent)]))
        self.changed.set()

    def on_kv_reset(self, replica_id: str, reason: str) -> None:
        self.log.append(("reset", reason))
        self.changed.set()

    async def wait_for(self, n: int) -> None:
        async with asyncio.timeout(30):
            while len(self.log) < n:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.term()


async def publisher(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, str]:
    pub = ctx.socket(zmq.XPUB)  # XPUB: lets the test wait until the subscriber's subscription arrived
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    return pub, pub.getsockopt_string(zmq.LAST_ENDPOINT)


async def send(pub: zmq.asyncio.Socket, seq: int, payload: bytes) -> None:
    await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])


async def test_subscriber_applies_in_order_and_resets_on_gap_and_restart(ctx: zmq.asyncio.Context) -> None:
    pub, endpoint = await publisher(ctx)
    sink = Sink()
    sub = KvEventSubscriber(ctx, "r1", endpoint, sink, topic="kv-events")
    sub.start()
    try:
        assert (await pub.recv()) == b"\x01kv-events"
        await send(pub, 0, batch(stored([1], None, [1, 2])))
        await send(pub, 1, batch(stored([2], 1, [3, 4])))
        await send(pub, 5, batch(stored([9], None, [9, 9])))  # gap, no replay endpoint
        await send(pub, 0, batch(stored([7], None, [7, 7])))  # engine restarted
        await send(pub, 1, b"\xc1")  # undecodable
        await sink.wait_for(7)
        assert sink.log == [
            ("events", [[1]]),
            ("events", [[2]]),
            ("reset", "gap"),
            ("events", [[9]]),
            ("reset", "restart"),
            ("events", [[7]]),
            ("reset", "decode-error"),
        ]
    finally:
        await sub.stop()
        pub.close(linger=0)


def replay_server(
    ctx: zmq.asyncio.Context, buffered: dict[int, bytes]
) -> tuple[zmq.asyncio.Socket, str, asyncio.Task[None]]:
    """vLLM's ZmqEventPublisher._service_replay over `buffered` (what the publisher holds at each request)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")

    async def serve() -> None:
        while True:
            client, _, start = await router.recv_multipart()
            for seq in sorted(buffered):
                if seq >= int.from_bytes(start, "big"):
                    await router.send_multipart([client, b"", b"kv-events", seq.to_bytes(8, "big"), buffered[seq]])
            await router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    return router, router.getsockopt_string(zmq.LAST_ENDPOINT), asyncio.create_task(serve())


async def test_gap_filled_by_replay(ctx: zmq.asyncio.Context) -> None:
    pub, endpoint = await publisher(ctx)
    buffered: dict[int, bytes] = {}  # nothing published before the subscriber starts
    router, replay_endpoint, server = replay_server(ctx, buffered)
    sink = Sink()
    sub = KvEventSubscriber(ctx, "r1", endpoint, sink, replay_endpoint=replay_endpoint)
    sub.start()
    try:
        assert (await pub.recv()) == b"\x01"
        buffered.update({seq: batch(stored([seq], None, [seq, seq])) for seq in range(0, 5)})
        await send(pub, 0, buffered[0])
        await send(pub, 3, buffered[3])  # 1 and 2 were lost: replayed, then 3 applied live
        await send(pub, 4, buffered[4])
        await sink.wait_for(5)
        assert sink.log == [("events", [[s]]) for s in range(5)]
    finally:
        server.cancel()
        await sub.stop()
        pub.close(linger=0)
        router.close(linger=0)


async def test_a_subscriber_started_late_rebuilds_from_the_replay_buffer(ctx: zmq.asyncio.Context) -> None:
    """A gateway (re)started while the engine runs learns what the engine cached before: the replay of the whole
    buffer; the live batches the replay already delivered are not applied twice."""
    pub, endpoint = await publisher(ctx)
    buffered = {seq: batch(stored([seq], None, [seq, seq])) for seq in range(3, 7)}  # 0-2 left the buffer
    router, replay_endpoint, server = replay_server(ctx, buffered)
    sink = Sink()
    sub = KvEventSubscriber(ctx, "r1", endpoint, sink, replay_endpoint=replay_endpoint)
    sub.start()
    try:
        assert (await pub.recv()) == b"\x01"
        await sink.wait_for(4)
        await send(pub, 6, buffered[6])  # published while the replay ran: delivered once
        buffered[7] = batch(stored([7], None, [7, 7]))
        await send(pub, 7, buffered[7])
        await sink.wait_for(5)
        assert sink.log == [("events", [[s]]) for s in range(3, 8)]
    finally:
        server.cancel()
        await sub.stop()
        pub.close(linger=0)
        router.close(linger=0)


async def test_stop_is_clean_without_any_message(ctx: zmq.asyncio.Context) -> None:
    pub, endpoint = await publisher(ctx)
    sub = KvEventSubscriber(ctx, "r1", endpoint, Sink())
    sub.start()
    await pub.recv()
    await sub.stop()
    await sub.stop()  # idempotent
    pub.close(linger=0)
