"""The engine pool's configuration (`pool:` in the gateway config): which engines kvgate launches and supervises.

One `ModelPoolConfig` per served model: `replicas` copies of one engine, each a child process on its own loopback
port (and its own KV-events port when `kv_events` is on; both allocated at launch). Replica i takes
`devices[i % len(devices)]` (GPU ids or a CPU core binding). `kind: sim` launches the simulated engine instead of
vLLM with the same supervision (tests, benchmarks).

Example:

    pool:
      log_dir: .kvgate/logs
      models:
        - name: tiny                       # served model name (what clients send as "model")
          model: .kvgate/tiny-model        # model directory or Hugging Face id
          replicas: 2
          devices: [{cpu_bind: "0"}, {cpu_bind: "1"}]
          block_size: 32
          kv_cache_bytes: 67108864
          kv_events: true
          startup_deadline_s: 300
          degradation: {window_s: 120, ttft_mean_max_s: 2.0, error_rate_max: 0.2, kv_free_min: 0.02}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceAssignment(_Strict):
    """Where one replica runs: GPU ids (CUDA_VISIBLE_DEVICES) or the CPU cores it runs on (CPU): its processes are
    pinned to them at launch and vLLM's OpenMP threads bind to them (VLLM_CPU_OMP_THREADS_BIND)."""

    cuda_visible_devices: str | None = None  # "0", "2,3" (GPU)
    cpu_bind: str | None = None  # "0", "1", "0-3", "0,2", or "nobind" (CPU)

    @field_validator("cpu_bind")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_list(value)
        return value


def parse_cpu_list(text: str) -> frozenset[int] | None:
    """CPU ids of a `cpu_bind` value ("0", "1,3", "0-3", "0-1,4"); None for "nobind"/"auto" or an empty value.
    Raises ValueError on anything else."""
    text = text.strip()
    if text in ("", "nobind", "auto"):
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. '0', '0-3', '0,2')")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} (range {part!r} runs backwards)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


class LivenessConfig(_Strict):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(5.0, gt=0)
    failures: int = Field(3, ge=1)  # consecutive failed probes that make a ready replica "hung" -> restart


class RestartConfig(_Strict):
    backoff_base_s: float = Field(1.0, gt=0)  # delay before restart attempt k: min(base * 2**(k-1), max)
    backoff_max_s: float = Field(60.0, gt=0)
    crash_loop_window_s: float = Field(300.0, gt=0)
    crash_loop_limit: int = Field(5, ge=1)  # this many failures inside the window -> state "failed", no restart


class DegradationRule(_Strict):
    """Restart a replica (one at a time, never below N-1 ready) when, over the last `window_s`, its engine-reported
    mean time to first token exceeds `ttft_mean_max_s`, or its share of 5xx answers exceeds `error_rate_max`
    (with at least `min_requests` answers), or its KV cache free fraction never rose above `kv_free_min`."""

    window_s: float = Field(120.0, gt=0)
    check_interval_s: float = Field(5.0, gt=0)
    ttft_mean_max_s: float | None = Field(None, gt=0)
    error_rate_max: float | None = Field(None, gt=0, le=1)
    min_requests: int = Field(20, ge=1)
    kv_free_min: float | None = Field(None, gt=0, lt=1)
    cooldown_s: float = Field(600.0, ge=0)  # at least this long between two automatic restarts of one replica


class ModelPoolConfig(_Strict):
    name: str = Field(min_length=1)  # served model name
    model: str | None = None  # model dir or HF id (vllm); None = the tiny model built under pool.model_dir
    kind: Literal["vllm", "sim"] = "vllm"
    replicas: int = Field(1, ge=0)
    device: Literal["auto", "cpu", "gpu"] = "auto"
    devices: list[DeviceAssignment] = Field(default_factory=list)
    tensor_parallel_size: int = Field(1, ge=1)
    kv_cache_bytes: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    block_size: int | None = Field(None, gt=0)
    prefix_caching: bool = True
    kv_events: bool = False  # publish KV events on a per-replica port (the cache-aware index subscribes)
    max_num_seqs: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    dtype: str = "auto"
    enforce_eager: bool = True
    tokenizer: str | None = None  # for the gateway's prefix index; defaults to the model dir (vllm)
    max_concurrency: int | None = Field(None, ge=1)  # gateway-side gate per replica
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_deadline_s: float = Field(600.0, gt=0)  # launch -> /health 200 and warm-up done
    # while starting: less than 1 CPU-second used by the replica's processes in this many seconds -> stalled,
    # killed and restarted with backoff (None: only the deadline applies)
    startup_stall_s: float | None = Field(120.0, gt=0)
    warmup_prompt: str = "Hello"
    warmup_max_tokens: int = Field(4, ge=1)
    liveness: LivenessConfig = Field(default_factory=LivenessConfig)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    drain_grace_s: float = Field(30.0, ge=0)  # wait for in-flight requests before stopping a drained replica
    stop_timeout_s: float = Field(15.0, gt=0)  # SIGTERM -> SIGKILL of the process group
    degradation: DegradationRule | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelPoolConfig:
        if self.kind == "vllm" and self.device == "cpu" and self.block_size is not None and self.block_size % 32:
            raise ValueError("block_size must be a multiple of 32 on CPU")
        return self

    def device_for(self, index: int) -> DeviceAssignment:
        return self.devices[index % len(self.devices)] if self.devices else DeviceAssignment()


class PoolConfig(_Strict):
    models: list[ModelPoolConfig] = Field(default_factory=list)
    host: str = "127.0.0.1"  # engines listen on loopback
    log_dir: str = ".kvgate/logs"  # one rotating log per replica: <log_dir>/<replica id>.log
    log_max_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    log_backups: int = Field(3, ge=0)
    model_dir: str = ".kvgate/tiny-model"  # where the tiny model is built when a vllm model has no `model`
    cache_root: str | None = ".kvgate/vllm-cache"  # VLLM_CACHE_ROOT
    max_replicas: int = Field(64, ge=1)  # upper bound for scale requests (per model)

    @model_validator(mode="after")
    def _unique(self) -> PoolConfig:
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError("pool.models: served names must be unique")
        for m in self.models:
            if m.replicas > self.max_replicas:
                raise ValueError(f"pool.models[{m.name}].replicas exceeds max_replicas {self.max_replicas}")
        return self
