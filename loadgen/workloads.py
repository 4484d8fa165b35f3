"""Workloads: seeded generators of `RequestSpec`s. Lengths are in model tokens (see `loadgen.text`).

- `shared_prefix`: `groups` system prompts of `system_tokens`, each shared by questions of `question_tokens`;
  `groups * prompts_per_group` requests whose group is round-robin (uniform) or drawn with probability
  proportional to 1 / rank^s (zipf), then shuffled. Single-turn. With `users`, the requests come from that many
  end users in turn, each sending OpenAI's `user` field (as OpenAI recommends; kvgate keys sessions on it).
- `flash_crowd`: `bursts` bursts of `per_burst` requests, `gap_s` apart, each burst's arrivals spread uniformly over
  `burst_s` (a push notification, a page going viral): `prompts` system prompts drawn uniformly, a question each.
- `multi_round_chat`: `users` sessions of `rounds` turns; one shared system prompt, a new question per turn; the
  runner appends each answer to the session history, so the context grows by question + answer every turn; each
  request carries OpenAI's `user` field, as chat apps send it.
  `think_s` pauses between a turn's answer and the next question.
- `agent_sessions`: long sessions: a shared tool-description system prompt, a task, then `turns - 1` tool results
  of `tool_result_tokens` each (sent as user messages, so every chat template accepts them), `pause_s` between
  turns, and an `x-session-id` header for session affinity. With `subagents`, each session also runs that many
  sub-agent conversations of its own (a shared sub-agent system prompt of half the length, a task, tool results)
  under the parent's session header, as agent frameworks send them (Claude Code's sub-agents share its
  `x-claude-code-session-id`).
- `random_requests`: unique text, input and output lengths uniform in the given ranges. No reuse.
- `trace_replay`: a Mooncake-style JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`): block
  i of a prompt is the text keyed by hash_ids[i] (`block_tokens` tokens, the last block cut to length), so requests
  sharing hash ids share those blocks; arrival offsets are the timestamps relative to the first, times
  `time_scale`.

Every generator yields the turns of one session in order and marks the last with `final=True`; the runner holds
turn k+1 until turn k's answer arrived. Memory: shared-prefix materialises its groups * prompts specs (to shuffle);
the others are lazy. Time: O(total prompt tokens).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from loadgen.client import RequestSpec
from loadgen.text import TextMaker

SESSION_HEADER = "x-session-id"


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def shared_prefix(
    maker: TextMaker,
    *,
    seed: int,
    groups: int = 8,
    prompts_per_group: int = 8,
    system_tokens: int = 512,
    question_tokens: int = 64,
    output_tokens: int = 64,
    popularity: Literal["uniform", "zipf"] = "uniform",
    zipf_s: float = 1.1,
    users: int = 0,
) -> Iterator[RequestSpec]:
    if groups < 1 or prompts_per_group < 1:
        raise ValueError("groups and prompts_per_group must be >= 1")
    rng = random.Random(seed)
    total = groups * prompts_per_group
    if popularity == "zipf":
        assignment = rng.choices(range(groups), weights=zipf_weights(groups, zipf_s), k=total)
    else:
        assignment = [i % groups for i in range(total)]
    rng.shuffle(assignment)
    systems = [maker.text(f"sp-{seed}-sys-{g}", system_tokens) for g in range(groups)]
    for i, g in enumerate(assignment):
        question = maker.text(f"sp-{seed}-q-{i}", question_tokens)
        yield RequestSpec(
            session_id=f"sp{i}",
            user_id=f"u{i % users}" if users else f"g{g}",
            turn=0,
            messages=(("system", systems[g]), ("user", question)),
            max_tokens=output_tokens,
            est_prompt_tokens=system_tokens + question_tokens,
            group=g,
            send_user=users > 0,
        )


def flash_crowd(
    maker: TextMaker,
    *,
    seed: int,
    prompts: int = 4,
    bursts: int = 3,
    per_burst: int = 160,
    burst_s: float = 0.4,
    gap_s: float = 5.0,
    system_tokens: int = 1536,
    question_tokens: int = 64,
    output_tokens: int = 16,
) -> Iterator[RequestSpec]:
    rng = random.Random(seed)
    systems = [maker.text(f"fc-{seed}-sys-{g}", system_tokens) for g in range(prompts)]
    for b in range(bursts):
        for k, t in enumerate(sorted(rng.uniform(0.0, burst_s) for _ in range(per_burst))):
            i, g = b * per_burst + k, rng.randrange(prompts)
            yield RequestSpec(
                session_id=f"fc{i}",
                user_id=f"g{g}",
                turn=0,
                messages=(("system", systems[g]), ("user", maker.text(f"fc-{seed}-q-{i}", question_tokens))),
                max_tokens=output_tokens,
                arrival_s=b * gap_s + t,
                est_prompt_tokens=system_tokens + question_tokens,
                group=g,
            )


def multi_round_chat(
    maker: TextMaker,
    *,
    seed: int,
    users: int = 8,
    rounds: int = 4,
    system_tokens: int = 256,
    question_tokens: int = 64,
    answer_tokens: int = 64,
    think_s: float = 0.0,
) -> Iterator[RequestSpec]:
    if users < 1 or rounds < 1:
        raise ValueError("users and rounds must be >= 1")
    system = maker.text(f"mr-{seed}-sys", system_tokens)
    for u in range(users):
        for r in range(rounds):
            question = maker.text(f"mr-{seed}-u{u}-r{r}", question_tokens)
            msgs = (("system", system), ("user", question)) if r == 0 else (("user", question),)
            yield RequestSpec(
                session_id=f"chat{u}",
                user_id=f"user{u}",
                send_user=True,
                turn=r,
                messages=msgs,
                max_tokens=answer_tokens,
                think_s=think_s if r > 0 else 0.0,
                est_prompt_tokens=(system_tokens if r == 0 else 0) + question_tokens,
                final=r == rounds - 1,
            )


def agent_sessions(
    maker: TextMaker,
    *,
    seed: int,
    sessions: int = 4,
    turns: int = 8,
    system_tokens: int = 1024,
    task_tokens: int = 64,
    tool_result_tokens: int = 128,
    output_tokens: int = 32,
    pause_s: float = 0.0,
    subagents: int = 0,
) -> Iterator[RequestSpec]:
    if sessions < 1 or turns < 1:
        raise ValueError("sessions and turns must be >= 1")
    system = maker.text(f"ag-{seed}-tools", system_tokens)
    sub_system = maker.text(f"ag-{seed}-subagent", system_tokens // 2)

    def conversation(sid: str, header: str, user: str, key: str, first: tuple[str, int]) -> Iterator[RequestSpec]:
        for t in range(turns):
            if t == 0:
                msgs: tuple[tuple[str, str], ...] = (
                    ("system", first[0]),
                    ("user", maker.text(f"{key}-task", task_tokens)),
                )
                est = first[1] + task_tokens
            else:
                msgs = (("user", f"Tool result: {maker.text(f'{key}-t{t}', tool_result_tokens)}"),)
                est = tool_result_tokens
            yield RequestSpec(
                session_id=sid,
                user_id=user,
                turn=t,
                messages=msgs,
                max_tokens=output_tokens,
                think_s=pause_s if t > 0 else 0.0,
                headers=((SESSION_HEADER, header),),
                est_prompt_tokens=est,
                final=t == turns - 1,
            )

    for s in range(sessions):
        sid = f"agent-{seed}-{s}"
        yield from conversation(sid, sid, f"agent{s}", f"ag-{seed}-s{s}", (system, system_tokens))
        for j in range(subagents):  # conversations of their own under the parent's session header
            sub = (sub_system, system_tokens // 2)
            yield from conversation(f"{sid}-sub{j}", sid, f"agent{s}", f"ag-{seed}-s{s}-sub{j}", sub)


def random_requests(
    maker: TextMaker,
    *,
    seed: int,
    num_requests: int = 64,
    input_tokens: tuple[int, int] = (128, 512),
    output_tokens: tuple[int, int] = (32, 128),
) -> Iterator[RequestSpec]:
    rng = random.Random(seed)
    for i in range(num_requests):
        n_in = rng.randint(*input_tokens)
        n_out = rng.randint(*output_tokens)
        yield RequestSpec(
            session_id=f"rnd{i}",
            user_id=f"rnd{i}",
            turn=0,
            messages=(("user", maker.text(f"rnd-{seed}-{i}", n_in)),),
            max_tokens=n_out,
            est_prompt_tokens=n_in,
        )


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake record; the message names the line."""


def _int_field(obj: dict[str, object], name: str, lineno: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"trace line {lineno}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def json_lines(lines: Iterable[str], name: str, error: type[ValueError]) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank JSON line; raises `error` naming the first line that is not JSON."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise error(f"{name} line {lineno}: not JSON ({exc})") from exc
        yield lineno, obj


def parse_mooncake_trace(lines: Iterable[str]) -> list[TraceRecord]:
    """Parses JSONL records; blank lines are skipped; raises TraceError naming the first bad line."""
    records: list[TraceRecord] = []
    for lineno, obj in json_lines(lines, "trace", TraceError):
        if not isinstance(obj, dict):
            raise TraceError(f"trace line {lineno}: expected an object")
        ts = obj.get("timestamp", 0)
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise TraceError(f"trace line {lineno}: 'timestamp' must be a number, got {ts!r}")
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
            raise TraceError(f"trace line {lineno}: 'hash_ids' must be a list of integers")
        records.append(
            TraceRecord(
                timestamp_ms=float(ts),
                input_length=_int_field(obj, "input_length", lineno),
                output_length=_int_field(obj, "output_length", lineno),
                hash_ids=tuple(hashes),
            )
        )
    return records


def trace_prompt(maker: TextMaker, rec: TraceRecord, *, seed: int, index: int, block_tokens: int) -> str:
    """The prompt of one record: shared blocks keyed by hash id, then unique filler past the last block."""
    parts: list[str] = []
    left = rec.input_length
    for h in rec.hash_ids:
        if left <= 0:
            break
        n = min(block_tokens, left)
        parts.append(maker.text(f"tr-{seed}-block-{h}", n))
        left -= n
    if left > 0:
        parts.append(maker.text(f"tr-{seed}-tail-{index}", left))
    return "".join(parts)


def trace_replay(
    maker: TextMaker,
    records: Sequence[TraceRecord],
    *,
    seed: int,
    block_tokens: int = 512,
    time_scale: float = 1.0,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> Iterator[RequestSpec]:
    """Specs in timestamp order; `max_*` clamp lengths for small models (the block structure is kept)."""
    if not records:
        return
    ordered = sorted(range(len(records)), key=lambda i: records[i].timestamp_ms)
    t0 = records[ordered[0]].timestamp_ms
    for i in ordered:
        rec = records[i]
        if max_input_tokens is not None and rec.input_length > max_input_tokens:
            rec = TraceRecord(rec.timestamp_ms, max_input_tokens, rec.output_length, rec.hash_ids)
        out = rec.output_length if max_output_tokens is None else min(rec.output_length, max_output_tokens)
        yield RequestSpec(
            session_id=f"trace{i}",
            user_id=f"trace{i}",
            turn=0,
            messages=(("user", trace_prompt(maker, rec, seed=seed, index=i, block_tokens=block_tokens)),),
            max_tokens=max(1, out),
            arrival_s=(rec.timestamp_ms - t0) / 1000.0 * time_scale,
            est_prompt_tokens=rec.input_length,
        )
