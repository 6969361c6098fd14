"""The one process wrapper of the built-in executors: thread count, failure report, exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hypha.errors import NotFoundError
from hypha.worker.executors import process

pytestmark = pytest.mark.timeout(60)

_THREADS = (
    "from hypha.worker.executors.process import configure_process; import torch;"
    "configure_process(); print(torch.get_num_threads())"
)


@pytest.mark.parametrize(("value", "threads"), [("3", 3), ("", 1), ("two", 1)])
def test_the_worker_s_thread_count_applies_and_anything_unusable_means_one(value: str, threads: int) -> None:
    env = {"PATH": "/usr/bin:/bin", "HYPHA_TORCH_THREADS": value}
    done = subprocess.run(
        [sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(threads)


class _Bridge:
    def __init__(self, fail: bool = False) -> None:
        self.reported: list[tuple[str, str]] = []
        self.fail = fail

    async def status(self, state: str, message: str) -> None:
        if self.fail:
            raise OSError("bridge socket gone")
        self.reported.append((state, message))


async def test_a_failure_is_reported_with_its_message_and_exits_1() -> None:
    bridge = _Bridge()

    assert await process.report_failure(bridge, "trainer", NotFoundError("no slice 3")) == 1
    assert await process.report_failure(bridge, "trainer", ValueError("bad shape")) == 1

    assert bridge.reported == [("failed", "no slice 3"), ("failed", "ValueError: bad shape")]


async def test_a_bridge_that_cannot_take_the_report_still_ends_the_executor_with_1() -> None:
    assert await process.report_failure(_Bridge(fail=True), "inference", RuntimeError("oom")) == 1
