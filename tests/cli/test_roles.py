"""Every role's CLI: init -> run -> probe round trip, with real processes and TLS."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Pki
from tests.helpers import NodeProcess, cli

ROLE_CLIS = {
    "gateway": "hypha-gateway",
    "scheduler": "hypha-scheduler",
    "worker": "hypha-worker",
    "data": "hypha-data",
}


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("role", sorted(ROLE_CLIS))
def test_init_run_probe_round_trip(role: str, pki: Pki, foreign_pki: Pki, tmp_path: Path) -> None:
    prog = cli(ROLE_CLIS[role])
    config = tmp_path / f"{role}.toml"
    made = run_cli(*prog, "init", "--name", role, "--certs", str(pki.dir), "--out", str(config))
    assert made.returncode == 0, made.stderr
    text = config.read_text()
    assert "[tls]" in text and "# " in text  # documented, not bare

    node = NodeProcess([*prog, "run", "--config", str(config)], tmp_path, role)
    try:
        info = node.wait_ready()
        assert info["role"] == role
        ok = run_cli(
            *cli("hypha-gateway"), "probe", node.address, "--certs", str(pki.dir), "--name", "client"
        )
        assert ok.returncode == 0, ok.stderr
        assert "SERVING" in ok.stdout
        bad = run_cli(
            *cli("hypha-gateway"), "probe", node.address, "--certs", str(foreign_pki.dir), "--name", "client"
        )
        assert bad.returncode == 1
        assert "unhealthy" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    finally:
        assert node.stop() == 0, node.log()


def test_run_with_a_config_error_names_the_key_without_traceback(pki: Pki, tmp_path: Path) -> None:
    prog = cli("hypha-gateway")
    config = tmp_path / "gw.toml"
    assert (
        run_cli(*prog, "init", "--name", "gateway", "--certs", str(pki.dir), "--out", str(config)).returncode
        == 0
    )
    config.write_text(config.read_text() + "\n[bogus]\nkey = 1\n")
    res = run_cli(*prog, "run", "--config", str(config))
    assert res.returncode == 2
    assert "bogus" in res.stderr and str(config) in res.stderr
    assert "Traceback" not in res.stderr


def _file_size_limit(limit: int) -> Callable[[], None]:
    """A child's setup: writes past ``limit`` bytes fail (EFBIG), like a disk filling up midway."""

    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return setup


def test_an_init_interrupted_midway_leaves_the_previous_config(pki: Pki, tmp_path: Path) -> None:
    # Prepare: a working config, and a second one that would replace it (--force)
    prog = cli("hypha-gateway")
    config = tmp_path / "gw.toml"
    made = run_cli(*prog, "init", "--name", "gateway", "--certs", str(pki.dir), "--out", str(config))
    assert made.returncode == 0, made.stderr
    before = config.read_bytes()

    # Execute: the disk "fills up" halfway through writing the new file
    argv = [*prog, "init", "--name", "gateway", "--certs", str(pki.dir), "--out", str(config), "--force"]
    res = subprocess.run(
        [*argv, "--listen", "127.0.0.1:7999"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        preexec_fn=_file_size_limit(len(before) // 2),
    )

    # Assert: the write failed, and the previous config is whole and alone in its directory
    assert res.returncode != 0
    assert "File too large" in res.stderr
    assert config.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["gw.toml"]


def test_run_refuses_a_certificate_of_another_role(pki: Pki, tmp_path: Path) -> None:
    config = tmp_path / "gw.toml"
    made = run_cli(
        *cli("hypha-gateway"), "init", "--name", "worker", "--certs", str(pki.dir), "--out", str(config)
    )
    assert made.returncode == 0
    res = run_cli(*cli("hypha-gateway"), "run", "--config", str(config))
    assert res.returncode == 2
    assert "role is worker" in res.stderr


def test_probe_of_nothing_listening_fails_with_one_line(pki: Pki) -> None:
    res = run_cli(
        *cli("hypha-worker"),
        "probe",
        "127.0.0.1:1",
        "--certs",
        str(pki.dir),
        "--name",
        "client",
        "--timeout",
        "2",
    )
    assert res.returncode == 1
    assert len(res.stderr.strip().splitlines()) == 1
