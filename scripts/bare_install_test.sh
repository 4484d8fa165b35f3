#!/usr/bin/env bash
# A bare install, as `pip install kvgate` gives it: build the wheel, install it with no extras (no vLLM, no
# transformers) into a fresh virtualenv, then (1) run `kvgate serve` in front of a simulated engine and send it a
# chat completion, and (2) run every test that needs neither vLLM nor the tokenizer extra against the installed
# wheel (a copy of tests/, bench/ and the files the kit tests read, no package of the product, so nothing of it is
# imported from the source tree; tests that need transformers skip).
# Called by scripts/test.sh; about two minutes. Set KVGATE_SKIP_BARE=1 to skip it locally.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KVGATE_SKIP_BARE:-0}" = 1 ]; then
  echo "[bare] skipped (KVGATE_SKIP_BARE=1)" >&2
  exit 0
fi
PY=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

echo "[bare] building the wheel and installing it with no extras" >&2
.venv/bin/python -m pip wheel -q --no-deps -w "$WORK/dist" . >&2
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WORK"/dist/kvgate-*.whl >&2
if "$WORK/venv/bin/python" -c 'import vllm' 2>/dev/null || "$WORK/venv/bin/python" -c 'import transformers' 2>/dev/null
then
  echo "[bare] a bare install pulled in vLLM or transformers" >&2
  exit 1
fi

echo "[bare] kvgate serve in front of a simulated engine" >&2
ENGINE_PORT=$(.venv/bin/python -c 'from engine_pool.launcher import free_port; print(free_port())')
GW_PORT=$(.venv/bin/python -c 'from engine_pool.launcher import free_port; print(free_port())')
(cd "$WORK" && exec venv/bin/kvgate sim-engine --port "$ENGINE_PORT" --model sim --instant >"$WORK/sim.log" 2>&1) &
(cd "$WORK" && exec venv/bin/kvgate serve --port "$GW_PORT" --engine "http://127.0.0.1:$ENGINE_PORT" \
  --policy cache-aware >"$WORK/gw.log" 2>&1) &
"$WORK/venv/bin/python" - "$GW_PORT" <<'EOF'
import json, sys, time, urllib.error, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(base + "/ready", timeout=2) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, ConnectionError):
        pass
    if time.monotonic() > deadline:
        raise SystemExit("[bare] the gateway never became ready")
    time.sleep(0.2)
body = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=10) as r:
    answer = json.load(r)
assert answer["usage"]["completion_tokens"] == 4, answer
print("[bare] chat completion through a bare install: ok", file=sys.stderr)
EOF
kill $(jobs -p) 2>/dev/null || true

echo "[bare] the tests that need neither vLLM nor transformers, against the installed wheel" >&2
"$WORK/venv/bin/python" -m pip install -q pytest pytest-asyncio pytest-timeout pytest-aiohttp hypothesis openai anthropic \
  psutil >&2
# bench/: the routing report's table code; deploy/, scripts/images.sh, .dockerignore and pyproject.toml: what the kit
# tests compare (the images take every package pyproject.toml installs)
cp -r tests bench deploy scripts pyproject.toml .dockerignore "$WORK/"
.venv/bin/python - "$WORK/pytest.ini" <<'EOF'
import sys, tomllib
opts = tomllib.load(open("pyproject.toml", "rb"))["tool"]["pytest"]["ini_options"]
lines = ["[pytest]"]
for key, value in opts.items():
    if isinstance(value, list):
        lines.append(f"{key} =\n" + "\n".join(f"    {v}" for v in value))
    else:
        lines.append(f"{key} = {value}")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
cd "$WORK"
exec venv/bin/python -m pytest -q -m "not vllm and not containers" -p no:cacheprovider tests
