"""Gateway time to first token on a long, growing agent conversation: what cache-aware routing adds per turn.

    python -m bench.bench_long_context              # ~2 min on 2 cores
    python -m bench.bench_long_context --turns 20   # shorter
    python -m bench.bench_long_context --shape chat-tools       # an agent's tool turns, chat API
    python -m bench.bench_long_context --shape messages-tools   # the same as the Messages API (tool_use/tool_result)

Setup: one instant simulated engine (`kvgate sim-engine --instant`, no prefill or decode time) and two kvgate
gateways in front of it, cache-aware, with the tiny model's real Hugging Face tokenizer and chat template
(`kvgate make-tiny-model`): `incremental` (the default: the chat prefix cache reuses the tokens of the history)
and `full` (`cache.chat_prefix_cache_bytes: 0`: every turn tokenizes the whole conversation). One agent session:
a system prompt, then per turn a user message and the assistant's answer (fixed text of `--turn-chars` each),
so the history grows by 2 x turn-chars per turn. `--shape chat-tools` makes each turn an agent's tool round: the
assistant's `tool_calls` (a function call with JSON arguments) and a `tool` message with the result (turn-chars
each); `--shape messages-tools` the same in the Messages API (`tool_use` and `tool_result` blocks). Each turn is
sent as a streaming request straight to the engine and through each gateway, in rotating order; TTFT is measured
by the client to the first content chunk (chat) or `content_block_delta` (Messages).
Added TTFT = gateway TTFT - engine TTFT of the same turn. Also: the first request after a gateway start
(a fresh gateway, its `/ready` awaited) with a 40k-character history.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench._procs import child, free_port
from engine_pool.tiny_model import build_tiny_model
from loadgen.text import make_text_maker

MODEL = "tiny"


async def ttft(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], api: str = "chat") -> float:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True}
    path, first = "/v1/chat/completions", b"data: {"
    if api == "messages":
        path, first = "/v1/messages", b"event: content_block_delta"
        if messages and messages[0]["role"] == "system":
            body = {**body, "system": messages[0]["content"], "messages": messages[1:]}
    started = time.perf_counter()
    async with http.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(first):
                elapsed = time.perf_counter() - started
                await resp.read()
                return elapsed
    raise AssertionError("no content chunk")


def tool_round(shape: str, turn: int, args: str, result: str) -> list[dict[str, Any]]:
    """An agent's tool round: the assistant's call and its result, in the chat API's or the Messages API's shape."""
    call_id = f"call_{turn}"
    if shape == "chat-tools":
        call = {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": args}}
        return [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": result}]  # fmt: skip
    use = {"type": "tool_use", "id": call_id, "name": "read_file", "input": {"path": args}}
    done = {"type": "tool_result", "tool_use_id": call_id, "content": result}
    return [{"role": "assistant", "content": [use]}, {"role": "user", "content": [done]}]


def gateway_config(engine: str, model_dir: Path, port: int, cache_bytes: int | None) -> dict[str, Any]:
    cache: dict[str, Any] = {"tokenizers": {MODEL: str(model_dir)}}
    if cache_bytes is not None:
        cache["chat_prefix_cache_bytes"] = cache_bytes
    return {
        "server": {"host": "127.0.0.1", "port": port, "access_log": "off"},
        "routing": {"policy": "cache-aware"},
        "cache": cache,
        "engines": [{"url": engine, "model": MODEL}],
    }


async def run_turns(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, float]]:
    text = make_text_maker(None)
    messages: list[dict[str, Any]] = [{"role": "system", "content": text.text("system", args.turn_chars // 4)}]
    api = "messages" if args.shape == "messages-tools" else "chat"
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for turn in range(args.turns):
            if args.shape == "chat" or turn == 0:
                messages.append({"role": "user", "content": text.text(f"user-{turn}", args.turn_chars // 4)})
            names = list(urls)
            names = names[turn % len(names) :] + names[: turn % len(names)]
            times = {name: await ttft(http, urls[name], messages, api) for name in names}
            chars = len(json.dumps(messages))
            rows.append({"turn": turn + 1, "chars": chars, **{k: v * 1e3 for k, v in times.items()}})
            if args.shape == "chat":
                messages.append({"role": "assistant", "content": text.text(f"answer-{turn}", args.turn_chars // 4)})
            else:
                arguments = json.dumps({"path": f"src/module_{turn}.py", "why": text.text(f"why-{turn}", 40)})
                messages += tool_round(args.shape, turn, arguments, text.text(f"result-{turn}", args.turn_chars // 2))
    return rows


async def first_request(url: str, engine: str, args: argparse.Namespace) -> float:
    text = make_text_maker(None)
    messages = [{"role": "system", "content": text.text("first", 10_000)}, {"role": "user", "content": "go"}]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        gw = await ttft(http, url, messages)
        direct = await ttft(http, engine, messages)
    return (gw - direct) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--turn-chars", type=int, default=5000, help="characters per user message and per answer")
    ap.add_argument("--model-dir", default=".kvgate/tiny-model")
    ap.add_argument("--shape", choices=["chat", "chat-tools", "messages-tools"], default="chat")
    args = ap.parse_args(argv)
    model_dir = build_tiny_model(Path(args.model_dir)).resolve()
    port = free_port()
    engine = f"http://127.0.0.1:{port}"
    sim = ["sim-engine", "--port", str(port), "--model", MODEL, "--instant", "--max-model-len", "10000000"]
    with tempfile.TemporaryDirectory() as tmp, child(sim, engine + "/health"):
        urls = {"engine": engine}
        ports = {"incremental": free_port(), "full": free_port()}
        configs = {"incremental": None, "full": 0}
        paths = {}
        for name, gw_port in ports.items():
            paths[name] = Path(tmp) / f"{name}.yaml"
            paths[name].write_text(yaml.safe_dump(gateway_config(engine, model_dir, gw_port, configs[name])))
        with child(["serve", "-c", str(paths["incremental"])], f"http://127.0.0.1:{ports['incremental']}/ready"):
            urls["incremental"] = f"http://127.0.0.1:{ports['incremental']}"
            first = asyncio.run(first_request(urls["incremental"], engine, args))
            with child(["serve", "-c", str(paths["full"])], f"http://127.0.0.1:{ports['full']}/ready"):
                urls["full"] = f"http://127.0.0.1:{ports['full']}"
                rows = asyncio.run(run_turns(urls, args))
    print(f"shape: {args.shape}")
    print("| turn | history (JSON chars) | engine TTFT ms | added, incremental ms | added, full ms |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        inc, full = r["incremental"] - r["engine"], r["full"] - r["engine"]
        print(f"| {r['turn']} | {r['chars']:,} | {r['engine']:.1f} | {inc:.1f} | {full:.1f} |")
    last = rows[-5:]
    for name in ("incremental", "full"):
        added = statistics.median(r[name] - r["engine"] for r in last)
        chars = last[-1]["chars"]
        worst = max(r[name] - r["engine"] for r in last)
        print(f"{name}: added TTFT over the last {len(last)} turns (~{chars:,} chars): median {added:.1f} ms, "
              f"max {worst:.1f} ms; max over the run {max(r[name] - r['engine'] for r in rows):.1f} ms")  # fmt: skip
    print(f"first request after start (40k-char prompt): added {first:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
