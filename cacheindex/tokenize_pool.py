"""`TokenizePool`: the prompt tokenizers of the cache state (cacheindex.state) and the small thread pool they run in.

Tokenizers: one per spec (a local HF dir, "sim" or "chars"), loaded once in the pool by `tokenizer` (one lock per
spec while it loads), kept in an LRU of `_MAX_TOKENIZERS`; a spec that fails to load falls back to `chars`. While
the state is started, `preload` loads a spec in the background so that no request waits for it.
Per request, `tokens_and_hashes` tokenizes the prompt as the target engine will (chat: its chat template, through
`ChatPrefixCache` for an exact HF tokenizer so only a conversation's new tokens are encoded; completions: the text,
the first prompt of a batch, or the token ids as given) and hashes its full blocks in the cache context. Prompts of
at least `tokenizer_thread_min_chars` characters are tokenized in the pool (an 8k-token HF chat prompt takes ~20 ms
on this machine); shorter ones inline (pure-Python tokenizers, which hold the GIL, only from
`python_tokenizer_thread_min_chars`). A conversation's new turn of at least `deferred_turn_min_chars` (the last answer
and the messages after it, with the rest reused from the chat prefix cache) is encoded after this returns, in the
pool: the caller routes on the blocks before it with the length estimated and gets the whole prompt from
`Tokenized.rest` (an agent's 10,000-character tool result is about 5 ms of HF encoding taken off time to first
token). It never raises: a prompt it cannot tokenize carries no blocks (counted).
Cost: O(prompt) per request, and an O(messages) size estimate that decides inline or pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, NamedTuple

import orjson

from cacheindex.chat_render import engine_tools, first_media
from cacheindex.config import CacheConfig
from cacheindex.hashing import context_seed, prompt_block_hashes
from cacheindex.incremental import ChatPrefixCache, ChatPrompt
from cacheindex.metrics import PrefixMetrics
from cacheindex.tokenizers import CharsPromptTokenizer, HfPromptTokenizer, PromptTokenizer, build_tokenizer

log = logging.getLogger(__name__)

_MAX_TOKENIZERS = 32


def _prompt_chars(endpoint: str, body: Mapping[str, Any]) -> int:
    """A cheap size estimate of what tokenizing the request renders, deciding inline vs thread-pool tokenization:
    every message's role, text and tool-call arguments, and the tools and template arguments the template renders
    (a 7 MB `role`, or a completions batch's first prompt, was tokenized on the event loop: a quarter second)."""
    if endpoint == "chat":
        total = 0
        for m in body.get("messages") or ():
            if not isinstance(m, Mapping):
                continue
            content, role, calls = m.get("content"), m.get("role"), m.get("tool_calls")
            total += len(role) if isinstance(role, str) else 0
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
            if isinstance(calls, list):
                total += _json_len(calls)
        for extra in ("tools", "chat_template_kwargs"):
            if body.get(extra):
                total += _json_len(body[extra])
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: its first prompt is what is tokenized
    return len(prompt) if isinstance(prompt, str | list) else 0


def _json_len(value: Any) -> int:
    try:
        return len(orjson.dumps(value, default=str))
    except TypeError:  # an integer beyond 64 bits
        return len(str(value))


def chat_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a chat body asks of the chat template's rendering beyond its messages (vLLM's fields)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("continue_final_message"):
        kwargs["continue_final_message"] = True
    if body.get("tools") is not None:
        kwargs["tools"] = engine_tools(body["tools"])
    if body.get("add_special_tokens"):  # the tokenizer's own special tokens on top of the template's (vLLM's field)
        kwargs["add_special_tokens"] = True
    return kwargs


def _before_media(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A chat body as far as it can be hashed: the messages before the first that holds media (`first_media`),
    rendered without a generation prompt; the body itself when it holds none."""
    cut = first_media(body["messages"])
    if cut is None:
        return body
    before = {**body, "messages": body["messages"][:cut], "add_generation_prompt": False}
    before.pop("continue_final_message", None)
    return before


def _tokenize(tok: PromptTokenizer, endpoint: str, body: Mapping[str, Any]) -> list[int]:
    if endpoint == "chat":
        add_generation_prompt = body.get("add_generation_prompt", True)
        return tok.tokenize_chat(body["messages"], bool(add_generation_prompt), chat_kwargs(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return tok.tokenize_text(prompt, bool(body.get("add_special_tokens", True)))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("prompt must be a string, a list of strings or a list of token ids")


class Tokenized(NamedTuple):
    """A prompt's token count and full-block hashes; with `rest`, those of a conversation before its new turn (the
    count estimated) and, once it is encoded, the whole prompt's (None: it could not be)."""

    tokens: int
    hashes: tuple[int, ...]
    rest: asyncio.Future[tuple[int, tuple[int, ...]] | None] | None = None


class TokenizePool:
    def __init__(self, config: CacheConfig, metrics: PrefixMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._tokenizers: OrderedDict[str, PromptTokenizer] = OrderedDict()
        self._tokenizer_locks: dict[str, asyncio.Lock] = {}
        self._pool = self._new_pool()
        self._pool_closed = False
        self._preloads: dict[str, asyncio.Task[PromptTokenizer]] = {}  # spec -> its load, while it runs
        self.chat_prefixes = ChatPrefixCache(
            config.chat_prefix_cache_bytes, on_outcome=lambda o: self.metrics.chat_prefix.labels(o).inc()
        )

    # --- lifecycle --------------------------------------------------------------------------------------------
    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.config.tokenizer_threads, thread_name_prefix="kvgate-tokenize")

    def reopen(self) -> None:
        """A new thread pool after `close` (the state started again)."""
        if self._pool_closed:
            self._pool, self._pool_closed = self._new_pool(), False

    async def cancel_preloads(self) -> None:
        preloads = list(self._preloads.values())
        for preload in preloads:
            preload.cancel()
        await asyncio.gather(*preloads, return_exceptions=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool_closed = True

    # --- tokenizers -------------------------------------------------------------------------------------------
    def preload(self, spec: str) -> None:
        """Load a tokenizer (and chat template) now, in the background, so no request waits for it."""
        if spec in self._tokenizers or spec in self._preloads:
            return
        task = asyncio.get_running_loop().create_task(self.tokenizer(spec), name=f"tokenizer:{spec}")
        self._preloads[spec] = task
        task.add_done_callback(lambda _: self._preloads.pop(spec, None))

    def loading(self) -> list[str]:
        """The tokenizer specs being loaded now (a request for their models would wait)."""
        return sorted(self._preloads)

    async def tokenizer(self, spec: str) -> PromptTokenizer:
        """The tokenizer for `spec`, loaded once in the thread pool. A spec that fails to load falls back to
        `chars` (logged as an error: overlaps become approximate and KV events cannot match)."""
        tok = self._tokenizers.get(spec)
        if tok is not None:
            return tok
        lock = self._tokenizer_locks.setdefault(spec, asyncio.Lock())
        async with lock:
            tok = self._tokenizers.get(spec)
            if tok is None:
                loop = asyncio.get_running_loop()
                try:
                    tok = await loop.run_in_executor(
                        self._pool, lambda: build_tokenizer(spec, chunk_chars=self.config.char_chunk_size)
                    )
                except (OSError, ValueError, ImportError) as exc:
                    log.error("tokenizer %r failed to load (%s); using approximate 'chars' tokens", spec, exc)
                    tok = CharsPromptTokenizer(self.config.char_chunk_size)
                self._tokenizers[spec] = tok
                while len(self._tokenizers) > _MAX_TOKENIZERS:
                    self._tokenizers.popitem(last=False)
        self._tokenizer_locks.pop(spec, None)
        return tok

    # --- per request ------------------------------------------------------------------------------------------
    async def tokens_and_hashes(
        self,
        tok: PromptTokenizer,
        *,
        model: str,
        endpoint: Literal["chat", "completions"],
        body: Mapping[str, Any],
        block_size: int,
        salt: str | None,
    ) -> Tokenized:
        """The prompt's token count and block hashes (seeded with `model` and `salt`); (0, ()) when it cannot be
        tokenized (`kvgate_prefix_tokenize_errors_total`). A conversation's long new turn is encoded after this
        returns (`Tokenized.rest`)."""

        if endpoint == "chat" and isinstance(body.get("messages"), list):
            body = _before_media(body)

        def work() -> tuple[int, list[int]] | ChatPrompt:
            if endpoint == "chat" and not body["messages"]:  # media in the first message: nothing to hash
                return 0, []
            if endpoint == "chat" and isinstance(tok, HfPromptTokenizer):  # exact, and only the new tokens encoded
                add_generation_prompt = bool(body.get("add_generation_prompt", True))
                prompt = self.chat_prefixes.prepare(
                    tok, body["messages"], add_generation_prompt, chat_kwargs(body),
                    block_size=block_size, seed=context_seed(model, None, salt),
                )  # fmt: skip
                if prompt.new_turn and len(prompt.text) - prompt.start >= self.config.deferred_turn_min_chars:
                    return prompt
                return self.chat_prefixes.finish(prompt)
            tokens = _tokenize(tok, endpoint, body)
            return len(tokens), prompt_block_hashes(tokens, block_size, model=model, cache_salt=salt)

        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            cfg = self.config
            min_chars = cfg.python_tokenizer_thread_min_chars if tok.pure_python else cfg.tokenizer_thread_min_chars
            done = (
                await loop.run_in_executor(self._pool, work) if _prompt_chars(endpoint, body) >= min_chars else work()
            )
            if isinstance(done, ChatPrompt):  # its known part taken before `finish` extends it in the pool
                known = Tokenized(done.estimate(), tuple(done.hashes))
                tokenized = known._replace(rest=loop.run_in_executor(self._pool, self._finish, done, tok.kind))
                self.metrics.new_turns.inc()
            else:
                tokenized = Tokenized(done[0], tuple(done[1]))
        except Exception as exc:  # the router's prediction must never fail the request; the engine validates
            log.debug("could not tokenize a %s request for %s: %r", endpoint, model, exc)
            self.metrics.tokenize_errors.labels(tok.kind).inc()
            tokenized = Tokenized(0, ())
        self.metrics.tokenize_seconds.labels(tok.kind).observe(time.perf_counter() - started)
        self.metrics.requests.labels(tok.kind, "true" if tok.approximate else "false").inc()
        return tokenized

    def _finish(self, prompt: ChatPrompt, kind: str) -> tuple[int, tuple[int, ...]] | None:
        try:
            n_tokens, hashes = self.chat_prefixes.finish(prompt)
        except Exception as exc:  # as above: the request goes on with the blocks known before
            log.debug("could not tokenize a conversation's new turn: %r", exc)
            self.metrics.tokenize_errors.labels(kind).inc()
            return None
        return n_tokens, tuple(hashes)
