"""A job is held to the memory and disk its lease grants; the worker and its other jobs are not touched.

Real task jobs through the job manager (real sandboxed subprocesses): one
that allocates past its memory lease, one that writes past its storage lease.
Each fails with what it used and what it was granted, while a job beside it
keeps running and the next job runs as usual. The measurements and the
decision underneath are tested on their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hypha.market.resources import Resources
from hypha.worker.execution_state import ExecutionRecord, ExecutionState, StopCause
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.lease_limits import Bound, lease_bounds, work_dir_bytes
from hypha.worker.process_group import group_members, group_rss
from hypha.worker.resources import GIB
from hypha.worker.transfer import TensorExchange
from tests.helpers import eventually
from tests.worker.fakes import FakeSchedulerLink, python_task

pytestmark = pytest.mark.timeout(90)

MB = 1 << 20

#: What each lease of the tests grants, by lease id.
GRANTS = {
    "small-memory": Resources(cpu=1, memory_gb=0.2),
    "small-disk": Resources(cpu=1, memory_gb=4, storage_gb=0.05),
    "roomy": Resources(cpu=3, memory_gb=4, storage_gb=4),
}

_HOG = "x = b'x' * (400 << 20); print('allocated', flush=True); import time; time.sleep(60)"
_WRITER = textwrap.dedent(
    """
    import time
    for n in range(10):  # each file under the lease (one file's size is capped at it), together over it
        with open(f'part{n}.bin', 'wb') as out:
            for _ in range(10):
                out.write(b'x' * (1 << 20))
                out.flush()
    print('written', flush=True)
    time.sleep(60)
    """
)
_SLEEP = "import time; print('up', flush=True); time.sleep(60)"


@pytest.fixture
def link() -> FakeSchedulerLink:
    return FakeSchedulerLink()


@pytest.fixture
async def manager(tmp_path: Path, link: FakeSchedulerLink) -> AsyncIterator[JobManager]:
    settings = JobsSection(stop_grace_s=1.0, memory_poll_s=0.05, disk_poll_s=0.1, cleanup="never")
    jobs = JobManager(
        settings,
        tmp_path / "work",
        exchange=TensorExchange(None),
        link_factory=lambda dispatch: link,
        cpu_count=4,
        lease_grants=GRANTS.get,
    )
    async with jobs:
        yield jobs


def _used_gb(message: str, what: str, granted: str, key: str) -> float:
    pattern = rf"used (\d+\.\d{{3}}) GB of {what}, over the {granted} GB its lease grants \({key}\)"
    found = re.search(pattern, message)
    assert found is not None, message
    return float(found.group(1))


# ---- real jobs through the job manager ----------------------------------------------------------


async def test_a_job_over_its_memory_lease_fails_and_only_it(
    manager: JobManager, link: FakeSchedulerLink
) -> None:
    await manager.dispatch(python_task("bystander", _SLEEP, lease_id="roomy"))
    await eventually(lambda: "up" in link.lines("stdout"), timeout=15)

    await manager.dispatch(python_task("hog", _HOG, lease_id="small-memory"))
    record = await manager.wait("hog", 30)

    assert record.state is ExecutionState.FAILED
    assert record.stop_cause is StopCause.OVER_LEASE
    used = _used_gb(record.message, "memory", "0.200", "memory_gb")
    assert 0.2 < used < 0.5  # its 400 MB at most (stopped on the way, or holding them all)
    assert manager.get("bystander").state is ExecutionState.RUNNING

    await manager.dispatch(python_task("next", "print('fine')", lease_id="roomy"))
    assert (await manager.wait("next", 30)).state is ExecutionState.SUCCEEDED
    await manager.cancel("bystander", "done")
    assert (await manager.wait("bystander", 15)).state is ExecutionState.CANCELLED


async def test_a_job_over_its_storage_lease_fails_naming_it(manager: JobManager) -> None:
    await manager.dispatch(python_task("writer", _WRITER, lease_id="small-disk"))
    record = await manager.wait("writer", 30)

    assert record.state is ExecutionState.FAILED
    assert record.stop_cause is StopCause.OVER_LEASE
    used = _used_gb(record.message, "disk in its work dir", "0.050", "storage_gb")
    assert used > 0.05

    await manager.dispatch(python_task("next", "print('fine')", lease_id="roomy"))
    assert (await manager.wait("next", 30)).state is ExecutionState.SUCCEEDED


async def test_without_a_known_lease_the_job_s_own_minimum_bounds_it(
    manager: JobManager,
) -> None:
    dispatch = python_task("hog", _HOG, lease_id="unknown-here")
    dispatch.spec.task.requirements.minimum.memory_gb = 0.2
    await manager.dispatch(dispatch)
    record = await manager.wait("hog", 30)

    assert record.state is ExecutionState.FAILED
    _used_gb(record.message, "memory", "0.200", "memory_gb")


async def test_threads_follow_the_leased_cpu(manager: JobManager, tmp_path: Path) -> None:
    show = "import os; open('threads', 'w').write(os.environ['OMP_NUM_THREADS'])"
    await manager.dispatch(python_task("threads", show, lease_id="roomy"))
    await manager.wait("threads", 30)

    assert (tmp_path / "work" / "jobs" / "threads.task" / "threads").read_text() == "3"


# ---- the state it ends in -------------------------------------------------------------------------


def test_over_lease_ends_failed_with_its_reason_whatever_the_exit_code() -> None:
    record = ExecutionRecord("j", "e")
    record.spawned(1.0)
    reason = "used 1.234 GB of memory, over the 0.500 GB its lease grants (memory_gb)"

    assert record.request_stop(StopCause.OVER_LEASE, 2.0, reason)
    assert record.exited(0, 3.0) is ExecutionState.FAILED
    assert record.message == reason


# ---- bounds and measurements ------------------------------------------------------------------------


def test_a_bound_passes_up_to_its_limit_and_names_both_figures_past_it() -> None:
    bound = Bound("memory", int(0.5 * GIB), "its lease grants (memory_gb)")

    assert bound.breach(int(0.5 * GIB)) is None
    assert bound.breach(int(1.234 * GIB)) == (
        "used 1.234 GB of memory, over the 0.500 GB its lease grants (memory_gb)"
    )


def test_bounds_come_from_the_lease_then_the_default_else_none() -> None:
    leased = lease_bounds(Resources(memory_gb=2, storage_gb=10), default_memory_gb=1)
    assert leased.memory is not None and leased.memory.limit_bytes == 2 * GIB
    assert leased.disk is not None and leased.disk.limit_bytes == 10 * GIB

    defaulted = lease_bounds(Resources(cpu=1), default_memory_gb=1)
    assert defaulted.memory is not None and defaulted.memory.limit_bytes == GIB
    assert "default_memory_gb" in (defaulted.memory.breach(2 * GIB) or "")
    assert defaulted.disk is None

    assert lease_bounds(Resources(cpu=1), default_memory_gb=None).memory is None


_FAMILY = textwrap.dedent(
    """
    import subprocess, sys, time
    child = "x = b'x' * (40 << 20); print('ready', flush=True); import time; time.sleep(60)"
    kids = [subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.PIPE) for _ in range(2)]
    for kid in kids:
        kid.stdout.readline()
    x = b'x' * (40 << 20)
    print('ready', flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def family() -> Iterator[int]:
    """A process group of three, each holding 40 MB; its pgid."""
    leader = subprocess.Popen([sys.executable, "-c", _FAMILY], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert leader.stdout is not None and leader.stdout.readline() == b"ready\n"
        yield leader.pid
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)


def test_the_group_rss_is_the_sum_over_its_processes(family: int) -> None:
    members = group_members(family)
    page = os.sysconf("SC_PAGE_SIZE")
    by_statm = sum(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page for pid in members)

    used = group_rss(family)

    assert len(members) == 3
    assert used >= 3 * 40 * MB
    assert abs(used - by_statm) < 2 * MB  # the same figure the kernel gives per process


def test_the_work_dir_counts_what_its_files_take_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "job"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(2 * MB))
    os.link(root / "a.bin", root / "sub" / "same.bin")  # one file, two names
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(4 * MB))
    (root / "link").symlink_to(outside)  # not followed
    with open(root / "sparse.bin", "wb") as sparse:
        sparse.truncate(1 << 30)  # a gigabyte in size, nothing written
    hidden = root / "hidden"
    hidden.mkdir()
    (hidden / "h.bin").write_bytes(os.urandom(1 * MB))
    hidden.chmod(0)

    total = work_dir_bytes(root)

    assert 3 * MB <= total < 3 * MB + MB // 2  # a.bin once, h.bin; dirs and the link are small
