"""Chained prefix block hashes, the key kvgate's KV index is built on.

Algorithm: the prompt's token ids are cut into blocks of `block_size` tokens; only full blocks are hashed (an engine
caches only full blocks). Block i's hash is `xxh3_64(tokens_i as little-endian uint32/uint64 bytes, seed=h_{i-1})`,
so each hash covers its parent's hash and its own tokens, i.e. the whole prefix that ends at its boundary. The chain
starts at `h_{-1} = context_seed(model, lora, cache_salt)`, so the same tokens under another model, adapter or
tenant salt never produce the same hashes.

These hashes are kvgate's own: they do not equal vLLM's block hashes (which depend on the engine's hash function and
PYTHONHASHSEED). KV events are therefore re-hashed from their token ids with `chain_hashes` (see kv_index).

Complexity: O(number of tokens); the token list is packed once into an `array` and each block hashed from a
zero-copy memoryview slice. An 8k-token prompt hashes in tens of microseconds (bench/bench_hashing.py).
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Sequence

import xxhash

_U64_MASK = 0xFFFFFFFFFFFFFFFF


@functools.lru_cache(maxsize=4096)  # per request; the contexts are few (models x adapters x tenants' salts)
def context_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """The chain's root: a 64-bit hash of the cache context (model or adapter name and the tenant's cache salt).
    Fields are length-prefixed so ("ab", "c") and ("a", "bc") differ."""
    parts = (model, lora or "", cache_salt or "")
    payload = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
    return xxhash.xxh3_64_intdigest(b"kvgate-prefix-v1\0" + payload)


def _pack(tokens: Sequence[int]) -> tuple[memoryview, int]:
    """Token ids as contiguous little-endian bytes and the width of one token in bytes."""
    try:
        packed = array("I", tokens)  # 4 bytes on every supported platform
    except OverflowError:  # an id >= 2**32 (or negative): fall back to 64-bit lanes
        packed = array("Q", (t & _U64_MASK for t in tokens))
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return memoryview(packed).cast("B"), packed.itemsize


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks of `tokens`, chained from `parent` (a context seed or the previous block's hash).
    A trailing partial block is ignored."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    data, width = _pack(tokens[: n_blocks * block_size] if len(tokens) % block_size else tokens)
    step = block_size * width
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    h = parent
    for start in range(0, n_blocks * step, step):
        h = digest(data[start : start + step], h)
        out.append(h)
    return out


def prompt_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    model: str,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The prompt's block hashes in a given cache context."""
    return chain_hashes(tokens, block_size, context_seed(model, lora, cache_salt))
