# Hypha images. Build the wheels on the host first (scripts/wheelhouse.sh):
# nothing is downloaded from beyond the host during the build, and a code change
# rebuilds only the last layers of each image. scripts/images.sh does all of it.
#
#   docker build --target core -t hypha-core .     # gateway, scheduler, data node, client CLI, certutil (no torch)
#   python3 -m http.server -b 127.0.0.1 -d wheelhouse 38641 &
#   docker build --network host --build-arg WHEELS=http://127.0.0.1:38641 \
#     --target worker -t hypha-worker .            # the worker, with torch (WHEELS: below)
#
# BASE_IMAGE: python:3.11-slim-bookworm, or where no registry is reachable the
# stand-in scripts/base-image.sh builds from Debian's packages.
# Conventions (user, ports, mounts, env): docs/containers.md.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
ENV LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/hypha \
    PATH=/opt/hypha/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# What every image shares: the unprivileged user, the mount points, the scripts.
# hypha-node needs flock (a worker's identity lock) and setpriv (a container
# started as root drops to uid 10001 with it), both util-linux: the build checks.
FROM base AS runtime
LABEL org.opencontainers.image.vendor="hypha" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.documentation="docs/containers.md"
RUN groupadd --system --gid 10001 hypha \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/hypha --create-home --shell /usr/sbin/nologin hypha \
 && mkdir -p /certs /data /models /state \
 && chown hypha:hypha /data /models /state \
 && setpriv --version >/dev/null && flock --version >/dev/null
WORKDIR /var/lib/hypha
STOPSIGNAL SIGTERM
# Exit 0 = the node in this container answers its gRPC health check over mTLS.
HEALTHCHECK --interval=15s --timeout=30s --start-period=300s --retries=4 CMD ["hypha-node", "healthcheck"]
ENTRYPOINT ["hypha-node"]

# ---- core: no torch ---------------------------------------------------------
FROM base AS core-deps
COPY wheelhouse/core/ /wheels/core/
RUN python3 -m venv /opt/hypha \
 && pip install --no-index --find-links /wheels/core /wheels/core/*.whl

FROM runtime AS core
COPY --from=core-deps /opt/hypha /opt/hypha
COPY wheelhouse/hypha/ docker/ /build/
RUN pip install --no-index --no-deps /build/hypha_ml-*.whl /build/hypha_ml_gateway-*.whl \
      /build/hypha_ml_scheduler-*.whl /build/hypha_ml_data-*.whl /build/hypha_ml_client-*.whl \
 && pip check \
 && python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
 && install -m 0755 /build/hypha-node /build/hypha-pki /usr/local/bin/ && rm -rf /build
USER hypha
CMD ["gateway"]
# scripts/images.sh adds version, revision and org.hypha.wheels with --label,
# which leaves every cached layer valid.
LABEL org.opencontainers.image.title="hypha-core" \
      org.opencontainers.image.description="Hypha gateway, scheduler, data node, client CLI and certutil (no torch)"

# ---- worker: torch ----------------------------------------------------------
# PyPI's torch 2.13.0 is the CUDA build: it needs its nvidia-* wheels even to
# import on a CPU (measured), so they are in this image too; it runs on CPUs
# and, with the NVIDIA runtime, on GPUs (Dockerfile.gpu adds the settings).
#
# Its ~2.6 GB of wheels are not in the build context: the classic builder would
# send them, COPY them into a layer and copy the ~5 GB venv out of a builder
# stage, each step costing more than the install itself. scripts/images.sh
# serves wheelhouse/ on the host's loopback for the build (--network host):
# WHEELS is that URL (any page listing the wheels will do), WHEELS_KEY the
# wheelhouse's dependency key, so new dependencies make a new layer.
FROM runtime AS worker
ARG WHEELS
ARG WHEELS_KEY
RUN test -n "$WHEELS" || { echo "build arg WHEELS: the URL of the wheelhouse (scripts/images.sh serves it)" >&2; exit 1; } \
 && echo "wheelhouse $WHEELS_KEY" \
 && python3 -m venv /opt/hypha \
 && pip install --no-index --find-links "$WHEELS/core/" --find-links "$WHEELS/torch/" -r "$WHEELS/worker.txt"
COPY wheelhouse/hypha/ docker/ /build/
RUN pip install --no-index --no-deps /build/hypha_ml-*.whl /build/hypha_ml_worker-*.whl \
 && pip check \
 && install -m 0755 /build/hypha-node /build/hypha-pki /usr/local/bin/ && rm -rf /build
USER hypha
CMD ["worker"]
LABEL org.opencontainers.image.title="hypha-worker" \
      org.opencontainers.image.description="Hypha worker: DiLoCo trainer, parameter server and task executors (torch)"
