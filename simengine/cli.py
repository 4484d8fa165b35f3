"""``kvgate sim-engine``: serve a simulated vLLM OpenAI server until SIGTERM / SIGINT.

Prints ``KV_EVENTS <port>`` (when KV events are on) and then ``LISTENING <port>`` on stdout once it accepts
connections, so a parent started with ``--port 0`` learns the ports. Runs on uvloop when it is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Coroutine
from typing import Any

from pydantic import ValidationError

from simengine.config import Faults, SimConfig
from simengine.kv_transfer import shared_storage_path
from simengine.server import run_sim_engine


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="kvgate sim-engine", description="Simulated vLLM OpenAI server.")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 = any free port (printed as LISTENING <port>)")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV capacity in blocks")
    p.add_argument("--cpu-blocks", type=int, default=d.cpu_blocks, help="KV offloading tier in blocks (0 = none)")
    p.add_argument("--cpu-load-us-per-token", type=float, default=d.cpu_load_us_per_token)
    p.add_argument(
        "--kv-transfer-config",
        type=json.loads,
        default=None,
        help="vLLM's flag: ExampleConnector's kv_connector_extra_config.shared_storage_path is the hand-over folder",
    )
    p.add_argument("--handover-us-per-token", type=float, default=d.handover_us_per_token)
    p.add_argument("--chunked-prefill-budget", type=int, default=d.chunked_prefill_budget)
    p.add_argument(
        "--hide-cache-config", action="store_true", help="publish no vllm:cache_config_info (capacity unknown)"
    )
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-waiting", type=int, default=d.max_waiting)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--overhead-ms", type=float, default=d.overhead_ms)
    p.add_argument("--prefill-us-per-token", type=float, default=d.prefill_us_per_token)
    p.add_argument("--decode-ms", type=float, default=d.decode_ms)
    p.add_argument("--decode-ms-per-seq", type=float, default=d.decode_ms_per_seq)
    p.add_argument("--instant", action="store_true", help="zero cost, no sleeps")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--kv-events-port", type=int, default=None, help="ZMQ PUB port for KV events (0 = any)")
    p.add_argument("--kv-events-topic", default=d.kv_events_topic)
    p.add_argument(
        "--kv-events-replay-port", type=int, default=None, help="replay ROUTER port (0 = any free port: printed)"
    )
    f = d.faults
    p.add_argument("--error-rate", type=float, default=f.error_rate)
    p.add_argument("--stall-s", type=float, default=f.stall_s)
    p.add_argument("--stall-rate", type=float, default=f.stall_rate)
    p.add_argument("--crash-after", type=int, default=f.crash_after)
    p.add_argument("--fail-health", action="store_true")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="LoRA adapters, as vLLM's flag")
    p.add_argument(
        "--runtime-lora", action="store_true", help="serve /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
    )
    p.add_argument("--lora-load-ms", type=float, default=d.lora_load_ms, help="how long a runtime load takes")
    return p


def config_from_args(ns: argparse.Namespace) -> SimConfig:
    faults = Faults(
        error_rate=ns.error_rate,
        stall_s=ns.stall_s,
        stall_rate=ns.stall_rate,
        crash_after=ns.crash_after,
        fail_health=ns.fail_health,
    )
    fields = {k: v for k, v in vars(ns).items() if k in SimConfig.model_fields and k not in ("faults", "lora_modules")}
    loras = dict(m.split("=", 1) for m in ns.lora_modules)
    if ns.kv_transfer_config is not None:
        fields["kv_transfer_dir"] = shared_storage_path(ns.kv_transfer_config)
    return SimConfig(**fields, faults=faults, lora_modules=loras)


async def serve(config: SimConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with run_sim_engine(config) as server:
        if server.kv_events_port is not None:
            print(f"KV_EVENTS {server.kv_events_port}", flush=True)
        if server.kv_events_replay_endpoint is not None:
            print(f"KV_EVENTS_REPLAY {server.kv_events_replay_endpoint.rsplit(':', 1)[1]}", flush=True)
        print(f"LISTENING {server.port}", flush=True)
        await stop.wait()
    return 0


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: int = uvloop.run(coro)
    return result


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config = config_from_args(ns)
    except ValidationError as exc:
        print(f"kvgate sim-engine: invalid option: {exc}")
        return 2
    return _run(serve(config))
