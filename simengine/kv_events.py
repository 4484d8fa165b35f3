"""KV-cache events in vLLM's ZMQ wire format: event types, encoder, decoder and an asyncio publisher.

Wire format (vllm/distributed/kv_events.py, msgspec): one ZMQ message per batch with three frames,
``topic`` bytes, the sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher; restarts at 0 with the
engine) and the msgpack payload. The payload is `KVEventBatch`, an ``array_like`` struct: ``[ts, events, dp_rank]``.
Events are tagged structs that are *not* array_like, so each is a map whose first key is ``"type"``:
``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
"lora_name", ["extra_keys"], ["group_idx"], ...}``, ``{"type": "BlockRemoved", "block_hashes", "medium",
["group_idx"]}``, ``{"type": "AllBlocksCleared"}``; bracketed fields have defaults and are omitted while equal to
them (msgspec ``omit_defaults``). The decoder also accepts the older array_like events (``["BlockStored", ...]``)
and bytes hashes (converted like vLLM's ``maybe_convert_block_hash``: low 64 bits, big-endian).

The publisher binds an XPUB socket (wire-compatible with vLLM's PUB for SUB clients) so it can also tell when a
subscriber has joined; events are queued in a bounded deque and sent by one background task, coalesced into one
batch per wake-up, so publishing never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # vLLM's KV offloading tier
_MASK64 = (1 << 64) - 1

BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def _event_to_wire(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = list(event.extra_keys)
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def encode_kv_event_batch(batch: KVEventBatch) -> bytes:
    """msgpack payload, byte-compatible with vLLM's msgspec encoding of its `KVEventBatch`."""
    wire = [float(batch.ts), [_event_to_wire(e) for e in batch.events], batch.data_parallel_rank]
    data: bytes = msgpack.packb(wire, use_bin_type=True)
    return data


def _hash(value: Any, int_hashes: bool) -> BlockHash:
    if isinstance(value, bytes) and int_hashes:
        return int.from_bytes(value, "big") & _MASK64
    if isinstance(value, (int, bytes)) and not isinstance(value, bool):
        return value
    raise KVEventDecodeError(f"block hash must be an int or bytes, got {type(value).__name__}")


def _hashes(value: Any, int_hashes: bool) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise KVEventDecodeError("block_hashes must be an array")
    return tuple(_hash(v, int_hashes) for v in value)


# Field order of the older array_like (tagged) event encoding, after the tag.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _decode_event(raw: Any, int_hashes: bool) -> KVEvent | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_ARRAY_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        raise KVEventDecodeError("an event must be a map with 'type' or a tagged array")
    try:
        if kind == "BlockStored":
            parent = fields.get("parent_block_hash")
            extra = fields.get("extra_keys")
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"], int_hashes),
                parent_block_hash=None if parent is None else _hash(parent, int_hashes),
                token_ids=tuple(int(t) for t in fields["token_ids"]),
                block_size=int(fields["block_size"]),
                lora_id=fields.get("lora_id"),
                medium=fields.get("medium"),
                lora_name=fields.get("lora_name"),
                extra_keys=None if extra is None else tuple(extra),
                group_idx=fields.get("group_idx"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=_hashes(fields["block_hashes"], int_hashes),
                medium=fields.get("medium"),
                group_idx=fields.get("group_idx"),
            )
    except (KeyError, TypeError) as exc:
        raise KVEventDecodeError(f"malformed {kind} event: {exc}") from exc
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this decoder does not know: skipped for forward compatibility


def decode_kv_event_batch(payload: bytes, *, int_hashes: bool = True) -> KVEventBatch:
    """Decode the msgpack payload frame of a vLLM (or simulator) KV event message.

    Unknown event types are skipped. With ``int_hashes`` bytes hashes become 64-bit ints as vLLM publishes them
    with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``. Raises `KVEventDecodeError` on anything malformed.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise KVEventDecodeError("a KV event batch must be an array [ts, events, dp_rank]")
    ts, raw_events = obj[0], obj[1]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventDecodeError("batch timestamp must be a number")
    dp_rank = obj[2] if len(obj) > 2 else None
    events = tuple(e for e in (_decode_event(r, int_hashes) for r in raw_events) if e is not None)
    return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=dp_rank)


def decode_seq(frame: bytes) -> int:
    """The sequence number frame: 8 bytes big-endian (signed: the replay end marker is -1)."""
    return int.from_bytes(frame, "big", signed=True)


@dataclass
class KVEventPublisher:
    """ZMQ publisher of KV event batches on ``tcp://host:port`` (port 0 = any free port), and, with `replay_port`,
    vLLM's replay ROUTER: a request ``[b"", start_seq]`` is answered with every buffered batch from `start_seq` on as
    ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]`` (the last `buffer_steps` batches are kept)."""

    host: str = "127.0.0.1"
    port: int = 0
    replay_port: int | None = None
    buffer_steps: int = 10_000
    replay_bound_port: int = 0
    topic: bytes = b"kv-events"
    max_pending: int = 100_000  # events queued while the sender catches up; older ones are dropped beyond it
    data_parallel_rank: int = 0
    bound_port: int = 0
    sent_batches: int = 0
    dropped_events: int = 0
    _pending: deque[KVEvent] = field(init=False)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _subscribed: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _ctx: zmq.asyncio.Context | None = field(init=False, default=None)
    _sock: zmq.asyncio.Socket | None = field(init=False, default=None)
    _replay: zmq.asyncio.Socket | None = field(init=False, default=None)
    _buffer: deque[tuple[int, bytes]] = field(init=False)
    _tasks: list[asyncio.Task[None]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._pending = deque(maxlen=self.max_pending)
        self._buffer = deque(maxlen=self.buffer_steps)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.bound_port}"

    async def start(self) -> int:
        """Bind the socket and start the sender; returns the bound port."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.bind(f"tcp://{self.host}:{self.port or '*'}")
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            sock.close(linger=0)
            self._ctx.term()
            self._ctx = None
            raise
        assert isinstance(endpoint, bytes)
        self.bound_port = int(endpoint.decode().rsplit(":", 1)[1])
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="kv-events-send"),
            asyncio.create_task(self._subscription_loop(), name="kv-events-subs"),
        ]
        if self.replay_port is not None:
            replay = self._replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(f"tcp://{self.host}:{self.replay_port or '*'}")
            replay_endpoint = replay.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(replay_endpoint, bytes)
            self.replay_bound_port = int(replay_endpoint.decode().rsplit(":", 1)[1])
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-events-replay"))
        return self.bound_port

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://{self.host}:{self.replay_bound_port}" if self._replay is not None else None

    async def _replay_loop(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def publish(self, events: Iterable[KVEvent]) -> None:
        """Queue events for the next batch; never blocks."""
        before = len(self._pending)
        added = 0
        for event in events:
            self._pending.append(event)
            added += 1
        if added:
            self.dropped_events += max(0, before + added - self.max_pending)
            self._wake.set()

    async def wait_subscribed(self) -> None:
        """Return once at least one SUB socket has subscribed (XPUB sees its subscription message)."""
        await self._subscribed.wait()

    async def _subscription_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                self._subscribed.set()

    async def _send_loop(self) -> None:
        assert self._sock is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                events = tuple(self._pending)
                self._pending.clear()
                await self._send(events)

    async def _send(self, events: Sequence[KVEvent]) -> None:
        assert self._sock is not None
        payload = encode_kv_event_batch(KVEventBatch(time.time(), tuple(events), self.data_parallel_rank))
        seq = self.sent_batches.to_bytes(8, "big")
        await self._sock.send_multipart((self.topic, seq, payload))
        self._buffer.append((self.sent_batches, payload))
        self.sent_batches += 1

    async def close(self) -> None:
        """Flush what is queued (best effort), stop the tasks and close the socket."""
        if self._sock is not None and self._pending:
            with contextlib.suppress(zmq.ZMQError):
                events = tuple(self._pending)
                self._pending.clear()
                await self._send(events)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
