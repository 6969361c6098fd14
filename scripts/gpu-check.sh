#!/usr/bin/env bash
# The GPU check of issue 33 (docs/gpu.md): one prepared, bounded run on a machine lent a GPU.
#
#   scripts/gpu-check.sh --prepare     here, with network: the py3.12 wheels the GPU machine lacks and
#                                      our own distributions, into wheelhouse/gpu-py312/ (< 64 MiB)
#   scripts/gpu-check.sh --out DIR     on the GPU machine, no network: install those wheels into a
#                                      target dir beside the machine's own CUDA torch (never touching
#                                      it), then run scripts/gpu_check.py (cluster, demo, task, benchmarks)
#   scripts/gpu-check.sh --cpu --out DIR   the same run without a GPU, from .venv (the suite runs it)
#
# Extra arguments after the mode go to scripts/gpu_check.py (--rounds N, --benchmarks a,b).
set -euo pipefail
cd "$(dirname "$0")/.."
house=wheelhouse/gpu-py312
# What our distributions need that the GPU machine may lack (it has torch, transformers, safetensors,
# grpcio, protobuf, aiohttp, msgpack, prometheus-client, rich, matplotlib, psutil, uvloop; grpcio and
# protobuf come along as dependencies anyway, pinned like ours). Versions: constraints.txt.
third_party=(
  grpcio-health-checking grpcio-reflection kademlia msgpack cryptography pydantic pydantic-settings
  opentelemetry-api opentelemetry-sdk opentelemetry-instrumentation-grpc opentelemetry-exporter-otlp-proto-grpc
  aiohttp prometheus-client landlockpy
)
# Our distributions: installed with --no-deps, so their torch pin never reaches the host's torch.
# hypha-ml-testing: the harness the benchmarks import (hypha.testing).
ours=(hypha-ml hypha-ml-gateway hypha-ml-scheduler hypha-ml-data hypha-ml-client hypha-ml-worker hypha-ml-testing)

prepare() {
  local py=${PYTHON:-$PWD/.venv/bin/python}
  local pip=("$py" -m pip --disable-pip-version-check)
  rm -rf "$house" && mkdir -p "$house"
  "${pip[@]}" download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -c constraints.txt -d "$house" "${third_party[@]}"
  # cryptography's newest wheel wants glibc 2.34; its 2.28 one too, for an older GPU host (pip picks).
  "${pip[@]}" download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 \
    --platform manylinux_2_28_x86_64 --no-deps -c constraints.txt -d "$house" cryptography
  # Built from a scratch copy: pip builds a local project in place (build/, egg-info beside the code).
  local scratch
  scratch=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: the trap must remove this very dir
  trap "rm -rf '$scratch'" EXIT
  tar -C . --exclude=__pycache__ --exclude='*.egg-info' --exclude=build -c pyproject.toml README.md libs services \
    | tar -C "$scratch" -x
  local here=$PWD
  (cd "$scratch" && "${pip[@]}" wheel --quiet --no-deps --no-build-isolation -w "$here/$house" \
    . services/gateway services/scheduler services/data services/client services/worker libs/testing)
  local bytes
  bytes=$(du -sb "$house" | cut -f1)
  echo "gpu-check: $(find "$house" -name '*.whl' | wc -l) wheels, $((bytes / 1048576)) MiB in $house"
  if [ "$bytes" -ge $((64 * 1048576)) ]; then
    echo "gpu-check: $house is over the 64 MiB a device run carries" >&2
    exit 1
  fi
}

install_target() {
  # The machine's python3 with its CUDA torch; ours beside it in a target dir put first on PYTHONPATH.
  local target=$1
  if [ ! -d "$house" ]; then
    echo "gpu-check: no $house (run scripts/gpu-check.sh --prepare where there is network)" >&2
    exit 2
  fi
  local pip=(python3 -m pip --disable-pip-version-check install --quiet --no-index --find-links "$house"
    --target "$target")
  timeout 180 "${pip[@]}" -c constraints.txt "${third_party[@]}"
  # --upgrade: the second install into one target replaces its bin/ (else our CLIs are left out).
  timeout 120 "${pip[@]}" --upgrade --no-deps "${ours[@]}"
}

mode=gpu
out=
while [ $# -gt 0 ]; do
  case $1 in
    --prepare) mode=prepare; shift ;;
    --cpu) mode=cpu; shift ;;
    --out) out=$2; shift 2 ;;
    *) break ;;
  esac
done

case $mode in
  prepare) prepare ;;
  cpu)
    [ -n "$out" ] || { echo "gpu-check: --out DIR is required" >&2; exit 2; }
    exec "${PYTHON:-$PWD/.venv/bin/python}" scripts/gpu_check.py --cpu --out "$out" "$@"
    ;;
  gpu)
    [ -n "$out" ] || { echo "gpu-check: --out DIR is required" >&2; exit 2; }
    mkdir -p "$out"
    target=$(mktemp -d)/site
    install_target "$target" 2>&1 | tee "$out/install.log"
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$target/bin:$PATH"
    # The whole run stays under 8 minutes; each step has its own, shorter bound inside.
    exec timeout -k 20 450 python3 scripts/gpu_check.py --out "$out" "$@"
    ;;
esac
