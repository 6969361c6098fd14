"""The worker's directories on disk: one private work dir per job, kept results, the sweep.

Layout under the work root (all 0700)::

    jobs/<job>.<executor>/      the execution's cwd, HYPHA_WORK_DIR (tmp/ inside is its TMPDIR)
    results/<job>/<executor>/   the result dir an execution named, moved here when it ends

A work dir is reused by a later attempt of the same job, so checkpoints
survive a restart; ``cleanup`` decides whether it goes when the execution
ends, and the sweep removes what was kept once it is older than ``retain_s``.
Everything here is blocking file-system work: callers run it in a thread.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import Literal

CleanupPolicy = Literal["always", "on_success", "never"]


class WorkDirs:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.jobs_dir = self.root / "jobs"
        self.results_dir = self.root / "results"

    def create(self) -> None:
        """Create (or tighten to 0700) the root and its two folders."""
        for folder in (self.root, self.jobs_dir, self.results_dir):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)

    def job_dir(self, job_id: str, executor: str) -> Path:
        return self.jobs_dir / f"{job_id}.{executor}"

    @staticmethod
    def make_private(path: Path) -> None:
        """Create the work dir (0700) and its tmp/; a reused one counts as fresh for the sweep."""
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        (path / "tmp").mkdir(exist_ok=True, mode=0o700)
        os.utime(path)

    def keep_result(self, source: Path, job_id: str, executor: str) -> Path:
        """Move an execution's result dir to ``results/<job>/<executor>`` (replacing an older one)."""
        target = self.results_dir / job_id / executor
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
        return target

    @staticmethod
    def clean(work_dir: Path, policy: CleanupPolicy, succeeded: bool) -> None:
        """Remove an ended execution's work dir if the policy says so."""
        if policy == "always" or (policy == "on_success" and succeeded):
            shutil.rmtree(work_dir, ignore_errors=True)

    def sweep(self, retain_s: float, busy: Collection[Path] = ()) -> None:
        """Remove kept work dirs and results older than ``retain_s`` (not ``busy`` ones, nor a
        warm executor's dot-dir: ``warm_executor`` looks after those)."""
        cutoff = time.time() - retain_s
        for folder in (self.jobs_dir, self.results_dir):
            for path in folder.iterdir() if folder.is_dir() else ():
                try:
                    if path in busy or path.name.startswith("."):
                        continue
                    if path.stat().st_mtime < cutoff:
                        shutil.rmtree(path, ignore_errors=True)
                except OSError:
                    continue


__all__ = ["CleanupPolicy", "WorkDirs"]
