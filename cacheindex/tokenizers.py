"""Prompt tokenizers: the token ids an engine will see for a request, computed in the gateway.

Kinds:
- `hf`: a local Hugging Face tokenizer directory, reproducing vLLM's chat path exactly: the messages are normalized
  as vLLM does (`chat_render`), the chat template is rendered to text (`apply_chat_template(tokenize=False)`) and the
  text encoded with `add_special_tokens=False` (the template emits BOS itself; that is what vLLM's default
  `add_special_tokens=False` for chat and transformers' own `apply_chat_template(tokenize=True)` do). Completions
  text is encoded with `add_special_tokens=True` (vLLM's default, BOS added), unless the request says otherwise.
- `sim`: the simulated engine's documented tokenizer (`SimPromptTokenizer`), exact for the simulator.
- `chars`: any other engine. Pseudo tokens: fixed-size character chunks of a canonical rendering, each chunk's
  id a 32-bit hash. Deterministic, so repeated prefixes still match each other, but block boundaries do not match
  the engine's: overlaps are estimates (`approximate = True`, labelled in metrics) and KV events cannot be used.

Every tokenizer is a plain synchronous object; `CacheAwareState` runs large prompts in a thread pool (much larger
ones for `pure_python` tokenizers, which hold the GIL: measured here, `sim` tokenizes ~100 characters/us and `chars`
~16, so 16k characters block the loop for 0.2 / 1 ms, less than a thread hand-off costs under load).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson
import xxhash

from cacheindex.chat_render import ContentFormat, detect_content_format, normalize_conversation, text_parts

# apply_chat_template parameters a request's chat_template_kwargs must not override
_RESERVED_KWARGS = frozenset(
    {"conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
     "tokenizer_kwargs", "return_assistant_tokens_mask", "chat_template", "add_generation_prompt",
     "add_special_tokens"}
)  # fmt: skip


class PromptTokenizer(Protocol):
    kind: str  # "hf" | "sim" | "chars"
    approximate: bool  # True when ids are pseudo tokens that do not match the engine's
    pure_python: bool  # holds the GIL throughout: a thread gives it no parallelism, only hand-off latency

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat request, as the engine renders it; ValueError on malformed messages."""
        ...

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completions prompt."""
        ...


class HfPromptTokenizer:
    kind = "hf"
    approximate = False
    pure_python = False  # the Rust encoder releases the GIL

    def __init__(self, path: str) -> None:
        """Load a tokenizer from a local directory (blocking: call it off the event loop)."""
        from transformers import AutoTokenizer  # optional dependency, imported only when used

        self.path = path
        self._tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        template = getattr(self._tok, "chat_template", None)
        self._template: str | None = template if isinstance(template, str) else None
        self._format: ContentFormat = detect_content_format(self._template) if self._template else "string"
        # identifies the rendering in the chat prefix cache's keys (hashed once: the template is kilobytes)
        self.template_id = xxhash.xxh3_128_hexdigest(f"{path}\0{self._template or ''}".encode())
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in added.values() if getattr(t, "special", False)}
        self.special_tokens: tuple[str, ...] = tuple(sorted(specials | set(self._tok.all_special_tokens)))
        self._suffixes: dict[bytes, str] = {}
        self.special_lead = self._special_lead()

    def _special_lead(self) -> str | None:
        """The text of the special tokens `encode(text, add_special_tokens=True)` puts before any text (Llama's BOS),
        "" when none, None when it also adds some after the text (then no text prefix stands for them)."""
        plain = self._tok.encode("kvgate", add_special_tokens=False)
        full = self._tok.encode("kvgate", add_special_tokens=True)
        n = len(full) - len(plain)
        if n < 0 or full[n:] != plain:
            return None
        lead: str = self._tok.decode(full[:n]) if n else ""
        return lead if self._tok.encode(lead, add_special_tokens=False) == full[:n] else None

    @property
    def content_format(self) -> ContentFormat:
        return self._format

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        _, text = self.render_chat(messages, add_generation_prompt, chat_template_kwargs or {})
        return self.encode(text)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, kwargs: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], str]:
        """The normalized conversation and the text the engine's chat template renders for it; with
        `add_special_tokens` in `kwargs` (vLLM's request field: the tokenizer's special tokens added on top of what
        the template writes), the text of those tokens first, so that encoding the text (`encode`) gives them."""
        lead = self.special_lead if kwargs.get("add_special_tokens") else ""
        if lead is None:
            raise ValueError("this tokenizer adds special tokens after the text: not expressible as rendered text")
        kwargs = {k: v for k, v in kwargs.items() if k not in _RESERVED_KWARGS}
        if kwargs.get("continue_final_message"):
            add_generation_prompt = False
        conversation = normalize_conversation(messages, self._format, self._template)
        text: str = self._tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return conversation, lead + text

    def generation_suffix(self, kwargs: Mapping[str, Any]) -> str:
        """What the generation prompt appends after the last message ("" when it is not a plain suffix)."""
        key = orjson.dumps(kwargs, default=str, option=orjson.OPT_SORT_KEYS)
        suffix = self._suffixes.get(key)
        if suffix is None:
            probe = [{"role": "user", "content": "kvgate probe"}]
            _, without = self.render_chat(probe, False, kwargs)
            _, with_prompt = self.render_chat(probe, True, kwargs)
            suffix = with_prompt[len(without) :] if with_prompt.startswith(without) else ""
            if len(self._suffixes) < 64:
                self._suffixes[key] = suffix
        return suffix

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered chat text (the template emits the special tokens itself)."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=False)
        return ids

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return ids


class SimPromptTokenizer:
    """The simulated engine's documented tokenizer (`kvgate sim-engine`; `simengine.tokenize` is its side, written
    independently as vLLM's own code is): each message renders as "<|role|>\\ncontent\\n" (text parts concatenated),
    then "<|assistant|>\\n"; token ids are the little-endian 4-byte chunks of the UTF-8 text. Both sides are checked
    against each other by tests/test_prefix_tokenizers.py."""

    kind = "sim"
    approximate = False
    pure_python = True

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise ValueError("'messages' must be a list of message objects")
        out: list[str] = []
        for message in messages:
            role = message.get("role") if isinstance(message, Mapping) else None
            if not isinstance(role, str) or not role:
                raise ValueError("each message needs a non-empty string 'role'")
            out.append(f"<|{role}|>\n{''.join(text_parts(message.get('content')))}\n")
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return self.tokenize_text("".join(out))

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        full = len(data) // 4
        ids = list(struct.unpack(f"<{full}I", data[: full * 4])) if full else []
        if len(data) > full * 4:
            ids.append(int.from_bytes(data[full * 4 :], "little"))
        return ids


class CharsPromptTokenizer:
    """Pseudo tokens: `chunk_chars`-character chunks of the text (chat: a canonical "role\\ncontent\\n" rendering),
    each id the 32-bit xxhash of the chunk. About one pseudo token per real token at 4 characters."""

    kind = "chars"
    approximate = True
    pure_python = True

    def __init__(self, chunk_chars: int = 4) -> None:
        if chunk_chars <= 0:
            raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
        self._chunk = chunk_chars

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        digest = xxhash.xxh32_intdigest
        n = self._chunk
        return [digest(text[i : i + n].encode()) for i in range(0, len(text), n)]

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        conversation = normalize_conversation(messages, "string", None)
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in conversation)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.tokenize_text(text)


def build_tokenizer(spec: str, *, chunk_chars: int = 4) -> PromptTokenizer:
    """`spec`: "sim", "chars", or a local HF tokenizer directory. Blocking for HF (run it off the loop)."""
    if spec == "sim":
        return SimPromptTokenizer()
    if spec == "chars":
        return CharsPromptTokenizer(chunk_chars)
    return HfPromptTokenizer(spec)
