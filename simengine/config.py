"""Typed configuration of the simulated engine: cost model, capacity, KV events and injected faults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Faults(BaseModel):
    """Injected faults; set by flags at start and replaced at runtime through ``POST /sim/faults``.

    - ``error_rate``: probability that a request answers 500 (OpenAI-shaped) before any byte.
    - ``stall_s`` / ``stall_rate``: probability that a request hangs ``stall_s`` seconds before its first byte.
    - ``crash_after``: the process exits (``os._exit(1)``) when request number ``crash_after + 1`` starts, i.e. after
      N requests have started; 0 crashes on the first request.
    - ``fail_health``: ``GET /health`` answers 503.
    - ``cut_after_tokens``: a stream's connection is aborted (as when the engine process dies) after N tokens.
    - ``stall_after_tokens``: a stream goes silent for ``stall_s`` seconds after N tokens (engine alive).
    - ``cut_before_end``: a stream's connection is aborted after its answer's last event, before the stream's own
      last one (`data: [DONE]`, `message_stop`): the engine died as it finished.
    Draws come from the engine's fault RNG, seeded from ``SimConfig.seed``.
    """

    model_config = ConfigDict(extra="forbid")

    error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    stall_s: float = Field(default=0.0, ge=0.0)
    stall_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    crash_after: int | None = Field(default=None, ge=0)
    fail_health: bool = False
    cut_after_tokens: int | None = Field(default=None, ge=1)
    stall_after_tokens: int | None = Field(default=None, ge=1)
    cut_before_end: bool = False


class SimConfig(BaseModel):
    """Everything a simulated engine is started with (the CLI maps its flags onto this)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "sim-model"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)  # 0 = any free port
    # capacity
    block_size: int = Field(default=16, ge=1)
    num_blocks: int = Field(default=8192, ge=1)  # KV capacity in blocks (vLLM's num_gpu_blocks)
    # a CPU tier of this many blocks (vLLM's KV offloading; 0 = none): written through, loaded at the cost below
    cpu_blocks: int = Field(default=0, ge=0)
    # publish no vllm:cache_config_info (block size and capacity unknown to a router): another engine, an older
    # vLLM, a proxy in between
    hide_cache_config: bool = False
    # LoRA adapters (vLLM's --lora-modules name=path): listed by /v1/models with `parent`, accepted as `model`
    lora_modules: dict[str, str] = Field(default_factory=dict)
    # vLLM's runtime LoRA API (/v1/load_lora_adapter, /v1/unload_lora_adapter; VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    runtime_lora: bool = False
    lora_load_ms: float = Field(default=0.0, ge=0.0)  # how long a runtime load takes
    max_model_len: int = Field(default=8192, ge=2)
    max_num_seqs: int = Field(default=64, ge=1)  # concurrent running requests
    max_waiting: int = Field(default=10_000, ge=0)  # queued requests beyond this get 503
    default_max_tokens: int = Field(default=16, ge=1)
    # cost model: TTFT = queueing + overhead + uncached prompt tokens x prefill; ITL = decode + per-seq x running
    overhead_ms: float = Field(default=2.0, ge=0.0)
    prefill_us_per_token: float = Field(default=50.0, ge=0.0)
    cpu_load_us_per_token: float = Field(default=10.0, ge=0.0)  # loading a CPU-tier block back, per token
    # disaggregated serving: the folder of the shared-storage KV connector (vLLM's ExampleConnector), and the cost
    # of loading a handed-over token from it
    kv_transfer_dir: str | None = None
    handover_us_per_token: float = Field(default=5.0, ge=0.0)
    # prefill interference (vLLM's chunked prefill: prompt chunks share each step with the running decodes): while
    # prompts are being computed, every decode step also costs min(their tokens, this budget) x prefill_us_per_token;
    # 0 = off (each request on its own timer; the routing benchmark's setting)
    chunked_prefill_budget: int = Field(default=0, ge=0)
    decode_ms: float = Field(default=5.0, ge=0.0)
    decode_ms_per_seq: float = Field(default=0.1, ge=0.0)
    instant: bool = False  # every cost zero and no sleeps at all (gateway overhead measurements)
    # how a stream is cut into events: tokens per event (vLLM's --stream-interval), and the assistant role sent
    # with the first token instead of in an opening event of its own (other OpenAI-compatible servers)
    stream_interval: int = Field(default=1, ge=1)
    role_in_first_token: bool = False
    # headers of the engine's own on every answer (an OpenAI-compatible server's rate limits, timings, ...)
    response_headers: dict[str, str] = Field(default_factory=dict)
    # vLLM's `system_fingerprint` (its default --fingerprint-mode full always sets one; None: mode none): on a whole
    # answer; in a stream on the usage event when the request asked for usage, else on the finish event
    system_fingerprint: str | None = None
    seed: int = 0
    # KV events: None = off, 0 = any free port
    kv_events_port: int | None = Field(default=None, ge=0, le=65535)
    kv_events_topic: str = "kv-events"
    # vLLM's replay ROUTER (`replay_endpoint`): the last 10,000 batches on request; None = off, 0 = any free port
    kv_events_replay_port: int | None = Field(default=None, ge=0, le=65535)
    faults: Faults = Field(default_factory=Faults)
