#!/usr/bin/env bash
# Build the images the compose file and the container tests use:
#   hypha-core:TAG        gateway, scheduler, data node, client CLI, certutil (no torch)
#   hypha-worker:TAG      the worker (torch)
#   hypha-worker-gpu:TAG  the worker for NVIDIA hosts (Dockerfile.gpu)
# TAG is $HYPHA_IMAGE_TAG (default latest). The base is $HYPHA_BASE_IMAGE, else
# python:3.11-slim-bookworm when it is present locally, else the stand-in
# scripts/base-image.sh builds from Debian's packages. Wheels come from
# scripts/wheelhouse.sh; both steps skip work whose inputs did not change, and
# docker's layer cache makes a rebuild after a code change take seconds.
# HYPHA_IMAGES="core worker" builds a subset. Compose v2 comes first
# (scripts/compose-plugin.sh, a no-op where `docker compose` works), so the
# README's `docker compose ...` commands work after this script, also where
# only the python docker-compose 1.29 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/compose-plugin.sh
tag=${HYPHA_IMAGE_TAG:-latest}
base=${HYPHA_BASE_IMAGE:-}
if [ -z "$base" ]; then
  if docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1; then
    base=python:3.11-slim-bookworm
  else
    base=hypha-base:3.11-slim-bookworm
    HYPHA_BASE_IMAGE=$base bash scripts/base-image.sh
  fi
fi
bash scripts/wheelhouse.sh
revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# The wheelhouse's keys and the digest of the Dockerfiles and docker/ (the entrypoints) as a
# label: the container tests rebuild when it differs (tests/containers/conftest.py).
docker_key=$(cat Dockerfile Dockerfile.gpu docker/* | sha256sum | cut -d' ' -f1)
wheels="$(cat wheelhouse/.deps-key)/$(cat wheelhouse/.code-key)/$docker_key"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
args=(--build-arg "BASE_IMAGE=$base" --label "org.opencontainers.image.revision=$revision"
  --label "org.opencontainers.image.version=$version" --label "org.hypha.wheels=$wheels")
# The classic builder sends the whole context on every build: the images get a
# context without the torch wheels (hard links, 40 MB instead of 2.6 GB), the
# GPU image none at all. Layers are cached by content, so they are shared.
ctx=$(mktemp -d)
server=
cleanup() {
  [ -z "$server" ] || kill "$server" 2>/dev/null || true
  rm -rf "$ctx"
}
trap cleanup EXIT
mkdir -p "$ctx/wheelhouse"
cp -rl wheelhouse/core wheelhouse/hypha "$ctx/wheelhouse/" 2>/dev/null \
  || cp -r wheelhouse/core wheelhouse/hypha "$ctx/wheelhouse/"
cp -r docker "$ctx/"
# The worker's dependencies come over the host's loopback (Dockerfile, WHEELS): a
# fixed port, because the URL is part of the layer's cache key; another free one
# (and a rebuilt layer) only when that one is taken.
serve_wheels() {
  local py=${PYTHON:-$PWD/.venv/bin/python} port=${HYPHA_WHEELS_PORT:-38641}
  [ -x "$py" ] || py=python3
  if ! "$py" -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$port" 2>/dev/null; then
    port=$("$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    echo "images: port ${HYPHA_WHEELS_PORT:-38641} is taken; serving the wheels on $port (the worker's dependency layer rebuilds)" >&2
  fi
  "$py" -m http.server --bind 127.0.0.1 --directory wheelhouse "$port" >/dev/null 2>&1 &
  server=$!
  wheels_url=http://127.0.0.1:$port
  "$py" - "$wheels_url/worker.txt" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 30
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2).read()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"images: the wheel server did not answer at {sys.argv[1]}")
        time.sleep(0.2)
PY
}
for image in ${HYPHA_IMAGES:-core worker worker-gpu}; do
  start=$SECONDS
  case $image in
    core) docker build -q "${args[@]}" --target core -t "hypha-core:$tag" -f Dockerfile "$ctx" >/dev/null ;;
    worker)
      [ -n "$server" ] || serve_wheels
      docker build -q "${args[@]}" --network host --build-arg "WHEELS=$wheels_url" \
        --build-arg "WHEELS_KEY=$(cat wheelhouse/.deps-key)" \
        --target worker -t "hypha-worker:$tag" -f Dockerfile "$ctx" >/dev/null ;;
    worker-gpu) docker build -q "${args[@]}" --build-arg "WORKER_IMAGE=hypha-worker:$tag" \
      -t "hypha-worker-gpu:$tag" - <Dockerfile.gpu >/dev/null ;;
    *) echo "unknown image $image" >&2; exit 2 ;;
  esac
  size=$(docker image inspect -f '{{.Size}}' "hypha-$image:$tag" | awk '{printf "%.0f MB", $1/1e6}')
  echo "hypha-$image:$tag built in $((SECONDS - start)) s ($size)"
done
