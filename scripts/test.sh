#!/usr/bin/env bash
# The project's test command: set up the environment, then lint, type-check and run the whole test suite
# (including the real-vLLM tests on the tiny local model), then the container tests as their own step (marker
# `containers`: they build the deploy/ images). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "[test] ruff" >&2
ruff check .
ruff format --check .
echo "[test] mypy" >&2
mypy
echo "[test] import-linter (package layers, no cycles)" >&2
lint-imports
echo "[test] pytest" >&2
python -m pytest "$@"
echo "[test] containers (scripts/images.sh, then the images run with podman; skipped without podman)" >&2
python -m pytest -m containers "$@"
echo "[test] bare install (pip install kvgate, no extras)" >&2
bash scripts/bare_install_test.sh
