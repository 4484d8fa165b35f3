"""`kvgate plan` on literal model configs: parameter counts of well-known models, KV bytes per token for GQA, MLA
and sliding windows, the KV budget and blocks, and the CLI's table, JSON and config write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loadgen.model_shape import Model
from loadgen.plan import DEVICES, GIB, Device, main, plan

LLAMA3_8B = {
    "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip
MIXTRAL_8X7B = {
    "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip
TINY = {
    "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "vocab_size": 2048, "tie_word_embeddings": False,
}  # fmt: skip


def test_parameter_counts_match_the_published_sizes() -> None:
    total, active = Model.from_config(LLAMA3_8B).params()
    assert total == active and total == pytest.approx(8.03e9, rel=0.01)
    total, active = Model.from_config(MIXTRAL_8X7B).params()
    assert total == pytest.approx(46.7e9, rel=0.01) and active == pytest.approx(12.9e9, rel=0.01)


def test_kv_bytes_per_token_gqa_mla_and_sliding_windows() -> None:
    llama = Model.from_config(LLAMA3_8B)
    assert llama.kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2  # 128 KiB: KV heads, not query heads
    mla = Model.from_config({**LLAMA3_8B, "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert mla.kv_bytes_per_token(2) == 61 * 576 * 2  # one latent per layer, no separate K and V
    windowed = Model.from_config({**TINY, "sliding_window": 1024})
    assert windowed.kv_bytes_per_sequence(8192, 2) == windowed.kv_bytes_per_sequence(1024, 2)
    mixed = Model.from_config({**TINY, "sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"]})
    per_layer_token = 2 * 2 * 32 * 2
    assert mixed.kv_bytes_per_sequence(8192, 2) == per_layer_token * (8192 + 1024)


QWEN3_NEXT_80B = {  # Qwen3-Next-80B-A3B's config.json: 3 linear-attention (Gated DeltaNet) layers to 1 attention
    "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "intermediate_size": 5120, "vocab_size": 151936, "tie_word_embeddings": False, "full_attention_interval": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}  # fmt: skip


def test_a_hybrid_model_holds_kv_in_its_attention_layers_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    assert main([str(tmp_path), "--json", "--context", "4096", "--kv-cache-bytes", str(8 * GIB)]) == 0
    got = json.loads(capsys.readouterr().out)
    # 12 attention layers (every 4th) x K and V x 2 KV heads x 256 x 2 bytes, not 48 layers' worth
    kv_token = 12 * 2 * 2 * 256 * 2
    assert got["kv_bytes_per_token"] == kv_token == 24576
    # 36 Gated DeltaNet layers, each a 32 x 128 x 128 state and 3 inputs of the convolution over q, k and v
    state = 36 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2
    assert state == 39_518_208
    per_sequence = kv_token * 4096 + state
    assert got["kv_gib_per_sequence"] == pytest.approx(per_sequence / GIB)
    block = 16 * kv_token
    assert got["kv_blocks"] == 8 * GIB // block
    assert got["sequences_that_fit"] == got["kv_blocks"] // -(-per_sequence // block) == 61
    # counting every layer as attention would have planned 4 times the KV per token and under a third of the sequences
    dense = plan(Model.from_config({**QWEN3_NEXT_80B, "full_attention_interval": None}), DEVICES["h200"], context=4096,
                 kv_cache_bytes=8 * GIB)  # fmt: skip
    assert dense.kv_bytes_per_token == 4 * kv_token and dense.sequences_that_fit < got["sequences_that_fit"] / 2.5
    # the published sizes: 80B in total, about 3B active per token (10 routed experts and the shared one)
    total, active = Model.from_config(QWEN3_NEXT_80B).params()
    assert total == pytest.approx(80e9, rel=0.02)
    expert, embed = 3 * 2048 * 512, 2 * 151936 * 2048
    attention, linear = 2048 * 16 * 256 * 2 + 2048 * 2 * 256 * 2, 2048 * (2 * 16 * 128 + 2 * 32 * 128) + 32 * 128 * 2048
    assert active == embed + 12 * attention + 36 * linear + 48 * 11 * expert


def test_the_kv_budget_and_what_fits() -> None:
    # the tiny model with a fixed 64 MiB KV cache and 32-token blocks (what tests/test_cache_vllm.py checks against
    # vLLM's own num_gpu_blocks): 512 bytes per token
    p = plan(Model.from_config(TINY), DEVICES["cpu"], kv_cache_bytes=64 << 20, block_size=32, context=2048)
    assert p.kv_bytes_per_token == 512 and p.kv_blocks == 4096 and p.sequences_that_fit == 64
    # Llama 3 8B on one 80 GiB device at 90 %: about 15 GiB of weights, 56 GiB of KV at 128 KiB per token
    h100 = Device(80, 3350, 989, 450)
    p = plan(Model.from_config(LLAMA3_8B), h100, context=8192, reserve_gib=1.0)
    assert p.weights_gib_per_device == pytest.approx(14.96, abs=0.05)
    assert p.kv_budget_gib_per_device == pytest.approx(80 * 0.9 - 14.96 - 1.0, abs=0.05)
    assert p.sequences_that_fit == int(p.kv_budget_gib_per_device * GIB // (8192 * 131072))
    assert p.max_num_seqs == min(p.sequences_that_fit, 256) and p.predicted_knee == p.sequences_that_fit
    # decode at batch 1 is bounded by reading the weights once per token: bandwidth / weight bytes
    assert p.decode_tok_s_per_sequence < 3350e9 / (8.03e9 * 2)
    two = plan(Model.from_config(LLAMA3_8B), h100, context=8192, tp=2)
    assert two.weights_gib_per_device == pytest.approx(p.weights_gib_per_device / 2)
    assert two.sequences_that_fit > 2 * p.sequences_that_fit  # KV heads split too, and the weights left room
    assert two.allreduce_ms_per_token > 0 == p.allreduce_ms_per_token


def test_the_cli_prints_json_and_writes_the_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("server:\n  port: 9000  # keep\n")
    argv = [str(tmp_path), "--device", "cpu", "--kv-cache-bytes", str(64 << 20), "--block-size", "32"]
    assert main([*argv, "--context", "2048", "--json", "--write-config", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_blocks"] == 4096 and out["replica_max_concurrency"] == 64
    assert yaml.safe_load(cfg.read_text()) == {"server": {"port": 9000}, "admission": {"replica_max_concurrency": 64}}
    assert "# keep" in cfg.read_text()
    assert main([str(tmp_path / "missing")]) == 2


def test_the_published_rules_of_thumb() -> None:
    # a Llama-3-8B shape (32 layers, 8 KV heads, head dim 128) at 2,048 tokens x 32 sequences in fp16: about 8 GiB
    llama = Model.from_config(LLAMA3_8B)
    assert 32 * llama.kv_bytes_per_sequence(2048, 2) == 8 * GIB
    # a 7B model in fp16 (about 14 GB of weights) on 2 TB/s decodes at most about 140 tokens/s per sequence
    seven_b = {**LLAMA3_8B, "vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": 32}
    assert Model.from_config(seven_b).params()[0] * 2 == pytest.approx(13.5e9, rel=0.01)
    one = plan(Model.from_config(seven_b), Device(80, 2000, 312), dtype="fp16", context=1)
    assert 140 < 2e12 / 13.5e9 and one.decode_tok_s_per_sequence == pytest.approx(2e12 / 13.5e9, rel=0.01)
    # the same 7B-class shape with 8 KV heads at 8,192 tokens x 16 sequences in fp16: 16 GiB of KV, so beside
    # 14 GB of fp16 weights it does not fit a 24 GB card; int8 KV (or half the batch) does
    gqa = Model.from_config({**seven_b, "num_key_value_heads": 8})
    assert 16 * gqa.kv_bytes_per_sequence(8192, 2) == 16 * GIB
    card = Device(24 * 1e9 / GIB, 1000, 100)  # 24 GB
    fp16 = plan(gqa, card, dtype="fp16", context=8192, utilization=1.0, reserve_gib=0.0)
    assert fp16.sequences_that_fit < 16 and fp16.predicted_knee == fp16.sequences_that_fit
    int8 = plan(gqa, card, dtype="fp16", kv_dtype="int8", context=8192, utilization=1.0, reserve_gib=0.0)
    assert int8.sequences_that_fit >= 16


POOL = """\
server:
  port: 9000  # keep
pool:
  models:
    - name: big
      kind: vllm
      max_num_seqs: 256   # old guess
    - name: small
      kind: vllm
"""


def test_write_config_sets_the_gate_and_the_pool_models_max_num_seqs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    argv = [str(tmp_path), "--device", "cpu", "--kv-cache-bytes", str(64 << 20), "--block-size", "32",
            "--context", "2048"]  # fmt: skip
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(POOL)
    assert main([*argv, "--write-config", str(cfg), "--pool-model", "big"]) == 0
    data = yaml.safe_load(cfg.read_text())
    assert data["admission"] == {"replica_max_concurrency": 64}
    assert [m.get("max_num_seqs") for m in data["pool"]["models"]] == [64, None]
    assert "# keep" in cfg.read_text() and "# old guess" in cfg.read_text()  # edited in place, comments kept
    assert main([*argv, "--write-config", str(cfg), "--pool-model", "small"]) == 0
    assert [m.get("max_num_seqs") for m in yaml.safe_load(cfg.read_text())["pool"]["models"]] == [64, 64]
    assert main([*argv, "--write-config", str(cfg), "--pool-model", "missing"]) == 1
    before = cfg.read_text()
    assert main([*argv, "--write-config", str(cfg)]) == 1  # two models and none named: which one is not guessed
    assert cfg.read_text() == before  # and nothing is written (the gate alone was, pool-wide)
    one = tmp_path / "one.yaml"
    one.write_text("pool:\n  models:\n  - name: only\n    kind: sim\n")  # the only model needs no name
    assert main([*argv, "--write-config", str(one)]) == 0
    assert yaml.safe_load(one.read_text())["pool"]["models"] == [{"name": "only", "kind": "sim", "max_num_seqs": 64}]


def test_a_deployment_of_devices_holds_devices_over_tp_replicas(tmp_path: Path) -> None:
    h100 = DEVICES["h100-sxm"]
    one = plan(Model.from_config(LLAMA3_8B), h100, context=8192, tp=2)
    pool = plan(Model.from_config(LLAMA3_8B), h100, context=8192, tp=2, devices=8)
    assert (one.replicas, pool.replicas) == (1, 4) and pool.sequences_that_fit == one.sequences_that_fit
    assert pool.pool_sequences_that_fit == 4 * one.sequences_that_fit
    assert pool.pool_decode_tok_s == pytest.approx(4 * one.decode_tok_s_aggregate)
    assert pool.reserve_gib_per_device == 1.0 and pool.replica_max_concurrency == one.replica_max_concurrency
    with pytest.raises(ValueError, match="cannot hold one replica"):
        plan(Model.from_config(LLAMA3_8B), h100, tp=4, devices=2)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert main([str(tmp_path), "--tp", "4", "--devices", "2"]) == 2


def test_past_the_kv_heads_each_device_holds_one_head() -> None:
    """Llama 3 8B has 8 KV heads: at tp 16 vLLM keeps one head a device (replicated), 16 KiB a token, not the
    whole 128 KiB."""
    h100 = Device(80, 3350, 989, 450)
    eight, sixteen = (plan(Model.from_config(LLAMA3_8B), h100, context=8192, tp=tp) for tp in (8, 16))
    assert eight.kv_bytes_per_token == sixteen.kv_bytes_per_token == 131072 // 8


@pytest.mark.parametrize(
    ("config", "flags", "says"),
    [
        ({**TINY, "num_attention_heads": 0}, [], "num_attention_heads is 0"),
        (TINY, ["--tp", "0"], "--tp must be at least 1"),
        (TINY, ["--tp", "3"], "does not divide the model's 4 attention heads"),
        (TINY, ["--context", "0"], "--context"),
        (TINY, ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization in (0, 1]"),
        ({**TINY, "max_position_embeddings": 2048}, ["--context", "4096"], "past the model's max_position_embeddings"),
    ],
)
def test_a_plan_vllm_would_refuse_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object], flags: list[str], says: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path), *flags]) == 2
    assert says in capsys.readouterr().err


def test_rope_scaling_extends_the_longest_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scaled = {**TINY, "max_position_embeddings": 2048, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    assert main([str(tmp_path), "--context", "8192", "--device", "cpu", "--json"]) == 0


def test_a_model_that_does_not_fit_is_refused_not_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Mixtral-8x7B in bf16 is 87 GiB of weights: on one 80 GiB device at 90 % nothing is left for KV."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("server:\n  port: 9000\n")
    assert main([str(tmp_path), "--device", "h100-sxm", "--write-config", str(cfg)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and cfg.read_text() == "server:\n  port: 9000\n"  # no recommendation, no gate written
    assert "does not fit" in captured.err and "KV budget of -15.99 GiB" in captured.err
    # a context longer than the whole KV budget, on a config without max_position_embeddings: 1 GiB a sequence
    # at 8,192 tokens, so 100 x 8,192 tokens need 100 GiB against the 56.04 GiB budget
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert main([str(tmp_path), "--context", "819200"]) == 2
    assert "not one sequence fits" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"short by 43\.96 GiB"):
        plan(Model.from_config(LLAMA3_8B), DEVICES["h100-sxm"], context=819200)


@pytest.mark.parametrize(
    ("config", "flags", "says"),
    [
        ({**TINY, "num_key_value_heads": 0}, [], "num_key_value_heads is 0"),
        ({**TINY, "num_key_value_heads": -2}, [], "num_key_value_heads is -2"),
        ({**TINY, "num_key_value_heads": 3}, [], "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({**TINY, "layer_types": ["full_attention"]}, [], "layer_types names 1 layers, num_hidden_layers is 2"),
        ({**TINY, "hidden_size": None}, [], "no hidden_size"),
        ({**TINY, "vocab_size": "big"}, [], "vocab_size is 'big'"),
        ({k: v for k, v in TINY.items() if k != "vocab_size"}, [], "has no vocab_size"),
        ([TINY], [], "not a JSON object"),
        (TINY, ["--block-size", "-16"], "--block-size"),
        (TINY, ["--block-size", "0"], "--block-size"),
        (TINY, ["--memory-gib", "0"], "--memory-gib 0: must be positive"),
        (TINY, ["--bandwidth-gbs", "0"], "--bandwidth-gbs 0: must be positive"),
        (TINY, ["--reserve-gib", "-50"], "--reserve-gib"),
        (TINY, ["--kv-cache-bytes", "0"], "not one sequence fits"),
    ],
)
def test_odd_model_configs_and_flags_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: object, flags: list[str], says: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path), "--device", "cpu", "--context", "64", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "KeyError" not in err


def test_absent_device_figures_are_the_presets_and_a_null_kv_heads_is_full_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_key_value_heads": None}))
    assert main([str(tmp_path), "--device", "cpu", "--context", "64", "--interconnect-gbs", "0", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kv_bytes_per_token"] == 2 * 2 * 4 * 32 * 2  # 4 KV heads, as many as the query heads (HF's default)
    # embeddings 2 x 2048 x 128, attention 2 x (128 x 4 x 32 x 2 x 2), MLP 2 x 3 x 128 x 256: 851,968 bf16 weights
    assert got["weights_gib_per_device"] == 851_968 * 2 / GIB
    assert got["kv_budget_gib_per_device"] == pytest.approx(24 * 0.9 - 851_968 * 2 / GIB - 1.0)  # the cpu preset


def test_the_gate_never_exceeds_the_batch_the_engine_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3 8B at 512 tokens on one H100: 28,694 blocks of 16 tokens, 32 a sequence, so 896 fit; vLLM runs at
    most max_num_seqs 256 of them, so the gate, the knee and the aggregate decode stop at 256 too."""
    p = plan(Model.from_config(LLAMA3_8B), DEVICES["h100-sxm"], context=512)
    assert (p.kv_blocks, p.sequences_that_fit) == (28694, 896)
    assert p.max_num_seqs == p.replica_max_concurrency == p.predicted_knee == 256
    kv_seq = 512 * 131072  # bytes; half of it read per step on average
    assert p.decode_tok_s_aggregate == pytest.approx(256 * 3350e9 / (8_029_995_008 * 2 + 256 * kv_seq / 2))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("pool:\n  models:\n  - name: only\n    kind: vllm\n")
    assert main([str(tmp_path), "--context", "512", "--write-config", str(cfg)]) == 0
    data = yaml.safe_load(cfg.read_text())
    assert data["admission"] == {"replica_max_concurrency": 256} and data["pool"]["models"][0]["max_num_seqs"] == 256


def test_a_hybrid_models_linear_attention_state_is_split_over_every_tensor_parallel_rank() -> None:
    """Qwen3-Next at tp 4: its 2 KV heads split 2 ways (a head per device at most), but vLLM shards the Gated
    DeltaNet heads (16 key, 32 value) over all 4 ranks, so each device holds a quarter of the state."""
    p = plan(Model.from_config(QWEN3_NEXT_80B), DEVICES["h200"], context=4096, tp=4, kv_cache_bytes=8 * GIB)
    kv_token = 12 * 2 * 2 * 256 * 2 // 2  # 12,288 bytes per device
    state = 39_518_208 // 4  # 9,879,552 bytes per device, not half of the 39.5 MB
    per_sequence = kv_token * 4096 + state
    assert p.kv_bytes_per_token == kv_token == 12288 and per_sequence == 60_211_200
    assert p.kv_gib_per_sequence == pytest.approx(per_sequence / GIB)
    block = 16 * kv_token  # 196,608 bytes: 43,690 of them in 8 GiB, 307 a sequence
    assert p.kv_blocks == 8 * GIB // block == 43690 and -(-per_sequence // block) == 307
    assert p.sequences_that_fit == 43690 // 307 == 142
