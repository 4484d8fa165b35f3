"""vLLM KV cache events: wire decoding and one asyncio subscriber per replica.

Wire format (vLLM 0.32 `vllm/distributed/kv_events.py`, ZMQ PUB): three frames: topic; sequence number as 8 bytes
big-endian (0, 1, 2, ... per publisher; back to 0 when the engine restarts); msgpack `EventBatch`, an array
`[ts, [events...], dp_rank]` (dp_rank may be omitted). Events are msgspec tagged structs: current vLLM encodes them
as maps with a `"type"` key (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`); older releases encoded them as
tagged arrays `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`.
Both are decoded here. Hashes are ints (low 64 bits) or bytes.

Replay (optional): a DEALER connects to the publisher's ROUTER `replay_endpoint` and sends `[b"", start_seq]`; the
publisher answers `[b"", topic, seq, payload]` for each buffered batch from `start_seq` on, then `[b"", b"", -1]`.

Subscriber: a SUB socket per replica (topic prefix filter), read by one task. With a replay endpoint it first
replays the publisher's whole buffer (what the engine cached before this gateway started, as far as the buffer
goes back; a stored block whose parent predates the buffer cannot be placed and is skipped), then skips the live
batches the replay already delivered. A batch whose sequence number is not
the previous one plus one means lost events: a smaller number is an engine restart (the sink resets the replica),
a larger one a gap (filled by replay when a replay endpoint is known and the publisher still holds the batches,
else the sink resets the replica). A batch that cannot be decoded is treated as a gap. A replay answer slower than
`replay_timeout_s` (per message) ends the replay. The task never blocks the loop (all socket calls are awaited) and
closes its sockets when cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = -1


@dataclass(frozen=True, slots=True)
class BlockStoredEvent:
    block_hashes: Sequence[Hashable]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: Sequence[Any] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemovedEvent:
    block_hashes: Sequence[Hashable]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksClearedEvent:
    pass


KvEvent = BlockStoredEvent | BlockRemovedEvent | AllBlocksClearedEvent


class KvEventDecodeError(ValueError):
    pass


def _hashable(h: Any) -> Hashable:
    if isinstance(h, int | bytes):
        return h
    raise KvEventDecodeError(f"block hash must be int or bytes, got {type(h).__name__}")


def _decode_event(raw: Any) -> KvEvent | None:
    """One event; None for an event type kvgate does not use."""
    if isinstance(raw, dict):
        kind, f = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                            "lora_name", "extra_keys", "group_idx"),
            "BlockRemoved": ("block_hashes", "medium", "group_idx"),
        }.get(kind, ())  # fmt: skip
        f = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventDecodeError(f"unrecognized event encoding: {type(raw).__name__}")
    if kind == "BlockStored":
        parent = f.get("parent_block_hash")
        return BlockStoredEvent(
            block_hashes=[_hashable(h) for h in f["block_hashes"]],
            parent_block_hash=None if parent is None else _hashable(parent),
            token_ids=f["token_ids"],
            block_size=int(f["block_size"]),
            lora_name=f.get("lora_name"),
            medium=f.get("medium"),
            extra_keys=f.get("extra_keys"),
            group_idx=f.get("group_idx"),
        )
    if kind == "BlockRemoved":
        return BlockRemovedEvent(
            block_hashes=[_hashable(h) for h in f["block_hashes"]],
            medium=f.get("medium"),
            group_idx=f.get("group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksClearedEvent()
    return None


def decode_kv_event_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """(timestamp, events) of one msgpack EventBatch; KvEventDecodeError when it is malformed."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
            raise KvEventDecodeError("an event batch is an array [ts, events, dp_rank]")
        events = [e for e in (_decode_event(raw) for raw in batch[1]) if e is not None]
        return float(batch[0]), events
    except KvEventDecodeError:
        raise
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise KvEventDecodeError(f"malformed KV event batch: {exc}") from exc


class KvEventSink(Protocol):
    def on_kv_events(self, replica_id: str, events: Sequence[KvEvent]) -> None: ...

    def on_kv_reset(self, replica_id: str, reason: str) -> None:
        """The replica's event stream lost continuity (`reason`: "restart", "gap", "decode-error"): forget what
        its events said."""
        ...


class KvEventSubscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        replica_id: str,
        endpoint: str,
        sink: KvEventSink,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.replica_id = replica_id
        self.endpoint = endpoint
        self._ctx = ctx
        self._sink = sink
        self._topic = topic.encode()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = replay_timeout_s
        self._last_seq: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # batches applied (for tests and metrics)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.replica_id}")

    def cancel(self) -> asyncio.Task[None] | None:
        """Cancel the reader task without waiting; returns it for the owner to await."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    async def stop(self) -> None:
        task = self.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.connect(self.endpoint)  # before the replay: live batches published meanwhile wait in the socket
        try:
            replayed = None
            if self._replay_endpoint is not None and await self._replay(0, None):
                replayed = self._last_seq
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kv events %s: dropped a message of %d frames", self.replica_id, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big")
                if replayed is not None:
                    if seq <= replayed:
                        continue  # the replay delivered it
                    replayed = None
                await self._on_message(seq, frames[2])
        finally:
            sock.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        last = self._last_seq
        if last is not None and seq <= last:
            self._reset("restart")
        elif seq != (0 if last is None else last + 1):
            filled = self._replay_endpoint is not None and await self._replay(0 if last is None else last + 1, seq)
            if not filled and last is not None:  # before the first batch there is nothing to forget
                self._reset("gap")
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last_seq = seq
        try:
            _, events = decode_kv_event_batch(payload)
        except KvEventDecodeError as exc:
            log.warning("kv events %s: %s", self.replica_id, exc)
            self._reset("decode-error")
            return
        self._sink.on_kv_events(self.replica_id, events)
        self.batches += 1

    def _reset(self, reason: str) -> None:
        log.info("kv events %s: %s; clearing its index entries", self.replica_id, reason)
        self._sink.on_kv_reset(self.replica_id, reason)

    async def _replay(self, start: int, stop: int | None) -> bool:
        """Fetch and apply batches [start, stop) from the replay endpoint; True when all of them were applied.
        `stop` None: the whole buffer, from its oldest batch (which may be after `start`) on."""
        assert self._replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        expected: int | None = start if stop is not None else None
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(self._replay_timeout):
                    frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return False
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return stop is None or (expected is not None and expected >= stop)
                if expected is None:
                    expected = seq
                if seq < expected or (stop is not None and seq >= stop):
                    continue
                if seq != expected:
                    return False
                self._apply(seq, frames[3])
                expected += 1
        except TimeoutError:
            log.info("kv events %s: replay from %d timed out", self.replica_id, start)
            return False
        finally:
            sock.close(linger=0)
