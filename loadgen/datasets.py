"""Real prompts as workloads: a ShareGPT-format JSON file or a JSONL file of prompts, lengths from the data.

- ShareGPT (`--workload sharegpt --dataset FILE`): a JSON list of `{"conversations": [{"from": ..., "value": ...}]}`
  (`human`/`user`, `gpt`/`assistant`/`chatgpt`/`bard`/`bing`, `system`). A conversation becomes one session: its
  first `max_turns` user turns in order, each asking for as many tokens as the reply that follows it in the data
  (`--output-len` when the data has no reply). The runner's history carries the engine's own answers, as a chat
  app's would. Conversations with no user turn are skipped.
- JSONL (`--workload jsonl --dataset FILE`): one prompt per line: a JSON string, or an object with `prompt`
  (a string) or `messages` (OpenAI chat messages), and optionally `output_len` / `max_tokens` (else
  `--output-len`). Blank lines are skipped; a bad line raises `DatasetError` naming it.
Sampling: the conversations are shuffled with the setting's seed (each sweep point gets its own order); the
runner's `--num-requests` caps what is sent. `max_input_tokens` skips sessions whose first prompt is longer (real text
is not cut mid-sentence), `max_output_tokens` clamps answers (as vLLM's benchmark does for ShareGPT).
Lengths in model tokens through the run's `TextMaker` (`--tokenizer`, else 4 characters), counted when a session
is first yielded and kept for later seeds. Memory: the parsed file; time: O(tokens of the sessions used).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.client import Message, RequestSpec
from loadgen.text import TextMaker
from loadgen.workloads import json_lines

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}  # fmt: skip


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Turn:
    messages: tuple[Message, ...]  # what this turn sends (a system message rides on the first)
    reply: str | None  # the data's answer, whose length is the turn's max_tokens
    output_len: int | None = None  # an explicit length from the data


@dataclass(frozen=True, slots=True)
class Conversation:
    turns: tuple[Turn, ...]


def parse_sharegpt(data: Any, name: str = "dataset") -> list[Conversation]:
    if not isinstance(data, list):
        raise DatasetError(f"{name}: a ShareGPT file is a JSON list of conversations")
    out: list[Conversation] = []
    for i, entry in enumerate(data):
        msgs = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(msgs, list):
            raise DatasetError(f"{name}: entry {i} has no 'conversations' list")
        turns: list[Turn] = []
        system: list[Message] = []
        for m in msgs:
            role = _ROLES.get(str(m.get("from", "")).lower()) if isinstance(m, dict) else None
            text = m.get("value") if isinstance(m, dict) else None
            if role is None or not isinstance(text, str):
                continue  # unknown speakers and malformed turns are skipped, as vLLM's benchmark does
            if role == "system" and not turns:
                system.append(("system", text))
            elif role == "user":
                turns.append(Turn((*system, ("user", text)), None))
                system = []
            elif role == "assistant" and turns and turns[-1].reply is None:
                turns[-1] = Turn(turns[-1].messages, text)
        if turns:
            out.append(Conversation(tuple(turns)))
    return out


def _jsonl_turn(obj: Any, where: str) -> Turn:
    if isinstance(obj, str):
        return Turn((("user", obj),), None)
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a string or an object with 'prompt' or 'messages'")
    length = obj.get("output_len", obj.get("max_tokens"))
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise DatasetError(f"{where}: 'output_len' must be a positive integer, got {length!r}")
    if isinstance(obj.get("prompt"), str):
        return Turn((("user", obj["prompt"]),), None, length)
    msgs = obj.get("messages")
    if (
        isinstance(msgs, list)
        and msgs
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
    ):
        return Turn(tuple((m["role"], m["content"]) for m in msgs), None, length)
    raise DatasetError(f"{where}: expected 'prompt' (a string) or 'messages' (role/content objects)")


def parse_jsonl(lines: Sequence[str], name: str = "dataset") -> list[Conversation]:
    return [Conversation((_jsonl_turn(obj, f"{name} line {n}"),)) for n, obj in json_lines(lines, name, DatasetError)]


def load_dataset(kind: str, path: str) -> list[Conversation]:
    """Reads and parses the file; raises DatasetError (empty or malformed) or OSError."""
    text = Path(path).read_text(encoding="utf-8")
    if kind == "sharegpt":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise DatasetError(f"{path}: not JSON ({exc})") from exc
        convs = parse_sharegpt(data, path)
    else:
        convs = parse_jsonl(text.splitlines(), path)
    if not convs:
        raise DatasetError(f"{path}: no usable prompts")
    return convs


class DatasetWorkload:
    """The factory of a dataset workload (module header): `specs(seed)` yields the sessions in a seeded order."""

    def __init__(
        self,
        maker: TextMaker,
        conversations: Sequence[Conversation],
        *,
        max_turns: int = 1,
        default_output_len: int = 64,
        max_input_tokens: int | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError("dataset turns must be >= 1")
        self.maker, self.conversations = maker, list(conversations)
        self.max_turns, self.default_output_len = max_turns, default_output_len
        self.max_input_tokens, self.max_output_tokens = max_input_tokens, max_output_tokens
        self._lengths: dict[int, list[tuple[int, int]]] = {}  # conversation -> (prompt, output) tokens per turn

    def _lengths_of(self, index: int) -> list[tuple[int, int]]:
        if index not in self._lengths:
            turns = self.conversations[index].turns[: self.max_turns]
            self._lengths[index] = [
                (
                    sum(self.maker.count(text) for _, text in t.messages),
                    t.output_len or (max(1, self.maker.count(t.reply)) if t.reply else self.default_output_len),
                )
                for t in turns
            ]
        return self._lengths[index]

    def specs(self, seed: int) -> Iterator[RequestSpec]:
        order = list(range(len(self.conversations)))
        random.Random(seed).shuffle(order)
        for index in order:
            lengths = self._lengths_of(index)
            if self.max_input_tokens is not None and lengths[0][0] > self.max_input_tokens:
                continue
            turns = self.conversations[index].turns[: self.max_turns]
            for k, (turn, (prompt, output)) in enumerate(zip(turns, lengths, strict=True)):
                if self.max_output_tokens is not None:
                    output = min(output, self.max_output_tokens)
                yield RequestSpec(
                    session_id=f"ds{index}",
                    user_id=f"ds{index}",
                    turn=k,
                    messages=turn.messages,
                    max_tokens=output,
                    est_prompt_tokens=prompt,
                    final=k == len(turns) - 1,
                )
