"""Incremental prefix hashing for chat: a growing conversation costs the gateway its new tokens, not its history.

An agent resends its whole history every turn. Tokenizing it again is the gateway's largest cost at long contexts
(hundreds of milliseconds at 100k tokens), so the tokens and block hashes of a conversation's prefix are kept at
the last message boundary of each request and reused by the next turn that starts with the same messages:

    key(k)  = digest chain over the first k normalized messages, seeded with the template, its kwargs, the cache
              context (model, adapter, salt) and the block size: the exact content, never an approximation
    entry   = (L, digest of text[:L], token ids of text[:L], block hashes of its full blocks)
              where text[:L] is the rendering of those k messages without the generation prompt

Per request, in two steps. `prepare`: normalize and render the whole conversation (the template must see all of
it), compute key(k) for every boundary (xxhash over each message, O(size of the messages) in C) and take the
longest k with an entry whose text digest matches the start of this rendering. `finish`: encode only what follows
it; the block-hash chain continues from the entry's last full block; then the boundary after the last message is
stored for the next turn. Between them the caller may route: when what follows the reused prefix is the
conversation's new turn (`ChatPrompt.new_turn`: the last assistant message and the messages after it, e.g. a tool
call and its result), no replica can hold its blocks beyond the answer's own (on the replica that gave it), so the
prefix's blocks and an estimated length (`ChatPrompt.estimate`) route it as well and `finish` runs beside the
request (cacheindex.tokenize_pool). The same conversation sent again reuses its last boundary: nothing new. On a miss
with two messages or more, the boundary after the first message is stored too (its rendering alone, when that is a
safe prefix of this one: one more template render), so single-turn prompts that share a system prompt encode only
what follows it.

Exactness: encode(A + B) == encode(A) + encode(B) holds when A ends with one of the tokenizer's special tokens
(Hugging Face tokenizers split the text on added special tokens before anything else); a boundary that does not
end with one is never stored (`unsafe`). A template that rewrites earlier messages when later ones arrive renders
a different prefix text: the digest check fails and the full path runs (`rewritten`). Counted by outcome:
`hit` (a prefix reused), `miss` (none stored), `unsafe`, `rewritten`, `full` (no generation prompt: not cached),
counted by `finish`.
tests/test_prefix_incremental.py checks incremental == full token for token over random conversations.

Bounds: entries evicted least recently used past `max_bytes` (4 bytes per token id, 8 per block hash). Thread-safe
(one lock around lookups and stores; encoding runs outside it).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class ChatPrompt:
    """A rendered conversation between `ChatPrefixCache.prepare` and `finish`: the tokens and full-block hashes of
    its reused prefix (`text[:start]`), and what is left to encode (`end` -1: the whole text, nothing stored)."""

    tok: ChatRenderer
    text: str
    block_size: int
    seed: int
    outcome: Outcome
    end: int = -1
    suffix: str = ""
    key: int = 0
    start: int = 0
    tokens: array[int] = field(default_factory=lambda: array("I"))
    hashes: list[int] = field(default_factory=list)
    new_turn: bool = False  # what follows `start` is the last assistant message and what came after it

    def reuse(self, entry: _Entry, outcome: Outcome) -> None:
        self.start, self.outcome = entry.text_len, outcome
        self.tokens, self.hashes = array("I", entry.tokens), list(entry.hashes)

    def estimate(self) -> int:
        """The prompt's token count before `finish`: the reused tokens, the rest at their characters per token."""
        rest = len(self.text) - self.start
        return len(self.tokens) + (-(-rest * len(self.tokens) // self.start) if self.start else rest // 4)


def _new_turn(conversation: Sequence[Mapping[str, Any]], reused: int) -> bool:
    """Whether the messages after the first `reused` are the last assistant message and those after it."""
    return (
        reused < len(conversation)
        and conversation[reused].get("role") == "assistant"
        and all(m.get("role") != "assistant" for m in conversation[reused + 1 :])
    )


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

    def prepare(
        self,
        tok: ChatRenderer,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
        *,
        block_size: int,
        seed: int,
    ) -> ChatPrompt:
        """Render the conversation and reuse its longest stored prefix; what follows it is left to `finish`
        (`finish(prepare(...))`: the prompt's token count and block hashes, exactly as a full tokenization)."""
        conversation, text = tok.render_chat(messages, add_generation_prompt, kwargs)
        if not add_generation_prompt or kwargs.get("continue_final_message"):
            return ChatPrompt(tok, text, block_size, seed, "full")
        context = orjson.dumps([tok.template_id, kwargs, block_size, seed], default=str)
        keys = [xxhash.xxh3_64_intdigest(context)]
        for message in conversation:
            keys.append(xxhash.xxh3_64_intdigest(orjson.dumps(message, default=str), keys[-1]))
        suffix = tok.generation_suffix(kwargs)
        end = len(text) - len(suffix)  # where the last message ends
        if not text.endswith(suffix) or not text[:end].endswith(tok.special_tokens):
            return ChatPrompt(tok, text, block_size, seed, "unsafe")
        prompt = ChatPrompt(tok, text, block_size, seed, "miss", end=end, suffix=suffix, key=keys[-1])
        found = self._longest(keys[1:])
        if found is not None:
            k, entry = found
            if entry.text_len <= end and _text_digest(text[: entry.text_len]) == entry.text_digest:
                prompt.reuse(entry, "hit")
                prompt.new_turn = _new_turn(conversation, k)
            else:
                prompt.outcome = "rewritten"
        if prompt.outcome == "miss" and len(conversation) > 1:
            self._first_boundary(prompt, messages, kwargs, keys[1])
        return prompt

    def finish(self, prompt: ChatPrompt) -> tuple[int, list[int]]:
        """Encode what `prepare` left (all of the text when nothing was reused) and store the conversation's
        boundary for its next turn: the prompt's token count and block hashes."""
        tok, tokens, hashes, bs = prompt.tok, prompt.tokens, prompt.hashes, prompt.block_size
        if prompt.end < 0:
            tokens.extend(tok.encode(prompt.text))
        else:
            if prompt.start < prompt.end:
                tokens.extend(tok.encode(prompt.text[prompt.start : prompt.end]))
                hashes.extend(chain_hashes(tokens[len(hashes) * bs :], bs, hashes[-1] if hashes else prompt.seed))
                text_digest = _text_digest(prompt.text[: prompt.end])
                self._store(prompt.key, _Entry(prompt.end, text_digest, array("I", tokens), tuple(hashes)))
            tokens.extend(tok.encode(prompt.suffix))
        hashes.extend(chain_hashes(tokens[len(hashes) * bs :], bs, hashes[-1] if hashes else prompt.seed))
        self._count(prompt.outcome)
        return len(tokens), hashes

    def _first_boundary(
        self, prompt: ChatPrompt, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any], key: int
    ) -> None:
        """On a miss, also store the boundary after the first message (a shared system prompt: prompts that share
        only it start from there) and reuse it for this prompt, when its rendering is a safe prefix of this one."""
        tok, text = prompt.tok, prompt.text
        _, head = tok.render_chat(messages[:1], False, kwargs)
        if not head or len(head) >= prompt.end or not text.startswith(head) or not head.endswith(tok.special_tokens):
            return
        tokens = array("I", tok.encode(head))
        entry = _Entry(
            len(head), _text_digest(head), tokens, tuple(chain_hashes(tokens, prompt.block_size, prompt.seed))
        )
        self._store(key, entry)
        prompt.reuse(entry, "miss")

    def _longest(self, keys: Sequence[int]) -> tuple[int, _Entry] | None:
        """The entry of the longest boundary among `keys` (ordered by boundary) and its number of messages,
        refreshed in LRU order."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                entry = self._entries.get(keys[i])
                if entry is not None:
                    self._entries.move_to_end(keys[i])
                    return i + 1, entry
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
