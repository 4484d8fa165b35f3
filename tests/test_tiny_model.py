"""The tiny model build: layout, determinism, idempotence, tokenizer and chat template through `transformers`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_pool import tiny_model
from engine_pool.tiny_model import BOS, EOT, MODEL_FILES, STAMP_FILE, build_tiny_model, is_complete

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about the river near the station."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _mtimes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


def test_build_writes_complete_stamped_model(model_dir: Path) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == sorted([*MODEL_FILES, STAMP_FILE])
    stamp = json.loads((model_dir / STAMP_FILE).read_text())
    assert stamp["build_version"] == tiny_model.BUILD_VERSION
    assert stamp["seed"] == 0
    assert is_complete(model_dir, seed=0)
    assert not is_complete(model_dir, seed=1)
    # no temporary build directories are left beside the output
    assert [p.name for p in model_dir.parent.iterdir()] == ["model"]


def test_same_seed_gives_byte_identical_files(model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "again", seed=0)
    for name in [*MODEL_FILES, STAMP_FILE]:
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_second_build_is_a_no_op_and_a_stale_stamp_rebuilds(model_dir: Path, tmp_path: Path) -> None:
    before = _mtimes(model_dir)
    assert build_tiny_model(model_dir, seed=0) == model_dir
    assert _mtimes(model_dir) == before

    target = tmp_path / "copy"
    target.mkdir()
    for name in [*MODEL_FILES, STAMP_FILE]:
        (target / name).write_bytes((model_dir / name).read_bytes())
    (target / "model.safetensors").write_bytes(b"truncated")
    assert not is_complete(target, seed=0)
    build_tiny_model(target, seed=0)
    assert is_complete(target, seed=0)
    assert (target / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_config_values(model_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == 2048
    assert config.max_position_embeddings in (2048, 4096)


def test_weights_load_and_run(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert sum(p.numel() for p in model.parameters()) == 819_840
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, 2048)
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_bos(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 2048
    assert tok.bos_token == BOS and tok.eos_token == EOT
    text = "The engineer cached a block.\n\nNew line, odd bytes: ü 漢字 ∑"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
    # corpus words are single tokens or close to it: about one token per word on corpus-like text
    sample = "The quiet gardener planted a golden lantern by the sea."
    assert len(tok(sample, add_special_tokens=False)["input_ids"]) <= 2 * len(sample.split())


def test_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTell me about the river near the station.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tok(text, add_special_tokens=False)["input_ids"]
    assert list(ids).count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    for special in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert tok.convert_tokens_to_ids(special) in ids
    # OpenAI content parts render like the joined string
    parts: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    joined: list[dict[str, Any]] = [{"role": "user", "content": "a\nb"}]
    assert tok.apply_chat_template(parts, tokenize=False) == tok.apply_chat_template(joined, tokenize=False)


def test_shipped_data_is_small() -> None:
    corpus = tiny_model.corpus_text()
    assert 100_000 < len(corpus.encode()) < 300_000
    assert "{{- bos_token" in tiny_model.chat_template()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tiny_model.main([str(tmp_path / "m"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert is_complete(tmp_path / "m", seed=3)
