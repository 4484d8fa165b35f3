"""Build a tiny LoRA adapter for the tiny model (`engine_pool.tiny_model`), offline and deterministically.

What is built: a PEFT-format adapter (`adapter_config.json`, `adapter_model.safetensors`) of rank `rank` on every
layer's q_proj and v_proj, weights drawn from a seeded torch generator (A and B both non-zero, so the adapter
changes the model's output), float16 like the model, about 15 KB. vLLM serves it with `--enable-lora
--lora-modules name=DIR` or loads it at run time (`/v1/load_lora_adapter`). Rebuilding with the same seed and rank
gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine_pool.tiny_model import HIDDEN_SIZE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS

TARGETS = {"q_proj": (HIDDEN_SIZE, HIDDEN_SIZE), "v_proj": (HIDDEN_SIZE, HIDDEN_SIZE // NUM_HEADS * NUM_KV_HEADS)}


def build_tiny_lora(out_dir: Path, *, seed: int = 1, rank: int = 8) -> Path:
    """Write the adapter into `out_dir` (created); returns it. Needs torch and safetensors (the `cpu` extra)."""
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for proj, (fan_in, fan_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.05).to(torch.float16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.05).to(torch.float16)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": "kvgate-tiny-llama",
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate make-tiny-lora", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=1, help="weight seed (default 1): another seed, another adapter")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    args = parser.parse_args(argv)
    try:
        print(build_tiny_lora(args.dir, seed=args.seed, rank=args.rank))
    except (OSError, ImportError) as exc:
        print(f"kvgate make-tiny-lora: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
