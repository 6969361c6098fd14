"""Test helpers: a fake clock, and real node processes (``eventually`` is ``hypha.testing.polling``'s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hypha.testing.polling import eventually

__all__ = ["FakeClock", "NodeProcess", "cli", "eventually", "wait_for_file"]


class FakeClock:
    """A clock a test moves by hand (``clock.now += 5``); pass it where code takes ``clock=``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_for_file(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str:
    """Block until ``path`` exists (a ready file), or the process dies, or timeout."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before writing {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not written within {timeout}s")
        time.sleep(0.02)
    return path.read_text()


class NodeProcess:
    """A role's CLI run as a real subprocess, ready when it writes its ready file."""

    def __init__(
        self,
        argv: list[str],
        workdir: Path,
        name: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.ready_file = workdir / f"{name}.ready"
        self.log_path = workdir / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [*argv, "--ready-file", str(self.ready_file)],
            # The test's own directory: defaults such as ./work-NAME land there, not in the repository.
            cwd=cwd or workdir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            self.info = json.loads(wait_for_file(self.ready_file, timeout, self.proc))
        except AssertionError as err:
            raise AssertionError(f"{err}\n--- log ---\n{self.log()}") from err
        return self.info

    @property
    def address(self) -> str:
        return str(self.info["address"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def cli(name: str) -> list[str]:
    """Argv prefix running a console script of this checkout (no PATH lookup)."""
    modules = {
        "hypha": "hypha.client.cli",
        "hypha-gateway": "hypha.gateway.cli",
        "hypha-scheduler": "hypha.scheduler.cli",
        "hypha-worker": "hypha.worker.cli",
        "hypha-data": "hypha.data.cli",
        "hypha-certutil": "hypha.pki.cli",
    }
    return [sys.executable, "-m", modules[name]]
