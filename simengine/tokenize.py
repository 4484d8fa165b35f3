"""The simulated engine's tokenizer and chat template: pure functions, reproducible by the gateway bit for bit.

Chat template: each message renders as ``"<|{role}|>\\n{content}\\n"``; ``"<|assistant|>\\n"`` is appended when
``add_generation_prompt`` (the default). Content is a string, ``None`` (empty) or a list of
``{"type": "text", "text": ...}`` parts, concatenated.

Tokenizer: the UTF-8 bytes of the text cut into consecutive 4-byte chunks (the last one may be shorter); a token id is
``int.from_bytes(chunk, "little")``, so every id is below 2**32. A completions prompt given as a list of ints is used
as is. Cost: O(bytes) per call, no state.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CHUNK_BYTES = 4
MAX_TOKEN_ID = 2**63 - 1  # largest id accepted in a token-id prompt (vLLM's bound)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"unsupported content part type {kind!r}: only 'text' parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise ValueError("message content must be a string, a list of text parts or null")


def render_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """Render chat messages with the simulator's template; raises ValueError on a malformed message.
    `continue_final_message`: the last message is left open (no newline after it), for the model to continue it."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("'messages' must be a list of message objects")
    out: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError("each message needs a non-empty string 'role'")
        out.append(f"<|{role}|>\n{_content_text(message.get('content'))}\n")
    if continue_final_message and out:
        out[-1] = out[-1][:-1]
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def tokenize_bytes(data: bytes) -> list[int]:
    """Token ids of raw bytes: little-endian 4-byte chunks, the last one possibly shorter."""
    full = len(data) // CHUNK_BYTES
    ids = list(struct.unpack(f"<{full}I", data[: full * CHUNK_BYTES])) if full else []
    tail = data[full * CHUNK_BYTES :]
    if tail:
        ids.append(int.from_bytes(tail, "little"))
    return ids


def tokenize_text(text: str) -> list[int]:
    """Token ids of a plain text (no template)."""
    return tokenize_bytes(text.encode("utf-8"))


def tokenize_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, continue_final_message: bool = False
) -> list[int]:
    """Token ids of chat messages rendered with `render_chat`."""
    return tokenize_text(render_chat(messages, add_generation_prompt, continue_final_message))


def text_state(tokens: Sequence[int]) -> int:
    """The CRC-32 of the text `tokens` stand for (the bytes `tokenize_text` cut; token-id prompts beyond 4 bytes:
    their decimal list): the start of the output's autoregressive state (`simengine.engine.output_words`). C-speed,
    O(tokens)."""
    if not tokens:
        return 0
    try:
        data = struct.pack(f"<{len(tokens) - 1}I", *tokens[:-1]) + tokens[-1].to_bytes(CHUNK_BYTES, "little")
    except (struct.error, OverflowError):
        return zlib.crc32(repr(list(tokens)).encode())
    return zlib.crc32(data.rstrip(b"\0") if data[-1] == 0 else data)


def detokenize(token_ids: Iterable[int]) -> str:
    """Inverse of `tokenize_text` for ids it produced (trailing NUL bytes of a chunk are dropped).

    Raises ValueError for an id that is negative or does not fit in 4 bytes. Invalid UTF-8 becomes U+FFFD.
    """
    chunks: list[bytes] = []
    for token in token_ids:
        if not 0 <= token < 2**32:
            raise ValueError(f"token id {token} is not a simulator token (must be in [0, 2**32))")
        chunks.append(token.to_bytes(CHUNK_BYTES, "little").rstrip(b"\0"))
    return b"".join(chunks).decode("utf-8", errors="replace")
