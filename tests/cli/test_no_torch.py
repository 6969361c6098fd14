"""The gateway and scheduler processes, and every role's probe, never load torch (issue 11: slim core images).

A gateway or scheduler container is built without torch; if one of their
import chains reached torch (``hypha.tensors.payload``, the model factories,
the dataset preparation), the image would fail at start. Checked on real
processes: ``/proc/<pid>/maps`` lists every shared object the process mapped
(libtorch is a native library, so any ``import torch`` maps it), and
``PYTHONPROFILEIMPORTTIME`` makes the interpreter itself log every module it
imports, which catches the pure-Python ``transformers`` too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Pki
from tests.helpers import NodeProcess, cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")

#: Top-level packages that only training and model loading may import.
HEAVY = ("torch", "transformers", "safetensors", "huggingface_hub")

#: One ``-X importtime`` line: ``import time: self | cumulative | <indent>module``.
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$")


def _init(prog: list[str], name: str, pki: Pki, out: Path, *extra: str) -> None:
    made = subprocess.run(
        [*prog, "init", "--name", name, "--certs", str(pki.dir), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr


def _mapped_libraries(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6}


def _imported_roots(log: str) -> set[str]:
    return {match.group(1).split(".")[0] for match in map(_IMPORT_LINE.match, log.splitlines()) if match}


def test_gateway_and_scheduler_processes_and_a_worker_probe_load_no_torch(pki: Pki, tmp_path: Path) -> None:
    env = {"PYTHONPROFILEIMPORTTIME": "1", "HF_HUB_OFFLINE": "1"}
    gateway_cfg, scheduler_cfg = tmp_path / "gateway.toml", tmp_path / "scheduler.toml"
    _init(cli("hypha-gateway"), "gateway", pki, gateway_cfg)
    gateway = NodeProcess(
        [*cli("hypha-gateway"), "run", "--config", str(gateway_cfg)], tmp_path, "gateway", env
    )
    nodes = [gateway]
    try:
        gateway.wait_ready()
        _init(cli("hypha-scheduler"), "scheduler", pki, scheduler_cfg, "--gateway", gateway.address)
        # The REST mirror on too: every part the scheduler can start is imported and running.
        scheduler_env = {**env, "HYPHA_SCHEDULER__REST_LISTEN": "127.0.0.1:0"}
        scheduler = NodeProcess(
            [*cli("hypha-scheduler"), "run", "--config", str(scheduler_cfg)],
            tmp_path,
            "scheduler",
            scheduler_env,
        )
        nodes.append(scheduler)
        assert "rest" in scheduler.wait_ready()
        for node in nodes:
            libraries = _mapped_libraries(node.proc.pid)
            assert any("libpython" in lib or "python3" in lib for lib in libraries), (
                libraries
            )  # maps was read
            torch_libs = sorted(lib for lib in libraries if "libtorch" in Path(lib).name)
            assert not torch_libs, f"{node.log_path.stem} mapped {torch_libs}"
            roots = _imported_roots(node.log())
            assert "hypha" in roots, "the import log was not written"  # the check below can see imports
            heavy = sorted(roots.intersection(HEAVY))
            assert not heavy, f"{node.log_path.stem} imported {heavy}"
        # A container's healthcheck runs ``hypha-<role> probe`` every few seconds: a worker's too must
        # not load the role's modules (torch: seconds of CPU each time).
        probe = subprocess.run(
            [*cli("hypha-worker"), "probe", gateway.address, "--certs", str(pki.dir), "--name", "gateway"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert probe.returncode == 0, probe.stderr
        roots = _imported_roots(probe.stderr)
        assert "hypha" in roots and not roots.intersection(HEAVY), sorted(roots)
        assert not any(line.strip().endswith("hypha.worker.app") for line in probe.stderr.splitlines())
    finally:
        for node in reversed(nodes):
            assert node.stop() == 0, node.log()
