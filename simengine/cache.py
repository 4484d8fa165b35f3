"""Prefix-cache model of one simulated engine: paged KV blocks, chained block hashes, LRU eviction, pinning.

Parameters: block size B tokens, capacity C blocks (vLLM's ``num_gpu_blocks``), the model name (hash seed).

Block hashes (`chain_block_hashes`, reproducible by the gateway): only full B-token blocks of the prompt are
hashed; ``h_{-1} = xxh64(model name as UTF-8)`` and ``h_i = xxh64(pack("<Q", h_{i-1}) + pack("<BQ", *tokens_i))``
(all 64-bit little-endian unsigned), the 64-bit integer digest. Equal prefixes give equal hash chains, so a block
hash names a block *and* its whole prefix. O(prompt tokens).

Residency: every block is either pinned (ref count > 0: a running request uses it), free-but-cached (ref count 0, in
an LRU ordered by release time; reusable on a hit, evictable) or private (the partial last prompt block and the
blocks for generated tokens; counted, never hashed or shared). ``pinned + private + free_cached <= C``.

Admission (`fits` / `admit`): a request needs ``ceil((prompt + max_tokens) / B)`` blocks; those of its prompt blocks
already pinned by another request cost nothing. It fits when ``pinned + private + (need - already_pinned) <= C``;
cached-but-free blocks are reused when they are hit and evicted (oldest first) to make room otherwise. The engine
keeps a request waiting while it does not fit: that produces the throughput knee.

Hits: the number of leading prompt blocks resident, capped like vLLM at ``(prompt_len - 1) // B`` blocks (the last
prompt token is always recomputed); cached tokens = B x hit blocks. On release the request's prompt blocks are
unpinned tail first, so under pressure a prefix is evicted from its end. Admit / release cost O(blocks of the
request) plus O(1) per eviction.

CPU tier (``cpu_blocks`` > 0: vLLM's KV offloading, ``--kv-offloading-size``): a second LRU of C_cpu blocks,
written through as vLLM's offloading connector does: every prompt block a request stores on the GPU (computed or
loaded) is stored in the CPU tier too, and a hit there refreshes it. A lookup takes the GPU's leading run first,
then continues in the CPU tier from the first GPU miss (vLLM's connector is asked for the tokens after the local
hit); those blocks are loaded, not recomputed (`Allocation.loaded_blocks`, priced by the engine at its load cost
per token) and become GPU blocks again. ``cached_tokens`` counts both, as vLLM's ``num_cached_tokens`` does.
Events for the tier carry ``medium="CPU"`` (stores with token ids and parent: self-describing).

KV connector (`external`, set by the engine when it has a hand-over folder: `simengine.kv_transfer`): after the
GPU and CPU runs, the blocks a prefill replica stored for this prompt are loaded (`Allocation.handed_blocks`), as
vLLM's connector reports external hits; counted in ``cached_tokens`` too.

Deviation from vLLM: blocks of generated tokens are not hashed or cached (only prompt blocks are), and a request's
blocks are allocated in full at admission (no preemption).

Events: with ``record_events`` each admission records ``BlockRemoved`` (evictions) then ``BlockStored`` (one per run
of newly stored consecutive blocks, with parent hash and token ids) in a bounded queue drained by the publisher.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from simengine.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def root_hash(model: str) -> int:
    """The hash the first block of every chain is chained onto."""
    return xxhash.xxh64_intdigest(model.encode("utf-8"))


def chain_block_hashes(token_ids: Sequence[int], block_size: int, model: str) -> list[int]:
    """Chained 64-bit hashes of the full ``block_size``-token blocks of ``token_ids`` (ids in [0, 2**64))."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = root_hash(model)
    fmt = f"<Q{block_size}Q"
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = xxhash.xxh64_intdigest(struct.pack(fmt, parent, *token_ids[start : start + block_size]))
        out.append(parent)
    return out


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one admitted request holds; give it back with `PrefixCache.release`."""

    block_hashes: tuple[int, ...]  # the prompt's full blocks, pinned
    private_blocks: int
    hit_blocks: int  # leading prompt blocks found on the GPU
    cached_tokens: int  # (hit_blocks + loaded_blocks) x block size
    loaded_blocks: int = 0  # the blocks after those found in the CPU tier and loaded from it
    handed_blocks: int = 0  # the blocks after those found in the KV connector's store (handed over by a prefill)


class CacheFullError(RuntimeError):
    """`admit` was called for a request that does not fit (check `fits` first)."""


class PrefixCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model: str,
        *,
        record_events: bool = False,
        max_pending_events: int = 100_000,
        cpu_blocks: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model = model
        self.record_events = record_events
        self._refs: dict[int, int] = {}  # pinned hash -> ref count (> 0)
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; first = evicted first
        self._private = 0
        self.cpu_blocks = cpu_blocks
        self._cpu: OrderedDict[int, None] = OrderedDict()  # the CPU tier's LRU; first = evicted first
        # the KV connector's lookup (simengine.kv_transfer): blocks from a start index it can hand over
        self.external: Callable[[Sequence[int], int], int] | None = None
        self._events: deque[KVEvent] = deque(maxlen=max_pending_events)
        self.queries_tokens = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hit_tokens = 0  # of which cached on the GPU (vllm:prefix_cache_hits)
        self.loaded_tokens = 0  # of which loaded from the CPU tier (vllm:external_prefix_cache_hits)
        self.evictions = 0

    # --- queries -----------------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        return chain_block_hashes(token_ids, self.block_size, self.model)

    def blocks_needed(self, total_tokens: int) -> int:
        return blocks_for(total_tokens, self.block_size)

    def can_ever_fit(self, total_tokens: int) -> bool:
        return self.blocks_needed(total_tokens) <= self.num_blocks

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks resident (pinned or free-cached)."""
        n = 0
        for h in block_hashes:
            if h not in self._refs and h not in self._free:
                break
            n += 1
        return n

    def lookup_offloaded(self, block_hashes: Sequence[int], start: int) -> int:
        """Number of blocks from ``start`` on held by the CPU tier (0 without one)."""
        n, cpu = 0, self._cpu
        if cpu:
            for h in block_hashes[start:]:
                if h not in cpu:
                    break
                n += 1
        return n

    @property
    def offloaded_blocks(self) -> int:
        return len(self._cpu)

    def fits(self, block_hashes: Sequence[int], total_tokens: int) -> bool:
        shared = sum(1 for h in block_hashes if h in self._refs)
        extra = self.blocks_needed(total_tokens) - shared
        return len(self._refs) + self._private + extra <= self.num_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (vLLM's usage counts cached-but-free blocks as free)."""
        return len(self._refs) + self._private

    @property
    def cached_blocks(self) -> int:
        return len(self._refs) + len(self._free)

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc, in [0, 1]."""
        return self.used_blocks / self.num_blocks

    # --- mutations ---------------------------------------------------------------------------------------
    def admit(self, token_ids: Sequence[int], block_hashes: Sequence[int], total_tokens: int) -> Allocation:
        """Pin the prompt's blocks, store the missing ones (evicting LRU blocks), reserve the private blocks."""
        if not self.fits(block_hashes, total_tokens):
            raise CacheFullError("request does not fit in the KV cache now")
        bs = self.block_size
        prompt_len = len(token_ids)
        max_hit = max(0, (prompt_len - 1) // bs)
        hit_blocks = min(self.lookup(block_hashes), max_hit)
        loaded = min(self.lookup_offloaded(block_hashes, hit_blocks), max_hit - hit_blocks)
        handed = 0
        if self.external is not None and hit_blocks + loaded < max_hit:
            handed = min(self.external(block_hashes, hit_blocks + loaded), max_hit - hit_blocks - loaded)
        private = self.blocks_needed(total_tokens) - len(block_hashes)
        new_idx: list[int] = []
        for i, h in enumerate(block_hashes):
            refs = self._refs.get(h)
            if refs is not None:
                self._refs[h] = refs + 1
            elif h in self._free:
                del self._free[h]
                self._refs[h] = 1
            else:
                self._refs[h] = 1
                new_idx.append(i)
        self._private += private
        removed = self._evict(len(self._refs) + len(self._free) + self._private)
        if self.record_events:
            if removed:
                self._events.append(BlockRemoved(block_hashes=tuple(removed)))
            self._record_stored(token_ids, block_hashes, new_idx, MEDIUM_GPU)
        self._offload(token_ids, block_hashes)
        self.queries_tokens += prompt_len
        self.hit_tokens += hit_blocks * bs
        self.loaded_tokens += loaded * bs
        cached = (hit_blocks + loaded + handed) * bs
        return Allocation(tuple(block_hashes), private, hit_blocks, cached, loaded, handed)

    def _offload(self, token_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Write the request's prompt blocks through to the CPU tier (refreshing those it holds), evicting LRU."""
        if self.cpu_blocks <= 0:
            return
        cpu, new_idx = self._cpu, []
        for i, h in enumerate(block_hashes):
            if h in cpu:
                cpu.move_to_end(h)
            else:
                cpu[h] = None
                new_idx.append(i)
        removed = [cpu.popitem(last=False)[0] for _ in range(max(0, len(cpu) - self.cpu_blocks))]
        if self.record_events:
            if removed:
                self._events.append(BlockRemoved(block_hashes=tuple(removed), medium=MEDIUM_CPU))
            self._record_stored(token_ids, block_hashes, new_idx, MEDIUM_CPU)

    def _evict(self, resident_after: int) -> list[int]:
        removed: list[int] = []
        while resident_after - len(removed) > self.num_blocks and self._free:
            h, _ = self._free.popitem(last=False)
            removed.append(h)
        self.evictions += len(removed)
        return removed

    def _record_stored(self, token_ids: Sequence[int], hashes: Sequence[int], new_idx: list[int], medium: str) -> None:
        bs = self.block_size
        start = 0
        while start < len(new_idx):
            end = start
            while end + 1 < len(new_idx) and new_idx[end + 1] == new_idx[end] + 1:
                end += 1
            first, last = new_idx[start], new_idx[end]
            self._events.append(
                BlockStored(
                    block_hashes=tuple(hashes[first : last + 1]),
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=tuple(token_ids[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    medium=medium,
                )
            )
            start = end + 1

    def release(self, alloc: Allocation) -> None:
        """Unpin the request's blocks (tail first into the LRU) and free its private blocks."""
        for h in reversed(alloc.block_hashes):
            refs = self._refs[h]
            if refs > 1:
                self._refs[h] = refs - 1
            else:
                del self._refs[h]
                self._free[h] = None
        self._private -= alloc.private_blocks

    def reset(self) -> bool:
        """Drop every cached block, like vLLM's reset_prefix_cache; refused (False) while any block is in use."""
        if self._refs or self._private:
            return False
        self._free.clear()
        self._cpu.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events
