"""`kvgate plan`: how many sequences fit and how fast they can decode, from first principles, before any traffic.

From a model's HF `config.json`, a dtype, a target context and a device description:
- weights = parameters x bytes per weight (dense; MoE: every expert is resident, only `experts_per_tok` and the
  shared expert are read per token), split over `tp` devices;
- KV bytes per token = attention layers x 2 (K and V) x KV heads x head dim x KV bytes per element (GQA: KV heads,
  not query heads; MLA: one latent of kv_lora_rank + qk_rope_head_dim per layer instead of K and V); per sequence at
  the target context (sliding-window layers hold at most their window), split over min(`tp`, KV heads);
- hybrid models (`layer_types` / `full_attention_interval` / `layers_block_type` / `hybrid_override_pattern` naming
  linear-attention or Mamba layers): only the attention layers hold KV per token; each linear-attention (Gated
  DeltaNet) or Mamba layer holds a constant state per sequence (its recurrent state plus the convolution's last
  kernel-1 inputs), which vLLM's hybrid allocator keeps in pages of the same pool: it counts in a sequence's blocks,
  split over `tp` (vLLM shards the linear-attention and Mamba heads over every rank);
- KV budget per device = memory x utilization - weights per device - engine reserve; KV blocks = budget / (block
  size x KV bytes per token per device) (what vLLM reports as num_gpu_blocks); sequences that fit = blocks /
  blocks per sequence (vLLM allocates whole blocks: ceil(KV per sequence / block bytes));
- decode is bandwidth-bound: each step reads the active weights once plus each running sequence's KV, so a step at
  batch B takes (active weight bytes + B x KV bytes per sequence) / bandwidth (per device), B tokens per step;
- prefill is compute-bound: 2 x active parameters FLOPs per token; tensor parallelism adds two all-reduces of the
  hidden state per layer and token, 2 (tp - 1) / tp of it crossing the interconnect.
The predicted knee is the concurrency where KV runs out (sequences that fit) or the engine's batch is full (256,
the largest `max_num_seqs` recommended), whichever comes first, and the recommendation is `max_num_seqs` = that
and `admission.replica_max_concurrency` = that (a gate above the batch the engine runs would only queue inside it);
the aggregate decode is at that batch. When not one sequence fits (the weights leave no KV budget, or the context
needs more than it) there is no plan: a ValueError saying by how much. With `devices` the deployment
holds devices // tp replicas: the pool's sequences and aggregate decode are the replica's times that. Device
figures in `DEVICES` are nominal (datasheet memory and bandwidth, dense bf16 TFLOPS) and every one can be
overridden. Pure arithmetic:
O(1), no engine involved.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadgen.gatecfg import GateConfigError, pool_models, set_gate_text, set_model_key_text, write_config_text

GIB = 1024**3
MAX_NUM_SEQS = 256  # the largest max_num_seqs recommended (vLLM's default on a GPU)
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True, slots=True)
class Device:
    memory_gib: float
    bandwidth_gbs: float  # HBM / memory bandwidth, GB/s (1e9)
    tflops: float  # dense bf16, TFLOP/s
    interconnect_gbs: float = 0.0  # per device, between tensor-parallel ranks


DEVICES: dict[str, Device] = {  # nominal datasheet figures
    "h100-sxm": Device(80, 3350, 989, 450),
    "h200": Device(141, 4800, 989, 450),
    "a100-80g": Device(80, 2039, 312, 300),
    "l40s": Device(48, 864, 362, 32),
    "cpu": Device(24, 40, 1, 0),  # these machines: a sizing sketch, not a datasheet
}


@dataclass(frozen=True, slots=True)
class Model:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    experts: int = 0  # 0: dense
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    kv_latent: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim per layer; 0: ordinary attention
    sliding_window: int | None = None
    sliding_layers: int = 0  # layers that hold at most `sliding_window` tokens
    shared_expert_intermediate: int = 0  # MoE: the shared expert(s), read for every token
    kv_layers: int | None = None  # layers holding KV per token (hybrid models: the attention ones); None: all
    state_layers: int = 0  # linear-attention or Mamba layers
    state_layer_params: int = 0  # parameters of one such layer's mixer
    state_elems: int = 0  # the constant state per sequence of one such layer
    max_context: int | None = None  # max_position_embeddings: the longest context vLLM serves it with

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Model:
        """ValueError naming the key for a config vLLM could not load (a missing, null or non-positive count)."""
        if not isinstance(cfg, dict) or not isinstance(cfg.get("text_config", {}), dict):
            raise ValueError("the model config is not a JSON object (a config.json of HF layout)")
        cfg = {**cfg, **cfg.get("text_config", {})}  # multimodal configs keep the language model inside
        heads, hidden = _count(cfg, "num_attention_heads"), _count(cfg, "hidden_size")
        layers = _count(cfg, "num_hidden_layers")
        kv_heads = _count(cfg, "num_key_value_heads", heads)  # absent or null: HF's default, full multi-head
        if heads % kv_heads:  # GQA: each KV head serves a whole group of query heads
            raise ValueError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types") or []
        sliding = sum(1 for t in layer_types if t == "sliding_attention") if layer_types else (layers if window else 0)
        hybrid = _hybrid(cfg, layers)
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        expert_intermediate = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        shared = shared or int(cfg.get("n_shared_experts") or 0) * expert_intermediate
        latent = 0
        if cfg.get("kv_lora_rank"):  # MLA: one compressed latent and the rope part, per layer and token
            latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return cls(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=_count(cfg, "head_dim", hidden // heads),
            intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
            vocab=_count(cfg, "vocab_size"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            expert_intermediate=expert_intermediate,
            kv_latent=latent,
            sliding_window=int(window) if window else None,
            sliding_layers=sliding if window else 0,
            shared_expert_intermediate=shared if experts else 0,
            max_context=_max_context(cfg),
            **hybrid,
        )

    def params(self) -> tuple[float, float]:
        """(total, active per token) parameters: embeddings, attention, MLP or experts; norms are negligible."""
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        if self.experts:
            expert = 3 * self.hidden * self.expert_intermediate
            shared = 3 * self.hidden * self.shared_expert_intermediate
            total_mlp, active_mlp = self.experts * expert + shared, max(1, self.experts_per_tok) * expert + shared
        else:
            total_mlp = active_mlp = 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down
        mixers = self.attention_layers * attn + self.state_layers * self.state_layer_params
        return embed + mixers + self.layers * total_mlp, embed + mixers + self.layers * active_mlp

    @property
    def attention_layers(self) -> int:
        return self.layers if self.kv_layers is None else self.kv_layers

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        per_layer = self.kv_latent if self.kv_latent else 2 * self.kv_heads * self.head_dim
        return self.attention_layers * per_layer * kv_bytes

    def kv_bytes_per_sequence(self, context: int, kv_bytes: float) -> float:
        """KV at `context` tokens plus the linear-attention and Mamba layers' constant state."""
        per_layer_token = (self.kv_latent if self.kv_latent else 2 * self.kv_heads * self.head_dim) * kv_bytes
        full = self.attention_layers - self.sliding_layers
        windowed = min(context, self.sliding_window or context)
        return per_layer_token * (full * context + self.sliding_layers * windowed) + self.state_bytes(kv_bytes)

    def state_bytes(self, kv_bytes: float) -> float:
        """The linear-attention and Mamba layers' constant state of one sequence (0 for attention-only models)."""
        return self.state_layers * self.state_elems * kv_bytes


def _count(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """cfg[key] as a positive integer; `default` when absent or null (None: the key is required)."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ValueError(f"the model config has no {key} (absent or null)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} is {value!r}: expected a positive integer")
    return value


_ATTENTION = {"full_attention", "attention", "sliding_attention", "*"}
_LINEAR = {"linear_attention"}
_MAMBA = {"mamba", "mamba2", "M"}


def _hybrid(cfg: dict[str, Any], layers: int) -> dict[str, int]:
    """The Model fields of a hybrid model's layer mix ({} for a model of attention layers only): the attention
    layers, the state layers, one state layer's parameters and its state per sequence. Layer kinds come from
    `layer_types` (Qwen3-Next, Qwen3.5), `full_attention_interval` (every Nth layer is attention),
    `layers_block_type` (Granite 4, Jamba) or `hybrid_override_pattern` (Nemotron-H: M, *, - and E per layer)."""
    kinds: list[str] = list(cfg.get("layer_types") or cfg.get("layers_block_type") or "")
    kinds = kinds or list(cfg.get("hybrid_override_pattern") or "")
    if kinds and len(kinds) != layers:  # a kind per layer, or the layer counts below mean nothing
        key = next(k for k in ("layer_types", "layers_block_type", "hybrid_override_pattern") if cfg.get(k))
        raise ValueError(f"{key} names {len(kinds)} layers, num_hidden_layers is {layers}")
    if not kinds and cfg.get("full_attention_interval"):
        every = _count(cfg, "full_attention_interval")
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    linear, mamba = sum(k in _LINEAR for k in kinds), sum(k in _MAMBA for k in kinds)
    if not linear and not mamba:
        return {}
    hidden = int(cfg["hidden_size"])
    if linear:  # Gated DeltaNet: a (value heads x key dim x value dim) state; conv over q, k and v
        k_heads, v_heads = _count(cfg, "linear_num_key_heads"), _count(cfg, "linear_num_value_heads")
        k_dim, v_dim = _count(cfg, "linear_key_head_dim"), _count(cfg, "linear_value_head_dim")
        conv_width = 2 * k_heads * k_dim + v_heads * v_dim
        state = v_heads * k_dim * v_dim + (int(cfg.get("linear_conv_kernel_dim") or 4) - 1) * conv_width
        params = hidden * (conv_width + v_heads * v_dim) + v_heads * v_dim * hidden  # in (q, k, v, z), out
    else:  # Mamba 2: heads x head dim x state size; conv over x, B and C
        d_state = int(cfg.get("ssm_state_size") or cfg.get("mamba_d_state") or 128)
        inner = int(cfg.get("mamba_expand") or 2) * hidden
        heads = int(
            cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads") or inner // int(cfg.get("mamba_head_dim") or 64)
        )
        groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1)
        conv_width = inner + 2 * groups * d_state
        state = (
            heads * (inner // heads) * d_state
            + (int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4) - 1) * conv_width
        )
        params = hidden * (inner + conv_width + heads) + inner * hidden  # in (z, x, B, C, dt), out
    attention = sum(k in _ATTENTION for k in kinds)
    return {"kv_layers": attention, "state_layers": linear + mamba, "state_layer_params": params, "state_elems": state}


@dataclass(frozen=True, slots=True)
class Plan:
    context: int  # tokens per sequence the plan is for (prompt + output)
    block_size: int
    replicas: int  # devices // tp: the figures below are per replica, the pool_ ones for all of them
    reserve_gib_per_device: float
    weights_gib_per_device: float
    kv_bytes_per_token: float  # per device
    kv_gib_per_sequence: float  # per device, at the target context
    kv_budget_gib_per_device: float
    sequences_that_fit: int
    kv_blocks: int
    decode_tok_s_per_sequence: float  # at batch 1
    decode_tok_s_aggregate: float  # at `concurrency` (or the knee)
    prefill_tok_s: float
    allreduce_ms_per_token: float
    predicted_knee: int
    max_num_seqs: int
    replica_max_concurrency: int
    pool_sequences_that_fit: int
    pool_decode_tok_s: float


def plan(
    model: Model,
    device: Device,
    *,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    context: int = 4096,
    concurrency: int | None = None,
    tp: int = 1,
    devices: int | None = None,
    utilization: float = 0.9,
    reserve_gib: float = 1.0,
    block_size: int = 16,
    kv_cache_bytes: int | None = None,
) -> Plan:
    """The plan for one replica spanning `tp` devices, and for the `devices // tp` replicas of `devices` (default:
    one replica); `kv_cache_bytes` fixes the KV budget per device (vLLM's --kv-cache-memory-bytes) instead of
    deriving it from memory."""
    _check_layout(model, context=context, tp=tp, utilization=utilization)
    _check_sizes(devices=devices, tp=tp, reserve_gib=reserve_gib, block_size=block_size, concurrency=concurrency,
                 kv_cache_bytes=kv_cache_bytes)  # fmt: skip
    replicas = devices // tp if devices is not None else 1
    wbytes, kbytes = BYTES[dtype], BYTES[kv_dtype or dtype]
    total, active = model.params()
    weights_dev = total * wbytes / tp
    # each device holds its share of the KV heads, one head at least (vLLM replicates them past tp = kv_heads); an
    # MLA latent is whole on every device; the linear-attention and Mamba state is split over tp, because vLLM
    # shards those layers' heads over every rank, whatever the attention layers' KV heads
    kv_split = min(tp, model.kv_heads) if not model.kv_latent else 1
    kv_tok = model.kv_bytes_per_token(kbytes) / kv_split
    state = model.state_bytes(kbytes)
    kv_seq = (model.kv_bytes_per_sequence(context, kbytes) - state) / kv_split + state / tp
    budget = kv_cache_bytes if kv_cache_bytes is not None else device.memory_gib * GIB * utilization - weights_dev
    budget -= 0 if kv_cache_bytes is not None else reserve_gib * GIB
    blocks = max(0, int(budget // (block_size * kv_tok))) if kv_tok else 0
    blocks_per_seq = math.ceil(kv_seq / (block_size * kv_tok)) if kv_tok else 0
    fit = blocks // blocks_per_seq if blocks_per_seq else 0
    if fit < 1:
        weights = None if kv_cache_bytes is not None else weights_dev
        raise ValueError(_does_not_fit(budget, blocks, blocks_per_seq * block_size * kv_tok, context, weights))
    batch = min(fit, MAX_NUM_SEQS)  # the engine runs at most max_num_seqs: the gate and the knee stop there too
    bandwidth = device.bandwidth_gbs * 1e9
    active_dev = active * wbytes / tp
    running = concurrency if concurrency is not None else batch
    aggregate = running * bandwidth / (active_dev + running * kv_seq / 2)  # sequences are half full on average
    allreduce = 2 * model.layers * model.hidden * wbytes * 2 * (tp - 1) / tp
    return Plan(
        context=context,
        block_size=block_size,
        replicas=replicas,
        reserve_gib_per_device=0.0 if kv_cache_bytes is not None else reserve_gib,
        weights_gib_per_device=weights_dev / GIB,
        kv_bytes_per_token=kv_tok,
        kv_gib_per_sequence=kv_seq / GIB,
        kv_budget_gib_per_device=budget / GIB,
        sequences_that_fit=fit,
        kv_blocks=blocks,
        decode_tok_s_per_sequence=bandwidth / (active_dev + kv_seq / 2),
        decode_tok_s_aggregate=aggregate,
        prefill_tok_s=device.tflops * 1e12 * tp / (2 * active),
        allreduce_ms_per_token=allreduce / (device.interconnect_gbs * 1e9) * 1e3 if device.interconnect_gbs else 0.0,
        predicted_knee=batch,
        max_num_seqs=batch,
        replica_max_concurrency=batch,
        pool_sequences_that_fit=fit * replicas,
        pool_decode_tok_s=aggregate * replicas,
    )


def load_model(path: str) -> Model:
    """The model of a directory or config.json; ValueError (naming the file) when it cannot be read or used."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        return Model.from_config(json.loads(p.read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot use the model config {p}: {exc}") from exc


def _device(args: argparse.Namespace) -> Device:
    """The preset with the figures given on the command line (absent: the preset's; zero or negative: an error)."""
    base = DEVICES[args.device]
    figures = {"memory_gib": base.memory_gib, "bandwidth_gbs": base.bandwidth_gbs, "tflops": base.tflops,
               "interconnect_gbs": base.interconnect_gbs}  # fmt: skip
    for name in figures:
        value = getattr(args, name)
        if value is not None and (value < 0 or (value == 0 and name != "interconnect_gbs")):
            raise ValueError(f"--{name.replace('_', '-')} {value:g}: must be positive")
        figures[name] = figures[name] if value is None else value
    return Device(**figures)


def table(result: Plan) -> str:
    rows = [
        ("weights per device", f"{result.weights_gib_per_device:.2f} GiB"),
        ("KV per token (per device)", f"{result.kv_bytes_per_token:,.0f} B"),
        ("KV per sequence at the context", f"{result.kv_gib_per_sequence * 1024:.1f} MiB"),
        ("engine and system reserve per device", f"{result.reserve_gib_per_device:.2f} GiB"),
        ("KV budget per device", f"{result.kv_budget_gib_per_device:.2f} GiB"),
        ("sequences that fit", f"{result.sequences_that_fit}"),
        ("KV blocks (vLLM num_gpu_blocks)", f"{result.kv_blocks}"),
        ("decode, one sequence", f"{result.decode_tok_s_per_sequence:,.0f} tok/s"),
        ("decode, aggregate", f"{result.decode_tok_s_aggregate:,.0f} tok/s"),
        ("prefill (compute-bound)", f"{result.prefill_tok_s:,.0f} tok/s"),
        ("TP all-reduce per token", f"{result.allreduce_ms_per_token:.3f} ms"),
        ("predicted knee (concurrency)", f"{result.predicted_knee}"),
        ("recommended max_num_seqs", f"{result.max_num_seqs}"),
        ("recommended admission.replica_max_concurrency", f"{result.replica_max_concurrency}"),
        (f"pool of {result.replicas} replica(s): sequences that fit", f"{result.pool_sequences_that_fit}"),
        (f"pool of {result.replicas} replica(s): decode, aggregate", f"{result.pool_decode_tok_s:,.0f} tok/s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _max_context(cfg: dict[str, Any]) -> int | None:
    """max_position_embeddings, times a RoPE scaling factor (as vLLM derives its longest max_model_len)."""
    positions = cfg.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < 1:
        return None
    scaling = cfg.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(positions * factor) if isinstance(factor, int | float) and factor > 1 else positions


def _check_sizes(
    *, devices: int | None, tp: int, reserve_gib: float, block_size: int, concurrency: int | None,
    kv_cache_bytes: int | None,
) -> None:  # fmt: skip
    """ValueError for a size no deployment has (the arithmetic would divide by it or go negative)."""
    if devices is not None and devices < tp:
        raise ValueError(f"{devices} device(s) cannot hold one replica of tensor-parallel size {tp}")
    if block_size < 1 or (concurrency is not None and concurrency < 1):
        raise ValueError("--block-size and --concurrency must be at least 1")
    if reserve_gib < 0 or (kv_cache_bytes is not None and kv_cache_bytes < 0):
        raise ValueError("--reserve-gib and --kv-cache-bytes cannot be negative")


def _does_not_fit(budget: float, blocks: int, seq_bytes: float, context: int, weights: float | None) -> str:
    """Why not one sequence fits, and by how much (`weights` None: the budget was given, not derived)."""
    need = f"one sequence of {context} tokens needs {_size(seq_bytes)} of KV per device"
    short = f"short by {_size(seq_bytes - budget)}"
    if budget <= 0 and weights is not None:
        return (
            f"the model does not fit: {_size(weights)} of weights per device leave a KV budget of "
            f"{_size(budget)}, and {need} ({short}; more devices (--tp), a smaller --dtype or a larger device)"
        )
    return (
        f"not one sequence fits: {need}, the KV budget holds {_size(budget)} ({blocks} blocks), {short} "
        "(a shorter --context, a smaller --kv-dtype or more --tp)"
    )


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB / 100 else f"{nbytes / 2**20:.2f} MiB"


def _check_layout(model: Model, *, context: int, tp: int, utilization: float) -> None:
    """ValueError for a plan vLLM would refuse to run."""
    if context < 1 or tp < 1 or not 0 < utilization <= 1:
        raise ValueError("--context and --tp must be at least 1, --gpu-memory-utilization in (0, 1]")
    if model.heads % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the model's {model.heads} attention heads")
    if not model.kv_latent and model.kv_heads % tp and tp % model.kv_heads:
        raise ValueError(f"tensor-parallel size {tp} and the model's {model.kv_heads} KV heads: neither divides")
    if model.max_context is not None and context > model.max_context:
        raise ValueError(f"--context {context} is past the model's max_position_embeddings ({model.max_context})")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate plan", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a model directory or its config.json (HF layout)")
    p.add_argument("--dtype", choices=sorted(BYTES), default="bf16", help="weights")
    p.add_argument("--kv-dtype", choices=sorted(BYTES), help="KV cache (default: the weights' dtype)")
    p.add_argument("--context", type=int, default=4096, help="target tokens per sequence (prompt + output)")
    p.add_argument("--concurrency", type=int, help="for the aggregate decode figure (default: the knee)")
    p.add_argument("--device", choices=sorted(DEVICES), default="h100-sxm", help="nominal figures, overridable")
    p.add_argument("--memory-gib", type=float)
    p.add_argument("--bandwidth-gbs", type=float)
    p.add_argument("--tflops", type=float)
    p.add_argument("--interconnect-gbs", type=float)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices per replica)")
    p.add_argument("--devices", type=int, help="devices of the deployment: devices // tp replicas (default: one)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve-gib", type=float, default=1.0, help="engine and system reserve per device")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, help="a fixed KV budget per device (vLLM --kv-cache-memory-bytes)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write-config", help="set admission.replica_max_concurrency (and the pool model's max_num_seqs) "
                   "in this kvgate YAML")  # fmt: skip
    p.add_argument("--pool-model", help="--write-config: the pool model to set max_num_seqs on (default: the only one)")
    args = p.parse_args(argv)
    try:
        device = _device(args)
        model = load_model(args.model)
    except (OSError, ValueError) as exc:
        print(f"kvgate plan: {exc}", file=sys.stderr)
        return 2
    try:
        result = plan(
            model, device, dtype=args.dtype, kv_dtype=args.kv_dtype, context=args.context,
            concurrency=args.concurrency, tp=args.tp, devices=args.devices, utilization=args.gpu_memory_utilization,
            reserve_gib=args.reserve_gib, block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        )  # fmt: skip
    except ValueError as exc:
        print(f"kvgate plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=2) if args.json else table(result))
    if args.write_config:
        try:
            write_config_text(args.write_config, lambda text: _configured(text, result, args.pool_model))
        except (GateConfigError, OSError) as exc:
            print(f"kvgate plan: cannot write {args.write_config}: {exc}", file=sys.stderr)
            return 1
    return 0 if math.isfinite(result.decode_tok_s_aggregate) else 1


def _configured(text: str, result: Plan, model: str | None) -> str:
    """The config with the recommended gate, and max_num_seqs on the named pool model (or the only one)."""
    text = set_gate_text(text, result.replica_max_concurrency)
    names = pool_models(text)
    if model is None and len(names) == 1:
        model = names[0]
    if model is None:
        if names:
            print(f"kvgate plan: the pool has models {names}: give --pool-model to set max_num_seqs", file=sys.stderr)
        return text
    return set_model_key_text(text, model, "max_num_seqs", result.max_num_seqs)
