"""Executors die with their worker, and a restarted worker kills what a dead one left behind.

A worker killed with SIGKILL cleans nothing up; before this, its executors
kept running (and a restarted worker handed their GPU slots out again). Now
bubblewrap's ``--die-with-parent`` and the parent-death signal the launcher
(``hypha.worker.confine``) sets in every mode end them, and what escaped
anyway (a process that left the group with ``setsid``) is killed by the next
``JobManager.start()`` before it accepts jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.sandbox import landlock_abi
from hypha.worker.transfer import TensorExchange
from tests.helpers import eventually
from tests.worker.fakes import FakeSchedulerLink, job_processes

pytestmark = pytest.mark.timeout(60)

needs_landlock = pytest.mark.skipif(not landlock_abi(), reason="needs a kernel with Landlock")

REPO = Path(__file__).resolve().parents[2]

#: A worker's job manager in a process of its own, running one task until it is killed.
_WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from hypha.worker.job_manager import JobManager
    from hypha.worker.jobs_config import JobsSection
    from hypha.worker.transfer import TensorExchange
    from tests.worker.fakes import FakeSchedulerLink, python_task

    async def main(root: str, sandbox: str, code: str) -> None:
        link = FakeSchedulerLink()
        jobs = JobManager(
            JobsSection(sandbox=sandbox), Path(root), exchange=TensorExchange(None),
            link_factory=lambda dispatch: link, cpu_count=1,
        )
        async with jobs:
            await jobs.dispatch(python_task("long", code))
            await asyncio.Event().wait()

    asyncio.run(main(*sys.argv[1:]))
    """
)

#: Marks its work dir once the task's own code runs: the sandbox is set up by then, its
#: die-with-parent armed (a worker killed while bwrap is still starting is the restart
#: sweep's case, not this test's).
_SLEEPER = "import time; open('task-started', 'w').close(); time.sleep(120)"
#: Leaves a process outside the group (its own session), as a careless or hostile job might.
_ESCAPER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
    "time.sleep(120)"
)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    for pid in job_processes(tmp_path / "work"):  # whatever a failing test left
        os.kill(pid, signal.SIGKILL)


def _start(
    started: list[subprocess.Popen[bytes]], root: Path, sandbox: str, code: str
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root), sandbox, code], cwd=REPO)
    started.append(proc)
    return proc


@pytest.mark.parametrize("sandbox", ["auto", pytest.param("landlock", marks=needs_landlock), "none"])
async def test_executors_die_when_their_worker_is_killed(
    worker: list[subprocess.Popen[bytes]], tmp_path: Path, sandbox: str
) -> None:
    # Prepare: a worker running a task
    root = tmp_path / "work"
    proc = _start(worker, root, sandbox, _SLEEPER)
    await eventually(
        lambda: job_processes(root) and any(root.rglob("task-started")), timeout=30, message="the task runs"
    )

    # Execute: the worker dies without cleaning up
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)

    # Assert: nothing of the job is left
    # NOTE: polled every 0.5 s: scanning every process's environ every 20 ms was seen to keep
    # a sandboxed task's pid namespace from being torn down within 10 s.
    await eventually(
        lambda: not job_processes(root), timeout=30, interval=0.5, message="the task died with its worker"
    )


async def test_a_restarted_worker_kills_what_escaped_before_accepting_jobs(
    worker: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    # Prepare: an unconfined task left a process in a session of its own; its worker was SIGKILLed
    root = tmp_path / "work"
    proc = _start(worker, root, "none", _ESCAPER)
    await eventually(lambda: len(job_processes(root)) >= 2, timeout=30, message="task and escapee run")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    await eventually(
        lambda: len(job_processes(root)) == 1, timeout=10, message="the task died with its worker"
    )

    # Execute: the worker starts again on the same work root
    link = FakeSchedulerLink()
    restarted = JobManager(
        JobsSection(sandbox="none"),
        root,
        exchange=TensorExchange(None),
        link_factory=lambda d: link,
        cpu_count=1,
    )
    async with restarted:
        # Assert: the escapee is gone by the time it accepts jobs
        await eventually(lambda: not job_processes(root), timeout=5, message="the escapee was killed")
