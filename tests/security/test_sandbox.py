"""Choosing the sandbox: ``auto`` never silently means unconfined, and the mounts hide the worker's files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hypha.errors import ConfigError
from hypha.worker.sandbox import Sandbox, resolve


@pytest.mark.parametrize("mode", ["auto", "bwrap"])
def test_without_bubblewrap_the_worker_refuses_to_start_and_says_how_to_go_on(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found

    with pytest.raises(ConfigError) as err:
        resolve(mode)  # type: ignore[arg-type]

    assert "bubblewrap" in err.value.message and "sandbox = 'none'" in err.value.message


def test_none_is_taken_only_when_asked_for() -> None:
    assert resolve("none").mode == "none"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (scripts/system-deps.sh)")
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
    )
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")

    # Assert: the tool is there, the key dir is empty, what was not bound is absent
    assert out[:3] == ["visible", "[]", "False"]
