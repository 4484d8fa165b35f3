"""A model's shape from its HF `config.json`, as `kvgate plan` needs it: layers, heads, KV heads and head dim (GQA,
MLA latents, sliding windows), MoE experts (the shared expert counted as read per token), and hybrid models' layer
mix: which layers hold KV per token and which (linear attention, Mamba) a constant state per sequence. The
arithmetic is in `loadgen.plan`. Reading a config is O(layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def load_model(path: str) -> Model:
    """The model of a directory or config.json; ValueError (naming the file) when it cannot be read or used."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        return Model.from_config(json.loads(p.read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot use the model config {p}: {exc}") from exc


def _max_context(cfg: dict[str, Any]) -> int | None:
    """max_position_embeddings, times a RoPE scaling factor (as vLLM derives its longest max_model_len)."""
    positions = cfg.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < 1:
        return None
    scaling = cfg.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(positions * factor) if isinstance(factor, int | float) and factor > 1 else positions
