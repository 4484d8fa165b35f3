"""The vLLM launch recipe. Pure argv/env checks run everywhere; the tests marked `vllm` start one real replica on the
tiny model from `vllm_argv` (session fixture, start-up 25-90 s) and check completions, chat template parity between
HF `apply_chat_template` and vLLM's `/tokenize`, KV events and their block hashes, a gateway that finds the KV-event
publisher from the engine's URL alone, metrics and errors."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_pool.tiny_model import build_tiny_model
from engine_pool.vllm_command import EngineLaunchSpec, detect_device, installed_vllm_flavour, vllm_argv, vllm_env
from gateway.embedded import running_gateway
from gateway.keys import REPLICAS
from tests.conftest import gateway_config, wait_for

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None

# start-up deadline; raise it with KVGATE_VLLM_STARTUP_S on a machine shared with other vLLM processes
STARTUP_DEADLINE_S = float(os.environ.get("KVGATE_VLLM_STARTUP_S", "180"))
BLOCK_SIZE = 32
MODEL_NAME = "tiny"
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about the river near the station."},
]


def test_cpu_argv_and_env() -> None:
    spec = EngineLaunchSpec(
        model="/m",
        served_model_name="tiny",
        port=8001,
        block_size=32,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        kv_events_ipc_path="/tmp/kv.sock",
        kv_events_replay_port=8002,
        cpu_threads_bind="1",
        cache_root="/c",
        dtype="float16",
        extra_args=("--max-num-batched-tokens", "4096"),
        extra_env={"VLLM_LOGGING_LEVEL": "WARNING"},
        python="/py",
    )
    argv = vllm_argv(spec)
    assert argv[:5] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert flags["--served-model-name"] == "tiny" and flags["--port"] == "8001" and flags["--host"] == "127.0.0.1"
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert "--enforce-eager" in argv and "--enable-prefix-caching" in argv
    assert "--enable-prompt-tokens-details" in argv  # the engine reports cached tokens in usage
    assert "--gpu-memory-utilization" not in argv and "--tensor-parallel-size" not in argv
    assert argv[-2:] == ["--max-num-batched-tokens", "4096"]
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///tmp/kv.sock",
        "replay_endpoint": "tcp://127.0.0.1:8002",
        "topic": "kv-events",
    }
    assert spec.kv_events_endpoint == "ipc:///tmp/kv.sock"

    base = {"PATH": "/bin", "PYTHONHASHSEED": "7", "VLLM_CPU_KVCACHE_SPACE": "4", "CUDA_VISIBLE_DEVICES": "0"}
    env = vllm_env(spec, base)
    assert env["PATH"] == "/bin" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "PYTHONHASHSEED" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CACHE_ROOT"] == "/c"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert base["PYTHONHASHSEED"] == "7"  # the caller's mapping is not modified


def test_gpu_replicas_sharing_a_device_pass_both_kv_size_and_memory_share() -> None:
    spec = EngineLaunchSpec(model="/m", port=9000, device="gpu", block_size=32, kv_cache_memory_bytes=1 << 26,
                            gpu_memory_utilization=0.4)  # fmt: skip
    argv = vllm_argv(spec)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(1 << 26)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    cpu = vllm_argv(EngineLaunchSpec(model="/m", port=9000, device="cpu", block_size=32, gpu_memory_utilization=0.4))
    assert "--gpu-memory-utilization" not in cpu


def test_data_parallel_ranks_are_passed_on_either_device() -> None:
    for device in ("cpu", "gpu"):
        argv = vllm_argv(EngineLaunchSpec(model="/m", port=9000, device=device, data_parallel_size=2))
        assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert "--data-parallel-size" not in vllm_argv(EngineLaunchSpec(model="/m", port=9000))


def test_gpu_argv_and_env_and_tcp_events() -> None:
    spec = EngineLaunchSpec(
        model="/m",
        port=9000,
        device="gpu",
        block_size=16,
        gpu_memory_utilization=0.4,
        tensor_parallel_size=2,
        cuda_visible_devices="2,3",
        kv_events_port=9100,
        enable_prefix_caching=False,
        enforce_eager=False,
        hash_seed="0",
    )
    argv = vllm_argv(spec)
    assert argv[argv.index("--served-model-name") + 1] == "/m"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in argv and "--prefix-caching-hash-algo" not in argv
    assert "--enable-prompt-tokens-details" not in argv
    assert "--enforce-eager" not in argv
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:9100"
    assert spec.kv_events_endpoint == "tcp://127.0.0.1:9100"
    env = vllm_env(spec, {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert "VLLM_TARGET_DEVICE" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PYTHONHASHSEED"] == "0"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_size": 16}, "multiple of 32"),
        ({"port": 0}, "port"),
        ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
        ({"kv_events_port": 5, "kv_events_ipc_path": "/tmp/a"}, "not both"),
        ({"kv_events_replay_port": 5}, "needs"),
        ({"device": "tpu"}, "device"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_spec_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {"model": "/m", "port": 8000, **overrides}
    with pytest.raises(ValueError, match=message):
        EngineLaunchSpec(**kwargs)


def test_detect_device() -> None:
    assert detect_device({"KVGATE_DEVICE": "gpu"}) == "gpu"
    assert detect_device({"KVGATE_DEVICE": "cpu"}) == "cpu"
    assert detect_device({"CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    if installed_vllm_flavour() == "cpu":
        assert detect_device({}) == "cpu"
    assert detect_device() in ("cpu", "gpu")


@dataclass
class Replica:
    spec: EngineLaunchSpec
    model_dir: Path
    sub: Any  # zmq.Socket subscribed to the replica's KV events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _request(spec: EngineLaunchSpec, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(spec.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
            status: int = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    return status, (json.loads(raw) if raw.startswith(("{", "[")) else raw)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # children of the engine that outlived it (the group id is the leader's pid)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    zmq = pytest.importorskip("zmq")
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model(root / "model", seed=0)
    spec = EngineLaunchSpec(
        model=str(model_dir),
        served_model_name=MODEL_NAME,
        port=_free_port(),
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_num_seqs=8,
        dtype="float16",
        kv_cache_memory_bytes=64 << 20,
        kv_events_ipc_path=str(root / "kv.sock"),
        cpu_threads_bind="nobind",
        cache_root=str(root / "cache"),
        extra_args=("--enable-scale-out",),  # the render routes and /inference/v1/generate
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, spec.kv_events_topic.encode())
    sub.connect(spec.kv_events_endpoint)
    log_path = root / "vllm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            vllm_argv(spec),
            env=vllm_env(spec, os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not healthy after {STARTUP_DEADLINE_S} s:\n{log_path.read_text()[-4000:]}")
            try:
                if _request(spec, "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        yield Replica(spec=spec, model_dir=model_dir, sub=sub)
    finally:
        _stop(proc)
        sub.close(linger=0)
        ctx.term()


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
def test_completion_has_the_requested_length(replica: Replica) -> None:
    from transformers import AutoTokenizer

    prompt = "The engineer cached a block near the station."
    status, body = _request(
        replica.spec,
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0},
    )
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    # a completion prompt gets exactly one BOS from the tokenizer's post-processor
    tok = AutoTokenizer.from_pretrained(replica.model_dir)
    assert body["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"])
    status, body = _request(replica.spec, "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
    assert body["tokens"] == tok(prompt)["input_ids"]


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
def test_hf_chat_template_ids_equal_vllm_tokenize(replica: Replica) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(replica.model_dir)
    parts: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more."}]}
    ]
    for messages in (MESSAGES, parts):
        hf_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        status, body = _request(replica.spec, "/tokenize", {"model": MODEL_NAME, "messages": messages})
        assert status == 200, body
        assert body["tokens"] == hf_ids
        assert hf_ids.count(tok.bos_token_id) == 1
    status, body = _request(
        replica.spec,
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True},
    )
    assert status == 200, body
    chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert body["usage"]["prompt_tokens"] == len(chat_ids)
    assert body["usage"]["completion_tokens"] == 4


def _predicted_hashes(token_ids: list[int]) -> list[int]:
    """vLLM's chained block hash with --prefix-caching-hash-algo sha256_cbor, low 64 bits as in KV events."""
    cbor2 = pytest.importorskip("cbor2")
    parent = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    out = []
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = tuple(token_ids[start : start + BLOCK_SIZE])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
def test_kv_events_carry_predictable_block_hashes(replica: Replica) -> None:
    import msgpack

    prompt = "The quiet gardener planted a golden lantern by the sea. " * 12
    status, body = _request(replica.spec, "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
    predicted = _predicted_hashes(body["tokens"])
    assert len(predicted) >= 3
    status, body = _request(
        replica.spec, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    )
    assert status == 200, body

    stored: set[int] = set()
    deadline = time.monotonic() + 30
    while not set(predicted) <= stored and time.monotonic() < deadline:
        if not replica.sub.poll(500):
            continue
        topic, seq, payload = replica.sub.recv_multipart()
        assert topic == replica.spec.kv_events_topic.encode()
        assert len(seq) == 8
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and isinstance(batch[0], float) and isinstance(batch[1], list)
        for event in batch[1]:
            if event["type"] == "BlockStored":
                assert event["block_size"] == BLOCK_SIZE
                assert len(event["token_ids"]) == BLOCK_SIZE * len(event["block_hashes"])
                stored.update(event["block_hashes"])
    assert set(predicted) <= stored


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
async def test_an_engine_given_by_its_url_alone_publishes_to_the_gateway(replica: Replica) -> None:
    """`engines: [{url}]` with no KV-event settings: kvgate subscribes to what the engine lists at
    /kv_event_sources, so the blocks the engine stores reach its index and its prediction is the engine's."""
    config = gateway_config(
        [],
        engines=[{"url": replica.spec.base_url, "tokenizer": str(replica.model_dir)}],
        routing={"policy": "cache-aware"},
    )
    messages = [{"role": "user", "content": "A heron counted the lanterns along the old canal. " * 10}]
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        (attached,) = gw.app[REPLICAS]
        await wait_for(lambda: attached.routable(time.monotonic()), 60, "the engine routable")
        assert attached.kv_events_endpoint is not None and attached.kv_events_endpoint.startswith("ipc://")

        async def metric(name: str, label: str) -> float:
            async with http.get(f"{gw.url}/metrics") as resp:
                text = await resp.text()
            return sum(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line
            )

        async def chat() -> None:
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2}
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()

        await chat()
        end = time.monotonic() + 20
        while await metric("kvgate_kv_events_total", 'type="BlockStored"') == 0:
            assert time.monotonic() < end, "no BlockStored event reached the gateway"
            await asyncio.sleep(0.1)
        await chat()
        status, tokens = _request(replica.spec, "/tokenize", {"model": MODEL_NAME, "messages": messages})
        assert status == 200
        full_blocks = len(tokens["tokens"]) // BLOCK_SIZE * BLOCK_SIZE
        # the repeat's predicted cached tokens: every full block of its prompt, as the events told
        assert await metric("kvgate_prefix_predicted_cached_tokens_total", "") == full_blocks


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
async def test_anthropic_messages_through_the_gateway_are_predicted_as_the_engine_caches_them(
    replica: Replica,
) -> None:
    """The anthropic SDK against kvgate in front of vLLM's own /v1/messages: kvgate's conversion of the request
    (gateway/anthropic.py) hashes the prompt the engine renders, so its predicted cached tokens equal the
    `cache_read_input_tokens` the engine reports, system prompt as blocks and a tool turn included."""
    anthropic = pytest.importorskip("anthropic")
    config = gateway_config(
        [],
        engines=[{"url": replica.spec.base_url, "tokenizer": str(replica.model_dir)}],
        routing={"policy": "cache-aware"},
    )
    system = [{"type": "text", "text": "You sort the harbour's ledgers by tide and by name. " * 12}]
    tools = [
        {"name": "ledger", "description": "read a ledger", "input_schema": {"properties": {"n": {"type": "integer"}}}}
    ]
    turns = [
        [{"role": "user", "content": "Which ledger first?"}],
        [
            {"role": "user", "content": "Which ledger first?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ledger", "input": {"n": 3}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ledger three: 40 barrels"}],
            },
        ],
    ]
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        (attached,) = gw.app[REPLICAS]
        await wait_for(lambda: attached.routable(time.monotonic()), 60, "the engine routable")
        engine_cached = []
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0) as client:
            for messages in [turns[0], turns[0], turns[1]]:
                answer = await client.messages.create(
                    model=MODEL_NAME, max_tokens=2, system=system, tools=tools, tool_choice={"type": "none"},
                    messages=messages,
                )  # fmt: skip
                engine_cached.append(answer.usage.cache_read_input_tokens or 0)
        async with http.get(f"{gw.url}/metrics") as resp:
            text = await resp.text()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert engine_cached[1] >= BLOCK_SIZE and engine_cached[2] >= engine_cached[1]  # the engine reused the prefix
    assert total("kvgate_prefix_reported_cached_tokens_total") == sum(engine_cached)
    assert total("kvgate_prefix_predicted_cached_tokens_total") == sum(engine_cached)


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
def test_metrics_and_errors(replica: Replica) -> None:
    status, text = _request(replica.spec, "/metrics")
    assert status == 200
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1
    assert f'block_size="{BLOCK_SIZE}"' in info[0]
    assert 'prefix_caching_hash_algo="sha256_cbor"' in info[0]
    assert 'enable_prefix_caching="True"' in info[0]
    status, body = _request(replica.spec, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404
    assert set(body["error"]) >= {"message", "type", "param", "code"}


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
async def test_render_and_generate_through_the_gateway(replica: Replica) -> None:
    """vLLM's render of a Messages request (through kvgate) is the token sequence kvgate hashes for it (its chat view
    under the engine's own chat template: system blocks, a tool turn); those ids sent to /inference/v1/generate
    through kvgate are answered, the engine reports their prefix cached on the second request, and kvgate predicted
    exactly that."""
    from cacheindex.tokenizers import build_tokenizer
    from gateway.anthropic import messages_as_chat

    config = gateway_config(
        [],
        engines=[{"url": replica.spec.base_url, "tokenizer": str(replica.model_dir)}],
        routing={"policy": "cache-aware"},
    )
    body = {
        "model": MODEL_NAME, "max_tokens": 4,
        "system": [{"type": "text", "text": "You render the lighthouse keeper's logs, one line a night. " * 12}],
        "messages": [  # a prompt no other test sends: the module's engine has not cached it
            {"role": "user", "content": "Which night first?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ledger", "input": {"n": 3}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ledger three"}]},
        ],
    }  # fmt: skip
    chat = messages_as_chat(body)
    assert chat is not None
    predicted_ids = build_tokenizer(str(replica.model_dir)).tokenize_chat(chat["messages"], True, {})
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        (attached,) = gw.app[REPLICAS]
        await wait_for(lambda: attached.routable(time.monotonic()), 60, "the engine routable")
        async with http.post(f"{gw.url}/v1/messages/render", json=body) as resp:
            rendered = await resp.json()
            assert resp.status == 200, rendered
        assert rendered["token_ids"] == predicted_ids
        cached = []
        for tail in ([11], [12, 13]):
            generate = {"model": MODEL_NAME, "token_ids": predicted_ids + tail, "sampling_params": {"max_tokens": 2}}
            async with http.post(f"{gw.url}/inference/v1/generate", json=generate) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        async with http.get(f"{gw.url}/metrics") as resp:
            text = await resp.text()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert cached[1] >= BLOCK_SIZE * (len(predicted_ids) // BLOCK_SIZE) - BLOCK_SIZE
    assert total("kvgate_prefix_predicted_cached_tokens_total") == total("kvgate_prefix_reported_cached_tokens_total")
    assert total("kvgate_prefix_reported_cached_tokens_total") == sum(cached)


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
async def test_a_responses_request_is_predicted_as_the_engine_caches_it(replica: Replica) -> None:
    """A Responses request shaped as Codex sends it (developer messages of `input_text` parts; function, namespace
    and built-in tools; a turn of reasoning, tool calls and their outputs): vLLM's render of it (through kvgate) is
    the token sequence kvgate hashes, a second BOS included (vLLM encodes a Responses prompt with the tokenizer's
    special tokens on top of the template's); sent twice, the engine reports its prefix cached and kvgate predicted
    exactly that."""
    from cacheindex.tokenize_pool import chat_kwargs
    from cacheindex.tokenizers import build_tokenizer
    from gateway.responses import responses_as_chat

    config = gateway_config(
        [],
        engines=[{"url": replica.spec.base_url, "tokenizer": str(replica.model_dir)}],
        routing={"policy": "cache-aware"},
    )
    body = {
        "model": MODEL_NAME, "max_output_tokens": 2, "store": False, "tool_choice": "none",
        "input": [  # a prompt no other test sends: the module's engine has not cached it
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You keep the canal lock's tally, one barge a line. " * 12}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How many today?"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Count them."}]},
            {"type": "function_call", "call_id": "c1", "name": "tally", "arguments": '{"day": "today"}'},
            {"type": "function_call", "call_id": "c2", "name": "open", "namespace": "lock", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "seven"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "open"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Seven barges."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And yesterday?"}]},
        ],
        "tools": [
            {"type": "function", "name": "tally", "description": "Count barges.", "strict": False,
             "parameters": {"type": "object", "properties": {"day": {"type": "string"}}}},
            {"type": "namespace", "name": "lock", "description": "The lock.", "tools": [
                {"type": "function", "name": "open", "parameters": {"type": "object", "properties": {}}}]},
            {"type": "web_search"},
        ],
    }  # fmt: skip
    view = responses_as_chat(body)
    assert view is not None
    predicted_ids = build_tokenizer(str(replica.model_dir)).tokenize_chat(view["messages"], True, chat_kwargs(view))
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        (attached,) = gw.app[REPLICAS]
        await wait_for(lambda: attached.routable(time.monotonic()), 60, "the engine routable")
        async with http.post(f"{gw.url}/v1/responses/render", json=body) as resp:
            rendered = await resp.json()
            assert resp.status == 200, rendered
        assert rendered["token_ids"] == predicted_ids
        cached = []
        for _ in range(2):
            async with http.post(f"{gw.url}/v1/responses", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            cached.append(answer["usage"]["input_tokens_details"]["cached_tokens"])
        async with http.get(f"{gw.url}/metrics") as resp:
            text = await resp.text()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert cached[0] == 0 and cached[1] >= BLOCK_SIZE * (len(predicted_ids) // BLOCK_SIZE) - BLOCK_SIZE
    assert total("kvgate_prefix_predicted_cached_tokens_total") == total("kvgate_prefix_reported_cached_tokens_total")
    assert total("kvgate_prefix_reported_cached_tokens_total") == sum(cached)


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_DEADLINE_S + 120)
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
async def test_abort_requests_through_the_gateway_stops_the_rollout(replica: Replica) -> None:
    """An RL framework's abort by id through kvgate: a streamed /inference/v1/generate started with its own
    X-Request-Id ends early with finish_reason "abort" once `generate-tokens-<id>` is aborted at kvgate; ids no
    engine runs are accepted; a body without `request_ids` is a 400 in OpenAI's shape."""
    config = gateway_config([], engines=[{"url": replica.spec.base_url, "tokenizer": str(replica.model_dir)}])
    generate = {
        "model": MODEL_NAME, "token_ids": list(range(100, 164)), "stream": True,
        "sampling_params": {"max_tokens": 1900, "ignore_eos": True, "temperature": 0},
    }  # fmt: skip
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        (attached,) = gw.app[REPLICAS]
        await wait_for(lambda: attached.routable(time.monotonic()), 60, "the engine routable")
        headers = {"X-Request-Id": "rollout-7"}
        async with http.post(f"{gw.url}/inference/v1/generate", json=generate, headers=headers) as stream:
            assert stream.status == 200, await stream.text()
            first = await stream.content.readline()  # it is running
            assert first.startswith(b"data: ")
            abort = {"request_ids": ["generate-tokens-rollout-7", "generate-tokens-nobody"]}
            async with http.post(f"{gw.url}/inference/v1/abort_requests", json=abort) as resp:
                assert resp.status == 200, await resp.text()
            rest = (await stream.read()).decode()
        async with http.post(f"{gw.url}/inference/v1/abort_requests", json={"ids": ["x"]}) as resp:
            error = await resp.json()
            assert resp.status == 400 and error["error"]["param"] == "request_ids", error
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
    tokens = sum(len(c.get("token_ids") or []) for e in events for c in e.get("choices", []))
    assert "abort" in reasons, reasons[-3:]
    assert tokens < 1900
