"""Simulated vLLM OpenAI server for tests and benchmarks: tokenizer, prefix-cache model, KV events, HTTP server.

A package of its own: the product (gateway, engine_pool, policies) never imports it (import-linter checks), and it
imports nothing of the product; the gateway implements the simulator's documented tokenizer and vLLM's hashing on
its own side, and tests check both sides agree. `tokenize`, `cache` and `kv_events` import neither aiohttp nor the
server, so tests and benchmarks can use them cheaply; `run_sim_engine` and `SimServer` are loaded from
`simengine.server` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from simengine.config import Faults, SimConfig

if TYPE_CHECKING:
    from simengine.server import SimServer, run_sim_engine

__all__ = ["Faults", "SimConfig", "SimServer", "run_sim_engine"]


def __getattr__(name: str) -> Any:
    if name in ("SimServer", "run_sim_engine"):
        from simengine import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
