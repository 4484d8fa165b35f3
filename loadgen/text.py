"""Deterministic filler text of a given length in model tokens.

`text(key, n)` draws words from a fixed synthetic vocabulary with `random.Random(key)` (string seeds are stable
across processes, unlike `hash()`), so equal keys give equal text and `text(key, m)` is a prefix of `text(key, n)`
for m <= n: blocks of a trace or a shared system prompt are byte-identical wherever they recur.

Lengths: with no tokenizer a token is exactly 4 bytes (the simulated engine's tokenization; the text is ASCII),
so the text is cut to 4 * n characters. With `--tokenizer DIR` the words are encoded with the model's tokenizer
(loaded lazily, on first use; `tokenizers` is preferred, `transformers` is the fallback), cut to n token ids and
decoded; a decoded text can re-tokenize to slightly different counts at the edges (so the prefix property is
approximate there), and chat templates add their own tokens.
Cost: O(n) per call.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Protocol

CHARS_PER_TOKEN = 4
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "va", "de", "zu", "ho", "fe", "gi", "ba", "mo", "ru", "si",
    "te", "xa", "lu", "pe", "di", "on", "ar", "el", "is", "um", "ex", "qu", "ny", "tr", "st", "gr", "pl", "ch",
)  # fmt: skip


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))


def _words(key: str, chars: int) -> str:
    """At least `chars` characters of space-separated words, deterministic in key."""
    rng = random.Random(key)
    out: list[str] = []
    total = 0
    while total < chars:
        w = _word(rng)
        out.append(w)
        total += len(w) + 1
    return " ".join(out)


class TextMaker(Protocol):
    name: str

    def text(self, key: str, tokens: int) -> str: ...

    def count(self, text: str) -> int: ...


class CharTextMaker:
    """4 characters per token, exact."""

    name = "chars"

    def text(self, key: str, tokens: int) -> str:
        if tokens <= 0:
            return ""
        n = tokens * CHARS_PER_TOKEN
        return _words(key, n)[:n]

    def count(self, text: str) -> int:
        return math.ceil(len(text.encode("utf-8")) / CHARS_PER_TOKEN)


class TokenizerTextMaker:
    """Lengths in the tokens of an HF tokenizer directory; the tokenizer loads on first use."""

    name = "tokenizer"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._tok: Any = None

    def _load(self) -> Any:
        if self._tok is None:
            tok_file = self.directory / "tokenizer.json"
            try:
                from tokenizers import Tokenizer

                if not tok_file.is_file():
                    raise FileNotFoundError(tok_file)
                self._tok = ("tokenizers", Tokenizer.from_file(str(tok_file)))
            except (ImportError, FileNotFoundError):
                from transformers import AutoTokenizer

                self._tok = ("transformers", AutoTokenizer.from_pretrained(str(self.directory)))
        return self._tok

    def _encode(self, text: str) -> list[int]:
        kind, tok = self._load()
        if kind == "tokenizers":
            return list(tok.encode(text, add_special_tokens=False).ids)
        return list(tok.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        kind, tok = self._load()
        if kind == "tokenizers":
            return str(tok.decode(ids, skip_special_tokens=True))
        return str(tok.decode(ids, skip_special_tokens=True))

    def text(self, key: str, tokens: int) -> str:
        if tokens <= 0:
            return ""
        chars = tokens * CHARS_PER_TOKEN
        while True:
            ids = self._encode(_words(key, chars))
            if len(ids) >= tokens:
                return self._decode(ids[:tokens])
            chars *= 2

    def count(self, text: str) -> int:
        return len(self._encode(text))


def make_text_maker(tokenizer_dir: str | None) -> TextMaker:
    return TokenizerTextMaker(tokenizer_dir) if tokenizer_dir else CharTextMaker()
