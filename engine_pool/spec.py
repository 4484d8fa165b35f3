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

from policies.base import Role


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceAssignment(_Strict):
    """Where one replica runs: GPU ids (CUDA_VISIBLE_DEVICES) or the CPU cores it runs on (CPU): its processes are
    pinned to them at launch and vLLM's OpenMP threads bind to them (VLLM_CPU_OMP_THREADS_BIND)."""

    cuda_visible_devices: str | None = Field(
        None, description='GPU only: CUDA_VISIBLE_DEVICES of the replica, e.g. "0" or "2,3"; None = inherited'
    )
    cpu_bind: str | None = Field(
        None,
        description='CPU only: cores the replica is pinned to and VLLM_CPU_OMP_THREADS_BIND ("0", "0-3", "0,2"); '
        '"nobind" = not pinned',
    )

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
    interval_s: float = Field(2.0, gt=0, description="seconds between GET /health probes of a ready replica")
    timeout_s: float = Field(
        5.0, gt=0, description="deadline (seconds) of each /health probe, the start-up probes included"
    )
    failures: int = Field(
        3,
        ge=1,
        description="consecutive failed probes that mark a ready replica hung (killed, restarted); one failure takes "
        "it out of routing",
    )


class RestartConfig(_Strict):
    backoff_base_s: float = Field(
        1.0,
        gt=0,
        description="seconds before restart attempt k after a failure: min(base * 2**(k-1), backoff_max_s)",
    )
    backoff_max_s: float = Field(60.0, gt=0, description="longest delay (seconds) before a restart attempt")
    crash_loop_window_s: float = Field(
        300.0, gt=0, description="seconds over which failures are counted against crash_loop_limit"
    )
    crash_loop_limit: int = Field(
        5, ge=1, description='this many failures inside crash_loop_window_s -> state "failed", no more restarts'
    )


class DegradationRule(_Strict):
    """Restart a replica (one at a time, never below N-1 ready) when, over the last `window_s`, its engine-reported
    mean time to first token exceeds `ttft_mean_max_s`, or its share of 5xx answers exceeds `error_rate_max`
    (with at least `min_requests` answers), or its KV cache free fraction never rose above `kv_free_min`."""

    window_s: float = Field(120.0, gt=0, description="span (seconds) of the recent samples each check judges")
    check_interval_s: float = Field(
        5.0, gt=0, description="seconds between samples (engine metrics, attempt counts) of each ready replica"
    )
    ttft_mean_max_s: float | None = Field(
        None,
        gt=0,
        description="restart when the engine's mean time to first token (seconds) over the window exceeds "
        "this; None = not checked",
    )
    error_rate_max: float | None = Field(
        None,
        gt=0,
        le=1,
        description="restart when failed attempts (connect, reset, timeout, 5xx) / all attempts in the window exceed "
        "this; None = not checked",
    )
    min_requests: int = Field(20, ge=1, description="fewest attempts in the window before error_rate_max is checked")
    kv_free_min: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="restart when the KV cache free fraction stayed below this in every sample of the window; "
        "None = not checked",
    )
    cooldown_s: float = Field(
        600.0, ge=0, description="at least this long (seconds) between two automatic restarts of one replica"
    )


class ModelPoolConfig(_Strict):
    name: str = Field(
        min_length=1,
        description='served model name (what clients send as "model"), unless `serves` says otherwise; replica ids '
        "are <name>-<index>",
    )
    serves: str | None = Field(
        None,
        description="the model name clients send, when several groups serve one model (a prefill and a decode "
        "group): each group has its own `name`; None = `name`",
    )
    role: Role = Field(
        "both",
        description="both = answers whole requests; prefill = computes prompts' KV for decode replicas to load "
        "(disaggregated serving); decode = answers requests, loading the KV a prefill replica computed",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="vLLM's --otlp-traces-endpoint (e.g. http://otel-collector:4317): the engine's own spans, joined "
        "to the gateway's trace by the traceparent kvgate sends (tracing.otlp_endpoint)",
    )
    kv_transfer_config: dict[str, object] | None = Field(
        None,
        description="vLLM's --kv-transfer-config (the KV connector of disaggregated serving), e.g. "
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both"} on GPUs or {"kv_connector": "ExampleConnector", '
        '"kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": "/shared/kv"}}; the simulated '
        "engine reads ExampleConnector's shared_storage_path",
    )
    model: str | None = Field(
        None,
        description="vllm: model directory or Hugging Face id; None = the tiny model built under pool.model_dir "
        "(unused by sim)",
    )
    kind: Literal["vllm", "sim"] = Field(
        "vllm", description="vllm = vLLM's OpenAI server; sim = kvgate's simulated engine (tests, benchmarks)"
    )
    replicas: int = Field(1, ge=0, description="replicas launched at start (at most pool.max_replicas)")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="vllm: device to serve on; auto = gpu when nvidia-smi sees one and vLLM is not the CPU build "
        "(KVGATE_DEVICE overrides)",
    )
    devices: list[DeviceAssignment] = Field(
        default_factory=list,
        description="replica i runs on devices[i % len(devices)]; empty = unpinned, CUDA_VISIBLE_DEVICES inherited",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vllm on GPU: --tensor-parallel-size (ignored on CPU)")
    data_parallel_size: int = Field(
        1, ge=1, le=64,
        description="vllm: --data-parallel-size, engine cores behind each replica's one URL, each with its own KV "
        "cache (and kv_cache_bytes); routed as one replica per rank, the rank sent as X-data-parallel-rank",
    )  # fmt: skip
    kv_cache_bytes: int | None = Field(
        None, gt=0, description="vllm: KV cache size per replica in bytes (--kv-cache-memory-bytes); None = vLLM's"
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm on GPU: --gpu-memory-utilization (fraction of GPU memory); None = vLLM's"
    )
    block_size: int | None = Field(
        None, gt=0, description="tokens per KV block (--block-size; vllm on CPU: a multiple of 32); None = engine's"
    )
    prefix_caching: bool = Field(
        True, description="vllm: automatic prefix caching (--enable-prefix-caching / --no-enable-prefix-caching)"
    )
    kv_events: bool = Field(
        False, description="publish KV events on a per-replica port (the cache-aware index subscribes)"
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description="engine batch slots (--max-num-seqs), also used for routing's queueing estimate; None = engine's",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="engine context length in tokens (--max-model-len); None = the model's"
    )
    dtype: str = Field("auto", description="vllm: --dtype; auto = the model config's")
    enforce_eager: bool = Field(True, description="vllm: --enforce-eager (no graph compilation, faster start-up)")
    tokenizer: str | None = Field(
        None,
        description='for the gateway\'s prefix index: local HF dir, "sim" or "chars"; None = the model dir (vllm) '
        'or "sim"',
    )
    max_concurrency: int | None = Field(
        None, ge=1, description="gateway-side gate per replica; None = admission's default gate, if any"
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters to load: name -> local path (vLLM's --enable-lora --lora-modules name=path); a "
        "request for an adapter's name goes only to replicas that list it",
    )
    dynamic_lora: bool = Field(
        False,
        description="vllm: serve vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, --enable-lora even "
        "without lora_modules): the gateway loads the adapters of models.adapters on demand",
    )
    max_loras: int | None = Field(None, ge=1, description="adapters resident at once per replica (vLLM --max-loras)")
    max_lora_rank: int | None = Field(None, ge=1, description="largest adapter rank (vLLM --max-lora-rank)")
    runner: Literal["generate", "pooling"] = Field(
        "generate",
        description="vllm: --runner; pooling = an embedding, classification or reward model (warmed up at its own "
        "endpoint, see `convert`)",
    )
    convert: Literal["embed", "classify", "reward"] | None = Field(
        None,
        description="vllm: --convert, a generative checkpoint served as a pooling model; the warm-up asks "
        "/v1/embeddings (embed, or a pooling runner without convert), /classify or /pooling (reward)",
    )
    extra_args: list[str] = Field(default_factory=list, description="arguments appended to the engine's command line")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables for the engine processes (win over inherited ones)"
    )
    startup_deadline_s: float = Field(
        600.0,
        gt=0,
        description="launch -> /health 200 and warm-up done must take at most this (seconds), else killed and "
        "restarted with backoff",
    )
    startup_stall_s: float | None = Field(
        120.0,
        gt=0,
        description="a starting replica using under 1 CPU-second in this many seconds is stalled: killed and "
        "restarted with backoff; None = only the deadline",
    )
    warmup_prompt: str = Field(
        "Hello", description="prompt of the warm-up completion a replica must answer before it is ready"
    )
    warmup_max_tokens: int = Field(4, ge=1, description="max_tokens of the warm-up completion")
    liveness: LivenessConfig = Field(
        default_factory=LivenessConfig, description="health probes of ready replicas, and when they count as hung"
    )
    restart: RestartConfig = Field(
        default_factory=RestartConfig, description="backoff and crash-loop limit of restarts after failures"
    )
    drain_grace_s: float = Field(
        30.0, ge=0, description="seconds a drained replica's in-flight requests may take before it is stopped"
    )
    stop_timeout_s: float = Field(15.0, gt=0, description="seconds from SIGTERM to SIGKILL of the process group")
    degradation: DegradationRule | None = Field(
        None, description="restart a replica automatically when its service degrades; None = never"
    )

    @model_validator(mode="after")
    def _check(self) -> ModelPoolConfig:
        if self.kind == "vllm" and self.device == "cpu" and self.block_size is not None and self.block_size % 32:
            raise ValueError("block_size must be a multiple of 32 on CPU")
        if self.role != "both" and self.kv_transfer_config is None:
            raise ValueError(f"role {self.role} needs kv_transfer_config (the KV connector that hands KV over)")
        return self

    @property
    def warmup_path(self) -> str:
        """Where the warm-up inference goes: a completion, or the pooling model's own endpoint."""
        if self.runner == "generate" and self.convert is None:
            return "/v1/completions"
        return {"classify": "/classify", "reward": "/pooling"}.get(self.convert or "embed", "/v1/embeddings")

    @property
    def served(self) -> str:
        """The model name clients send."""
        return self.serves or self.name

    def device_for(self, index: int) -> DeviceAssignment:
        return self.devices[index % len(self.devices)] if self.devices else DeviceAssignment()


class PoolConfig(_Strict):
    models: list[ModelPoolConfig] = Field(
        default_factory=list, description="one entry per served model: its engine, replicas and supervision"
    )
    host: str = Field("127.0.0.1", description="address the engines listen on and the gateway connects to")
    log_dir: str = Field(".kvgate/logs", description="one rotating log per replica: <log_dir>/<replica id>.log")
    log_max_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="size in bytes at which a replica's log rotates")
    log_backups: int = Field(
        3, ge=0, description="rotated logs kept per replica (<id>.log.1 ...); 0 = the log is truncated instead"
    )
    model_dir: str = Field(
        ".kvgate/tiny-model", description="where the tiny model is built (or reused) when a vllm model has no `model`"
    )
    cache_root: str | None = Field(
        ".kvgate/vllm-cache",
        description="VLLM_CACHE_ROOT of the vLLM engines; None = left as inherited (else vLLM's default)",
    )
    max_replicas: int = Field(64, ge=1, description="most replicas per model, in the config and in scale requests")

    @model_validator(mode="after")
    def _unique(self) -> PoolConfig:
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError("pool.models: names must be unique")
        roles: dict[str, set[str]] = {}
        for m in self.models:
            roles.setdefault(m.served, set()).add(m.role)
        for served, found in roles.items():
            if "prefill" in found and not found - {"prefill"}:
                raise ValueError(f"pool.models: {served} has prefill replicas but none to decode on")
        for m in self.models:
            if m.replicas > self.max_replicas:
                raise ValueError(f"pool.models[{m.name}].replicas exceeds max_replicas {self.max_replicas}")
        return self
