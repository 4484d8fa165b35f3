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

from loadgen.gatecfg import GateConfigError, pool_models, set_gate_text, set_model_key_text, write_config_text
from loadgen.model_shape import Model, load_model

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
    """The config with the recommended gate, and max_num_seqs on the named pool model (or the only one);
    GateConfigError for a pool of several models and no name."""
    text = set_gate_text(text, result.replica_max_concurrency)
    names = pool_models(text)
    if model is None and len(names) == 1:
        model = names[0]
    if model is None:
        if names:  # the plan is one model's: which of them is not guessed, and nothing is written
            raise GateConfigError(f"the pool has models {names}: give --pool-model (the one this plan is for)")
        return text
    return set_model_key_text(text, model, "max_num_seqs", result.max_num_seqs)
