"""Incremental prefix hashing for chat: a growing conversation costs the gateway its new tokens, not its history.

An agent resends its whole history every turn. Tokenizing it again is the gateway's largest cost at long contexts
(hundreds of milliseconds at 100k tokens), so the tokens and block hashes of a conversation's prefix are kept at
the last message boundary of each request and reused by the next turn that starts with the same messages:

    key(k)  = digest chain over the first k normalized messages, seeded with the template, its kwargs, the cache
              context (model, adapter, salt) and the block size: the exact content, never an approximation
    entry   = (L, digest of text[:L], token ids of text[:L], block hashes of its full blocks)
              where text[:L] is the rendering of those k messages without the generation prompt

Per request: normalize and render the whole conversation (the template must see all of it), compute key(k) for
every boundary (xxhash over each message, O(size of the messages) in C), take the longest k with an entry whose
text digest matches the start of this rendering, and encode only what follows it; the block-hash chain continues
from the entry's last full block. Then the boundary after the last message is stored for the next turn. On a miss
with two messages or more, the boundary after the first message is stored too (its rendering alone, when that is a
safe prefix of this one: one more template render), so single-turn prompts that share a system prompt encode only
what follows it.

Exactness: encode(A + B) == encode(A) + encode(B) holds when A ends with one of the tokenizer's special tokens
(Hugging Face tokenizers split the text on added special tokens before anything else); a boundary that does not
end with one is never stored (`unsafe`). A template that rewrites earlier messages when later ones arrive renders
a different prefix text: the digest check fails and the full path runs (`rewritten`). Counted by outcome:
`hit` (a prefix reused), `miss` (none stored), `unsafe`, `rewritten`, `full` (no generation prompt: not cached).
tests/test_prefix_incremental.py checks incremental == full token for token over random conversations.

Bounds: entries evicted least recently used past `max_bytes` (4 bytes per token id, 8 per block hash). Thread-safe
(one lock around lookups and stores; encoding runs outside it).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson
import xxhash

from cacheindex.hashing import chain_hashes

Outcome = Literal["hit", "miss", "unsafe", "rewritten", "full"]


class ChatRenderer(Protocol):
    """What the cache needs of a tokenizer (cacheindex.tokenizers.HfPromptTokenizer)."""

    template_id: str
    special_tokens: tuple[str, ...]

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, kwargs: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], str]: ...

    def generation_suffix(self, kwargs: Mapping[str, Any]) -> str: ...

    def encode(self, text: str) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class _Entry:
    text_len: int
    text_digest: int
    tokens: array[int]
    hashes: tuple[int, ...]

    @property
    def size(self) -> int:
        return 4 * len(self.tokens) + 8 * len(self.hashes) + 128


def _text_digest(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class ChatPrefixCache:
    def __init__(self, max_bytes: int, on_outcome: Callable[[Outcome], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self._on_outcome = on_outcome
        self._lock = threading.Lock()  # long prompts are tokenized in a thread pool

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def tokens_and_hashes(
        self,
        tok: ChatRenderer,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
        *,
        block_size: int,
        seed: int,
    ) -> tuple[int, list[int]]:
        """The prompt's token count and block hashes (chained from `seed`), exactly as a full tokenization."""
        conversation, text = tok.render_chat(messages, add_generation_prompt, kwargs)
        if not add_generation_prompt or kwargs.get("continue_final_message"):
            return self._full(tok, text, block_size, seed, "full")
        context = orjson.dumps([tok.template_id, kwargs, block_size, seed], default=str)
        keys = [xxhash.xxh3_64_intdigest(context)]
        for message in conversation:
            keys.append(xxhash.xxh3_64_intdigest(orjson.dumps(message, default=str), keys[-1]))
        suffix = tok.generation_suffix(kwargs)
        end = len(text) - len(suffix)  # where the last message ends
        if not text.endswith(suffix) or not text[:end].endswith(tok.special_tokens):
            return self._full(tok, text, block_size, seed, "unsafe")
        start, tokens, hashes, outcome = 0, array("I"), [], "miss"
        entry = self._longest(keys[1:-1])
        if entry is not None:
            if entry.text_len <= end and _text_digest(text[: entry.text_len]) == entry.text_digest:
                start, tokens, hashes, outcome = entry.text_len, array("I", entry.tokens), list(entry.hashes), "hit"
            else:
                outcome = "rewritten"
        if outcome == "miss" and len(conversation) > 1:
            start = self._first_boundary(tok, messages, kwargs, text, end, keys[1], tokens, hashes, block_size, seed)
        tokens.extend(tok.encode(text[start:end]))
        hashes.extend(chain_hashes(tokens[len(hashes) * block_size :], block_size, hashes[-1] if hashes else seed))
        self._store(keys[-1], _Entry(end, _text_digest(text[:end]), array("I", tokens), tuple(hashes)))
        tokens.extend(tok.encode(suffix))
        hashes.extend(chain_hashes(tokens[len(hashes) * block_size :], block_size, hashes[-1] if hashes else seed))
        self._count(outcome)  # type: ignore[arg-type]
        return len(tokens), hashes

    def _first_boundary(
        self, tok: ChatRenderer, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any], text: str, end: int,
        key: int, tokens: array[int], hashes: list[int], block_size: int, seed: int,
    ) -> int:  # fmt: skip
        """On a miss, also store the boundary after the first message (a shared system prompt: prompts that share
        only it start from there); fills `tokens` and `hashes` up to it and returns where encoding continues (0 when
        the first message's rendering is not a safe prefix of this one)."""
        _, head = tok.render_chat(messages[:1], False, kwargs)
        if not head or len(head) >= end or not text.startswith(head) or not head.endswith(tok.special_tokens):
            return 0
        tokens.extend(tok.encode(head))
        hashes.extend(chain_hashes(tokens, block_size, seed))
        self._store(key, _Entry(len(head), _text_digest(head), array("I", tokens), tuple(hashes)))
        return len(head)

    def _full(
        self, tok: ChatRenderer, text: str, block_size: int, seed: int, outcome: Outcome
    ) -> tuple[int, list[int]]:
        tokens = tok.encode(text)
        self._count(outcome)
        return len(tokens), chain_hashes(tokens, block_size, seed)

    def _longest(self, keys: Sequence[int]) -> _Entry | None:
        """The entry of the longest boundary among `keys` (ordered by boundary), refreshed in LRU order."""
        with self._lock:
            for key in reversed(keys):
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    return entry
        return None

    def _store(self, key: int, entry: _Entry) -> None:
        with self._lock:
            self._store_locked(key, entry)

    def _store_locked(self, key: int, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        if entry.size > self.max_bytes:
            return
        self._entries[key] = entry
        self._bytes += entry.size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def _count(self, outcome: Outcome) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)
