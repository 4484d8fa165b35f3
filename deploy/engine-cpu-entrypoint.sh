#!/bin/sh
# deploy/Dockerfile.engine-cpu's entrypoint: the tiny model (built once per volume), then vLLM with "$@".
set -e
kvgate make-tiny-model /models/tiny-llama >/dev/null
exec python -m vllm.entrypoints.openai.api_server "$@"
