"""The real images and the real docker-compose.yml, driven through testcontainers.

One compose project is shared by every test that uses ``cluster``, across
modules (a cluster takes about a minute to come up on 2 cores). Without Docker (or
Compose v2, which testcontainers drives) the tests skip with the reason;
with ``CI=true`` that is a failure instead. The images are built by
``scripts/images.sh`` (CI runs it first); the session fixture rebuilds them
only when the wheelhouse's inputs, the Dockerfiles or docker/ changed, so the
layer cache keeps it short.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.testing.compose import ROOT, Cluster, compose_v2, docker_ok

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # the reaper image cannot be pulled here

IMAGES = ("hypha-core", "hypha-worker", "hypha-worker-gpu")


def _unavailable() -> str | None:
    if not docker_ok():
        return "Docker is not available (docker info failed)"
    if not compose_v2():
        return "Compose v2 (`docker compose`) is missing: run scripts/compose-plugin.sh"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(str(item.fspath)).parents]
    if not ours:
        return
    reason = _unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        # In CI these tests must run: a missing Docker is a failure, not a skip.
        for item in ours:
            item.add_marker(pytest.mark.usefixtures("_docker_required_in_ci"))
        return
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def _docker_required_in_ci() -> None:
    pytest.fail(f"CI=true and the container tests cannot run: {_unavailable()}")


@pytest.fixture(scope="session")
def images() -> None:
    """The images, current with the code: scripts/images.sh when the wheelhouse or docker/ changed."""
    keys = _wheelhouse_keys()
    labels = [_image_label(f"{name}:latest") for name in IMAGES]
    if all(label == keys for label in labels):
        return
    subprocess.run(["bash", "scripts/images.sh"], cwd=ROOT, check=True, timeout=3600)


def _wheelhouse_keys() -> str:
    """The label scripts/images.sh gives images: wheelhouse keys, Dockerfiles' and docker/'s digest."""
    subprocess.run(["bash", "scripts/wheelhouse.sh"], cwd=ROOT, check=True, capture_output=True, timeout=3600)
    house = ROOT / "wheelhouse"
    files = [ROOT / "Dockerfile", ROOT / "Dockerfile.gpu", *sorted((ROOT / "docker").iterdir())]
    docker = hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()
    return f"{(house / '.deps-key').read_text().strip()}/{(house / '.code-key').read_text().strip()}/{docker}"


def _image_label(image: str) -> str:
    out = subprocess.run(
        ["docker", "image", "inspect", "-f", '{{index .Config.Labels "org.hypha.wheels"}}', image],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else ""


@pytest.fixture(scope="session")
def cluster(images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A compose cluster with 4 workers and a relay-only worker, down (with its volumes) afterwards."""
    with Cluster.up(tmp_path_factory.mktemp("compose"), workers=4, profiles=["relay"]) as running:
        yield running
