"""Workloads of the routing benchmark and the best-possible hit rate of a run.

Each `Workload` wraps a seeded generator from `loadgen.workloads` (text from `CharTextMaker`: exactly 4 bytes per
simulated-engine token) with the engine KV capacity it is sized for and its two arrival processes (closed loop at
`concurrency`, Poisson at `rate` new sessions/s). `scale` multiplies the request counts (`--quick` uses ~0.3).

Best possible hit rate (`best_hit_rate`): the run's prompts are rebuilt exactly as the runner sent them (session
history = earlier turns' messages + the answers received, which the simulator makes deterministic), rendered and
tokenized with the simulator's own template and tokenizer, cut into full blocks and chain-hashed. In send order,
each request then hits the longest leading run of its blocks already present in ONE LRU cache whose capacity is the
whole pool's KV blocks (replicas x num_blocks), capped like the engine at (prompt_len - 1) // block_size blocks,
and inserts all its full prompt blocks. That is the cache a perfect router would get if the pool's memory were one
replica: every shared block-aligned prefix with an earlier request counts, as long as the pool could still hold it.
It ignores blocks pinned by running requests and generated tokens, so it is optimistic (an upper reference, not a
proof: LRU is not Belady-optimal). `unbounded` drops the capacity (every earlier prefix counts).
Cost: O(prompt tokens) per request to hash, O(blocks) per request for the LRU.
"""

from __future__ import annotations

import gzip
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadgen.client import RequestResult, RequestSpec
from loadgen.text import CharTextMaker
from loadgen.workloads import (
    agent_sessions,
    flash_crowd,
    multi_round_chat,
    parse_mooncake_trace,
    random_requests,
    shared_prefix,
    trace_replay,
)
from simengine.cache import chain_block_hashes
from simengine.tokenize import tokenize_chat

Factory = Callable[[int], Iterator[RequestSpec]]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    about: str
    factory: Factory  # seed -> specs
    num_blocks: int  # KV capacity per replica, in blocks
    concurrency: int  # closed loop
    rate: float  # Poisson, new sessions per second
    timed: bool = False  # its requests carry their own arrival times: run with the `trace` arrival only


def _n(base: int, scale: float, low: int = 2) -> int:
    return max(low, round(base * scale))


def workloads(scale: float) -> list[Workload]:
    maker = CharTextMaker()
    groups = _n(64, scale, 16)
    per_group = 6
    hot_n = _n(360, scale, 90)
    chat_users = _n(40, scale, 12)
    agents = _n(40, scale, 12)
    big_groups = _n(128, scale, 36)
    rnd_n = _n(320, scale, 90)
    popular_n = _n(480, scale, 120)
    parents = _n(12, scale, 4)
    burst_n = _n(160, scale, 48)
    docs_n = _n(240, scale, 72)

    def gsp(seed: int) -> Iterator[RequestSpec]:
        return shared_prefix(
            maker, seed=seed, groups=groups, prompts_per_group=per_group,
            system_tokens=1536, question_tokens=64, output_tokens=16,
        )  # fmt: skip

    def hot(seed: int) -> Iterator[RequestSpec]:
        # zipf s=2 over 6 prefixes: the first carries ~67% of the traffic, the second ~17%
        return shared_prefix(
            maker, seed=seed, groups=6, prompts_per_group=hot_n // 6, system_tokens=1536,
            question_tokens=64, output_tokens=16, popularity="zipf", zipf_s=2.0,
        )  # fmt: skip

    def popular(seed: int) -> Iterator[RequestSpec]:
        # zipf s=1.1 over 24 prefixes: production's popular system prompts (a long tail, no single one dominating)
        return shared_prefix(
            maker, seed=seed, groups=24, prompts_per_group=popular_n // 24, system_tokens=512,
            question_tokens=64, output_tokens=16, popularity="zipf", zipf_s=1.1,
        )  # fmt: skip

    def chat(seed: int) -> Iterator[RequestSpec]:
        return multi_round_chat(
            maker, seed=seed, users=chat_users, rounds=6, system_tokens=768, question_tokens=96, answer_tokens=16
        )

    def agent(seed: int) -> Iterator[RequestSpec]:
        return agent_sessions(
            maker, seed=seed, sessions=agents, turns=6, system_tokens=1536, task_tokens=64,
            tool_result_tokens=160, output_tokens=16, pause_s=0.3,
        )  # fmt: skip

    def subagents(seed: int) -> Iterator[RequestSpec]:
        return agent_sessions(
            maker, seed=seed, sessions=parents, turns=6, system_tokens=1536, task_tokens=64,
            tool_result_tokens=160, output_tokens=16, pause_s=0.3, subagents=3,
        )  # fmt: skip

    def big(seed: int) -> Iterator[RequestSpec]:
        return shared_prefix(
            maker, seed=seed, groups=big_groups, prompts_per_group=3, system_tokens=1536,
            question_tokens=64, output_tokens=16,
        )  # fmt: skip

    def crowd(seed: int) -> Iterator[RequestSpec]:
        return flash_crowd(maker, seed=seed, prompts=4, bursts=3, per_burst=burst_n, burst_s=0.4, gap_s=5.0)

    def documents(seed: int) -> Iterator[RequestSpec]:
        # 6 end users sending OpenAI's `user` (kvgate makes each a session) over 12 zipf-popular documents; KV for
        # three documents and their questions per replica: the working set fits the pool only when partitioned
        return shared_prefix(
            maker, seed=seed, groups=12, prompts_per_group=docs_n // 12, system_tokens=2048, question_tokens=64,
            output_tokens=16, popularity="zipf", zipf_s=1.1, users=6,
        )  # fmt: skip

    def rnd(seed: int) -> Iterator[RequestSpec]:
        return random_requests(maker, seed=seed, num_requests=rnd_n, input_tokens=(512, 2048), output_tokens=(8, 24))

    system_blocks = 1536 // 16 + 1
    return [
        Workload("shared-prefix", f"{groups} groups x {per_group}, system 1536 tok, question 64, output 16",
                 gsp, num_blocks=max(1024, groups * system_blocks // 3), concurrency=32, rate=45.0),
        Workload("multi-round-chat", f"{chat_users} users x 6 rounds, system 768, question 96, answer 16",
                 chat, num_blocks=2048, concurrency=32, rate=5.0),
        Workload("hot-prefix", f"6 prefixes, zipf s=2 (~67% on one), {hot_n // 6 * 6} requests, system 1536",
                 hot, num_blocks=2048, concurrency=48, rate=50.0),
        Workload("zipf-popular", f"24 prefixes, zipf s=1.1, {popular_n // 24 * 24} requests, system 512",
                 popular, num_blocks=2048, concurrency=32, rate=20.0),
        Workload("agent-sessions", f"{agents} sessions x 6 turns, shared system 1536, tool results 160, pause 0.3 s",
                 agent, num_blocks=2048, concurrency=32, rate=5.0),
        Workload("agent-subagents", f"{parents} agents, each with 3 sub-agents under its session header (system "
                 "768), 6 turns each, system 1536, tool results 160, pause 0.3 s", subagents, num_blocks=2048,
                 concurrency=32, rate=5.0),
        Workload("beyond-capacity", f"{big_groups} groups x 3, system 1536: working set ~{big_groups * system_blocks}"
                 " blocks > pool", big, num_blocks=max(512, big_groups * system_blocks // 6), concurrency=32,
                 rate=40.0),
        Workload("zero-reuse", f"{rnd_n} unique prompts 512-2048 tok, output 8-24", rnd,
                 num_blocks=2048, concurrency=32, rate=32.0),
        Workload("flash-crowd", f"3 bursts of {burst_n} requests within 0.4 s, 5 s apart, on 4 system prompts of 1536",
                 crowd, num_blocks=2048, concurrency=32, rate=0.0, timed=True),
        Workload("documents-users", f"6 users sending `user`, 12 documents of 2048 tok (zipf s=1.1), "
                 f"{docs_n // 12 * 12} requests; KV for 3 documents a replica", documents, num_blocks=400,
                 concurrency=8, rate=10.0),
    ]  # fmt: skip


TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids each name 512 tokens


def trace_workload(
    path: str, replicas: int, cache_ratio: float, max_input_tokens: int = 8192, requests: int | None = None
) -> Workload:
    """A Mooncake-format JSONL trace (FAST'25's public conversation and tool-agent traces: `timestamp` ms,
    `input_length`, `output_length`, `hash_ids` of 512-token blocks; gzip-compressed when the name ends in .gz)
    replayed at its own timestamps (`--arrivals trace`), its first `requests` records (all: None), prompts clamped
    to `max_input_tokens`; each replica's KV sized so that the trace's working set is `cache_ratio` times the
    pool's."""
    with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8") as fh:
        records = parse_mooncake_trace(itertools.islice(fh, requests))
    maker = CharTextMaker()
    per_block = min(TRACE_BLOCK_TOKENS, max_input_tokens) // 16  # simulated blocks of 16 tokens per trace block
    working_set = len({h for r in records for h in r.hash_ids}) * per_block
    num_blocks = max(256, round(working_set / (cache_ratio * replicas)))

    def replay(seed: int) -> Iterator[RequestSpec]:
        return trace_replay(
            maker, records, seed=seed, block_tokens=TRACE_BLOCK_TOKENS, max_input_tokens=max_input_tokens,
            max_output_tokens=32,
        )  # fmt: skip

    about = f"{len(records)} requests of {Path(path).name}, working set {working_set} blocks, {cache_ratio:g}x the pool"
    return Workload("trace", about, replay, num_blocks=num_blocks, concurrency=32, rate=0.0, timed=True)


def rebuild_prompts(factory: Factory, seed: int, results: Sequence[RequestResult]) -> list[list[int]]:
    """Token ids of every result's prompt, in send order (results sorted by start_s)."""
    specs = {(s.session_id, s.turn): s for s in factory(seed)}
    answers = {(r.session_id, r.turn): r.text for r in results}
    out: list[list[int]] = []
    for r in sorted(results, key=lambda r: r.start_s):
        msgs: list[dict[str, str]] = []
        for t in range(r.turn):
            prev = specs[(r.session_id, t)]
            msgs += [{"role": role, "content": c} for role, c in prev.messages]
            msgs.append({"role": "assistant", "content": answers.get((r.session_id, t), "")})
        msgs += [{"role": role, "content": c} for role, c in specs[(r.session_id, r.turn)].messages]
        out.append(tokenize_chat(msgs))
    return out


def best_hit_rate(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int | None, model: str) -> float:
    """Hit tokens / prompt tokens of one ideal LRU prefix cache (module header); None capacity = unbounded."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for tokens in prompts:
        hashes = chain_block_hashes(tokens, block_size, model)
        cap = max(len(tokens) - 1, 0) // block_size
        n = 0
        while n < min(cap, len(hashes)) and hashes[n] in lru:
            n += 1
        hits += n * block_size
        total += len(tokens)
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while capacity_blocks is not None and len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits / total if total else 0.0
