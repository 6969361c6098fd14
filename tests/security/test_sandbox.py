"""Choosing the sandbox: ``auto`` never silently means unconfined, and the mounts hide the worker's files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hypha.errors import ConfigError
from hypha.worker import sandbox as sandbox_module
from hypha.worker.sandbox import Sandbox, landlock_abi, resolve
from tests.helpers import cli

needs_landlock = pytest.mark.skipif(not landlock_abi(), reason="needs a kernel with Landlock")
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="needs bubblewrap (scripts/system-deps.sh)"
)


def test_without_bubblewrap_bwrap_mode_refuses_to_start_and_says_how_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found

    with pytest.raises(ConfigError) as err:
        resolve("bwrap")

    assert "bubblewrap" in err.value.message and "sandbox = 'none'" in err.value.message
    assert "'landlock'" in err.value.message


def test_auto_refuses_when_neither_bubblewrap_nor_landlock_works_and_names_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(
        sandbox_module, "probe_landlock", lambda readonly=(): "Landlock is unavailable (ABI 0)"
    )

    with pytest.raises(ConfigError) as err:
        resolve("auto")

    message = err.value.message
    assert "bubblewrap (bwrap) is not installed" in message and "Landlock is unavailable (ABI 0)" in message
    assert "sandbox = 'none'" in message


def _fake_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str | None) -> None:
    """A ``bwrap`` on PATH whose probe says ``problem`` (None: it works)."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setattr(sandbox_module, "probe_bwrap", lambda bwrap: problem)


def test_auto_picks_bubblewrap_when_it_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bwrap(tmp_path, monkeypatch, None)

    chosen = resolve("auto")

    assert chosen.mode == "bwrap" and chosen.tool == str(tmp_path / "bin" / "bwrap")


@needs_landlock
def test_auto_picks_landlock_where_bubblewrap_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_bwrap(tmp_path, monkeypatch, "bwrap failed: No permissions to create new namespace")

    chosen = resolve("auto")

    assert chosen.mode == "landlock"
    assert chosen.environment({"HOME": "/root"}, tmp_path)["HOME"] == str(tmp_path)


def test_none_is_taken_only_when_asked_for() -> None:
    assert resolve("none").mode == "none"


@needs_landlock
def test_landlock_refuses_to_start_when_a_worker_file_lies_beneath_a_granted_path(tmp_path: Path) -> None:
    # Prepare: an operator-readable dir that also holds the worker's key dir
    shared = tmp_path / "shared"
    (shared / "keys").mkdir(parents=True)

    # Execute
    with pytest.raises(ConfigError) as err:
        resolve("landlock", readonly=[shared], hidden=[tmp_path / "state", shared / "keys"])

    # Assert: the path, the grant over it and both ways out are named; a path elsewhere is no problem
    message = err.value.message
    assert f"{shared / 'keys'} lies beneath {shared}" in message
    assert str(tmp_path / "state") not in message
    assert "move them" in message and "'bwrap'" in message


@needs_landlock
def test_landlock_refuses_a_key_in_an_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The current dir on sys.path (a node started without -P) is readable to every job.
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(ConfigError) as err:
        resolve("landlock", hidden=[tmp_path / "node-key.pem"])

    assert f"{tmp_path / 'node-key.pem'} lies beneath {tmp_path}" in err.value.message


@needs_bwrap
def test_a_secret_under_a_readable_path_is_masked(tmp_path: Path) -> None:
    # Prepare: an operator-readable dir that also holds the worker's key dir
    shared = tmp_path / "shared"
    (shared / "keys").mkdir(parents=True)
    (shared / "keys" / "node-key.pem").write_text("-----BEGIN PRIVATE KEY-----")
    (shared / "tool.txt").write_text("visible")
    (tmp_path / "elsewhere.txt").write_text("not bound")
    work = tmp_path / "work"
    work.mkdir()
    sandbox = Sandbox("bwrap", shutil.which("bwrap"), readonly=(shared,), hidden=(shared / "keys",))
    probe = (
        "import os, sys; print(open(sys.argv[1]).read()); print(os.listdir(sys.argv[2]));"
        "print(os.path.exists(sys.argv[3]))"
    )

    # Execute
    argv = sandbox.wrap(
        [
            sys.executable,
            "-c",
            probe,
            str(shared / "tool.txt"),
            str(shared / "keys"),
            str(tmp_path / "elsewhere.txt"),
        ],
        work,
        network=True,
    )
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")

    # Assert: the tool is there, the key dir is empty, what was not bound is absent
    assert out[:3] == ["visible", "[]", "False"]


def test_the_worker_cli_reports_what_this_machine_offers() -> None:
    done = subprocess.run(
        [*cli("hypha-worker"), "probe", "--machine"], capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["landlock_abi"] == landlock_abi()
    works = shutil.which("bwrap") is not None and report["bwrap"] == "works"
    assert report["sandbox"] == ("bwrap" if works else "landlock" if landlock_abi() else None)
    assert report["cpu"] >= 1 and report["memory_gb"] > 0 and "gpus" in report
