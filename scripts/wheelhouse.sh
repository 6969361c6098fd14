#!/usr/bin/env bash
# Prepare the wheels the images install with `pip install --no-index`, so a
# docker build needs no network and a code change rebuilds only the last layer.
#
#   wheelhouse/core/   what the core library and the slim roles need (no torch)
#   wheelhouse/torch/  what hypha-ml[torch] adds: torch 2.13.0 (PyPI's CUDA build)
#                      with its nvidia-* runtime wheels, transformers, ...
#   wheelhouse/hypha/  our own distributions (hypha-ml, hypha-ml-<role>)
#
# Versions come from constraints.txt. The dependency sets are rebuilt only
# when constraints.txt or a pyproject.toml changes (key in .deps-key); pip
# takes them from its cache after the first download, so torch is fetched
# once per machine. Our own wheels are rebuilt when a file under libs/ or
# services/ changes, reproducibly (SOURCE_DATE_EPOCH), so unchanged code
# gives byte-identical wheels and the image's code layer stays cached.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$PWD/.venv/bin/python}
out=wheelhouse
pip=("$py" -m pip --disable-pip-version-check)
roles=(services/gateway services/scheduler services/data services/client services/worker)

# Builds run in a scratch copy: pip builds a local project in place, which
# would leave build/ and egg-info beside the code.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
tar -C . --exclude=__pycache__ --exclude='*.egg-info' --exclude=build -c pyproject.toml README.md libs services \
  | tar -C "$scratch" -x
here=$PWD

deps_key=$(cat scripts/wheelhouse.sh constraints.txt pyproject.toml services/*/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$out/.deps-key" 2>/dev/null)" != "$deps_key" ]; then
  echo "wheelhouse: dependencies (constraints.txt changed or first run) ..."
  rm -rf "$out/core" "$out/torch" "$out/.deps-key"
  mkdir -p "$out/core" "$out/torch"
  (cd "$scratch" && "${pip[@]}" wheel --quiet -c "$here/constraints.txt" -w "$here/$out/core" \
    . services/gateway services/scheduler services/data services/client)
  # The worker's own dependencies (landlockpy) go with torch: only the worker image installs them.
  (cd "$scratch" && "${pip[@]}" wheel --quiet -c "$here/constraints.txt" -w "$here/$out/torch" \
    --find-links "$here/$out/core" '.[torch]' services/worker)
  rm -f "$out"/core/hypha_ml*.whl "$out"/torch/hypha_ml*.whl
  for f in "$out"/core/*.whl; do rm -f "$out/torch/$(basename "$f")"; done
  rm -f "$out/worker.txt"
  echo "$deps_key" >"$out/.deps-key"
fi
# What the worker image installs (Dockerfile, WHEELS): every dependency wheel, as name==version.
if [ ! -s "$out/worker.txt" ]; then
  for f in "$out"/core/*.whl "$out"/torch/*.whl; do
    basename "$f" | awk -F- '{print $1 "==" $2}'
  done | sort >"$out/worker.txt"
fi

# libs/testing (the tests' harness, hypha-ml-testing) is in no image: a change to it rebuilds nothing.
code_key=$(find libs services -type f ! -path 'libs/testing/*' ! -path '*/__pycache__/*' ! -path '*/build/*' \
  ! -path '*.egg-info/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat "$out/.code-key" 2>/dev/null)" != "$code_key" ] || ! ls "$out"/hypha/*.whl >/dev/null 2>&1; then
  echo "wheelhouse: our distributions ..."
  rm -rf "$out/hypha" && mkdir -p "$out/hypha"
  (cd "$scratch" && SOURCE_DATE_EPOCH=315532800 "${pip[@]}" wheel --quiet --no-deps --no-build-isolation \
    -w "$here/$out/hypha" . "${roles[@]}")
  echo "$code_key" >"$out/.code-key"
fi
du -sh "$out"/core "$out"/torch "$out"/hypha | sed 's/^/wheelhouse: /'
