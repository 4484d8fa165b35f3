#!/usr/bin/env bash
# Builds kvgate's two images with podman (or docker): kvgate:latest (deploy/Dockerfile, the gateway) and
# kvgate-engine-cpu:latest (deploy/Dockerfile.engine-cpu, vLLM's CPU build and the tiny model).
#   scripts/images.sh [--base auto|public|local|IMAGE] [--only gateway|engine] [--force]
# --base: `public` is python:3.11-slim from a registry; `local` is a Debian bookworm base made here (mmdebstrap,
#   then `podman import`: localhost/kvgate-base:bookworm, made once) for machines that reach no image registry;
#   `auto` (default) takes the public one when it is present or can be pulled, the local one otherwise.
# Wheels: the Python packages are downloaded once on the host (`pip download`, Python 3.11 on x86-64 Linux, into
#   $KVGATE_WHEELS, default .kvgate/wheels, ~900 MB with vLLM) and given to the build as the `wheels` build context
#   with PIP_NO_INDEX=1, so a rebuild downloads nothing. Without a usable Python 3.11 pip, the build uses the index.
# Rebuilds: each image is labelled with a hash of the files it is built from (the Dockerfile, pyproject.toml,
#   README.md, the packages' sources, the entrypoint, the base's id); an image whose label matches is kept as it is
#   (--force rebuilds). The builder's layer cache alone would not do: its RUN --mount layers are not keyed on the
#   wheels, and any source change would reinstall everything after the first changed COPY.
# Podman: when CONTAINERS_CONF is unset and runc is installed, deploy/podman/containers.conf is used (runc,
#   cgroupfs, no default ulimits: what these machines need). Images are built in docker format (podman's OCI
#   format would drop HEALTHCHECK). Prints one line per image: name, built|kept, seconds, size.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE_MODE=auto ONLY="" FORCE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE_MODE=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "images.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PUBLIC_BASE=python:3.11-slim
LOCAL_BASE=localhost/kvgate-base:bookworm
WHEELS=${KVGATE_WHEELS:-$ROOT/.kvgate/wheels}

if [ -n "${KVGATE_CONTAINER_TOOL:-}" ]; then TOOL=$KVGATE_CONTAINER_TOOL
elif command -v podman >/dev/null 2>&1; then TOOL=podman
elif command -v docker >/dev/null 2>&1; then TOOL=docker
else echo "images.sh: needs podman or docker" >&2; exit 1; fi
if [ "$TOOL" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] && command -v runc >/dev/null 2>&1; then
  export CONTAINERS_CONF=$ROOT/deploy/podman/containers.conf
fi
log() { echo "[images] $*" >&2; }

image_id() { "$TOOL" image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

make_local_base() {
  [ -n "$(image_id "$LOCAL_BASE")" ] && return 0
  command -v mmdebstrap >/dev/null 2>&1 || { echo "images.sh: no registry base and no mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
  log "making $LOCAL_BASE with mmdebstrap (Debian bookworm: python3, venv, libnuma1)"
  local tar; tar=$(mktemp -d)/base.tar
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,libnuma1 \
    --format=tar bookworm "$tar" "${KVGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  "$TOOL" import --change 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" >/dev/null
  rm -rf "$(dirname "$tar")"
}

case "$BASE_MODE" in
  public) BASE=$PUBLIC_BASE ;;
  local) make_local_base; BASE=$LOCAL_BASE ;;
  auto)
    if [ -n "$(image_id "$PUBLIC_BASE")" ] || timeout 120 "$TOOL" pull -q "docker.io/library/$PUBLIC_BASE" >/dev/null 2>&1; then
      BASE=$PUBLIC_BASE
    else
      log "no registry reachable for $PUBLIC_BASE: using a locally made base"
      make_local_base; BASE=$LOCAL_BASE
    fi ;;
  *) BASE=$BASE_MODE ;;
esac
BASE_ID=$(image_id "$BASE")

# The wheels, once per pyproject.toml (a stamp), with the host's Python 3.11 pip (the images' Python).
PY=""
for candidate in "$ROOT/.venv/bin/python" python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys, platform; assert sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64" and sys.platform == "linux"' 2>/dev/null; then
    PY=$candidate; break
  fi
done
WHEEL_ARGS=()
STAMP="$WHEELS/.stamp-$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)"  # files already there are kept
if [ -n "$PY" ]; then
  if [ ! -f "$STAMP" ]; then
    log "downloading wheels into $WHEELS (once per pyproject.toml and this script)"
    mkdir -p "$WHEELS"
    # async-timeout: redis wants it below Python 3.11.3 (Debian's 3.11.2), which a newer host Python skips
    "$PY" -m pip download -q --disable-pip-version-check -d "$WHEELS" ".[cpu]" "setuptools>=68" wheel \
      "async-timeout>=4.0.3" >&2
    rm -f "$WHEELS"/.stamp-*; touch "$STAMP"
  fi
  WHEEL_ARGS=(--build-context "wheels=$WHEELS" --build-arg PIP_NO_INDEX=1)
else
  log "no Python 3.11 on x86-64 Linux here to download wheels with: the builds install from the index"
fi

# the packages pyproject.toml installs (its [tool.setuptools.packages.find] include line)
PACKAGES=$(sed -n 's/^include = \[\(.*\)\]$/\1/p' pyproject.toml | tr -d '",*')
source_hash() {  # the files an image is built from, and the base it is built on
  { sha256sum "$@" pyproject.toml README.md deploy/engine-cpu-entrypoint.sh
    # shellcheck disable=SC2086  # one word per package
    git ls-files -z -- $PACKAGES 2>/dev/null | xargs -0 sha256sum
    echo "$BASE_ID"; } | sha256sum | cut -c1-32
}

build() {  # name dockerfile
  local name=$1 dockerfile=$2 hash start seconds size
  hash=$(source_hash "$dockerfile")
  if [ "$FORCE" = 0 ] && [ "$("$TOOL" image inspect --format '{{index .Config.Labels "org.kvgate.source-hash"}}' "$name" 2>/dev/null || true)" = "$hash" ]; then
    size=$("$TOOL" image inspect --format '{{.Size}}' "$name")
    echo "$name kept 0 $size"; return 0
  fi
  log "building $name from $BASE ($dockerfile)"
  local previous; previous=$(image_id "$name")
  start=$(date +%s)
  local fmt=(); [ "$TOOL" = podman ] && fmt=(--format docker)
  "$TOOL" build "${fmt[@]}" --network host -f "$dockerfile" -t "$name" --build-arg "BASE=$BASE" "${WHEEL_ARGS[@]}" \
    --label "org.kvgate.source-hash=$hash" . >&2
  seconds=$(( $(date +%s) - start ))
  size=$("$TOOL" image inspect --format '{{.Size}}' "$name")
  if [ -n "$previous" ] && [ "$previous" != "$(image_id "$name")" ]; then  # the image it replaces, untagged now
    "$TOOL" rmi "$previous" >/dev/null 2>&1 || true
  fi
  echo "$name built $seconds $size"
}

[ "$ONLY" = engine ] || build kvgate:latest deploy/Dockerfile
[ "$ONLY" = gateway ] || build kvgate-engine-cpu:latest deploy/Dockerfile.engine-cpu
