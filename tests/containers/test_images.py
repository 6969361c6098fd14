"""The images themselves: what they hold, who they run as, and the GPU worker on a host without a GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from testcontainers.core.container import DockerContainer

from hypha.testing.compose import eventually
from tests.conftest import Pki

pytestmark = pytest.mark.timeout(600)


def _run(image: str, *command: str) -> str:
    out = subprocess.run(
        ["docker", "run", "--rm", image, *command], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_core_image_has_no_torch_and_runs_unprivileged(images: None) -> None:
    out = _run(
        "hypha-core:latest",
        "python3",
        "-c",
        "import importlib.util as u, os, json; "
        "print(json.dumps({'torch': u.find_spec('torch') is not None, 'uid': os.getuid()}))",
    )
    assert json.loads(out) == {"torch": False, "uid": 10001}
    for cli in ("hypha-gateway", "hypha-scheduler", "hypha-data", "hypha", "hypha-certutil"):
        _run("hypha-core:latest", cli, "--help")


def test_gpu_image_has_cuda_torch_and_its_worker_reports_no_gpu_here(
    images: None, pki: Pki, tmp_path: Path
) -> None:
    out = _run("hypha-worker-gpu:latest", "python3", "-c", "import torch; print(torch.version.cuda)")
    assert out.strip() not in ("", "None")
    certs = tmp_path / "certs"
    certs.mkdir()
    for part in ("cert", "key", "trust"):
        copy = certs / f"worker-{part}.pem"
        shutil.copyfile(pki.dir / f"worker-{part}.pem", copy)
        copy.chmod(0o644)  # the image's user reads it through the bind mount
    worker = (
        DockerContainer("hypha-worker-gpu:latest")
        .with_command("worker")
        .with_volume_mapping(str(certs), "/certs", "ro")
        .with_env("HYPHA_NET__GATEWAYS", '["127.0.0.1:1"]')
    )
    with worker:

        def capacity() -> str | None:
            stdout, stderr = worker.get_logs()
            lines = (stdout + stderr).decode(errors="replace").splitlines()
            return next((line for line in lines if "capacity:" in line), None)

        line = eventually(capacity, 120, "the worker's capacity line")
        assert "gpu=0" in line.replace(" ", ""), line
