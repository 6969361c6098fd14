"""The warm executor: a spare process started ahead in the Landlock sandbox becomes an execution.

Real processes through the real launcher: the spare imports torch while it
waits, its dir is renamed to the execution's, and the module it is told to
run sees the execution's environment, work dir and file-size cap, and still
only what the sandbox grants (its work dir now, nothing of the worker's).
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from pathlib import Path

import pytest

from hypha.worker.executors import BUILTIN_MODULES
from hypha.worker.process_group import pump_lines
from hypha.worker.sandbox import Sandbox, landlock_abi
from hypha.worker.warm_executor import PREFIX, Spare, WarmExecutor
from hypha.worker.work_dirs import WorkDirs
from tests.helpers import eventually

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not landlock_abi(), reason="needs a kernel with Landlock"),
]

PROBE = """
import json, os, resource, sys, tempfile
try:
    open(os.environ["PROBE_SECRET"]).read()
    secret = "read"
except PermissionError:
    secret = "denied"
with open("written.txt", "w") as f:
    f.write("ok")
print(json.dumps({
    "name": __name__,
    "cwd": os.getcwd(),
    "job": os.environ.get("HYPHA_JOB_ID"),
    "stale": os.environ.get("STALE"),
    "tmp": tempfile.gettempdir(),
    "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
    "torch_ahead": "torch" in sys.modules,
    "secret": secret,
}), flush=True)
"""

TRAINER_ARGV = [sys.executable, "-m", BUILTIN_MODULES[next(iter(BUILTIN_MODULES))]]


async def _first_line(fd: int) -> dict[str, object]:
    lines: list[bytes] = []
    await asyncio.wait_for(pump_lines(fd, 1 << 16, lines.append), 60)
    return json.loads(lines[0])


async def test_a_spare_becomes_the_execution_in_its_renamed_dir_and_stays_confined(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    WorkDirs(tmp_path).create()
    secret = tmp_path / "worker-key.pem"
    secret.write_text("not for jobs")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "warm_probe.py").write_text(PROBE)
    sandbox = Sandbox("landlock", None, readonly=(probe,), devices=())
    warm = WarmExecutor(sandbox, jobs, {"PYTHONPATH": str(probe), "STALE": "worker"}, replenish_after_s=0)
    await warm.start()
    try:
        first: Spare = await eventually(lambda: warm.spare, timeout=60, message="a confined spare")
        assert first.work_dir.name.startswith(PREFIX)
        work_dir = jobs / "job-1.diloco-trainer"

        # Only a built-in module in a fresh work dir can take it.
        assert warm.claim([sys.executable, "-m", "somebody.elses"], work_dir) is None
        (jobs / "kept.diloco-trainer").mkdir()
        assert warm.claim(TRAINER_ARGV, jobs / "kept.diloco-trainer") is None
        spare = warm.claim(TRAINER_ARGV, work_dir)

        assert spare is not None and spare is first and spare.work_dir == work_dir and work_dir.is_dir()
        env = {
            "PYTHONPATH": str(probe),
            "HYPHA_WORK_DIR": str(work_dir),
            "HYPHA_JOB_ID": "job-1",
            "TMPDIR": str(work_dir / "tmp"),
            "PROBE_SECRET": str(secret),
        }
        await WarmExecutor.order(spare, "warm_probe", env, 1 << 20)
        err: list[bytes] = []
        pump = asyncio.create_task(pump_lines(spare.stderr, 1 << 16, err.append))
        assert await spare.process.wait() == 0, b"\n".join(err).decode()
        await pump
        seen = await _first_line(spare.stdout)

        assert seen == {
            "name": "__main__",
            "cwd": str(work_dir),
            "job": "job-1",
            "stale": None,  # the spare's own environment is gone
            "tmp": str(work_dir / "tmp"),
            "fsize": 1 << 20,
            "torch_ahead": True,  # imported before the order came
            "secret": "denied",  # Landlock's rules followed the renamed dir and nothing else
        }
        assert (work_dir / "written.txt").read_text() == "ok"
        # The next spare comes (here at once), in a dir of its own.
        second = await eventually(lambda: warm.spare, timeout=60, message="a new spare")
        assert second.process.pid != first.process.pid and second.work_dir.name.startswith(PREFIX)
    finally:
        await warm.stop()
    assert not list(jobs.glob(f"{PREFIX}*")), "a stopped pool leaves no spare's dir"
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # the test's own


async def test_a_spare_retired_unclaimed_exits_and_leftover_dirs_go_at_start(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    WorkDirs(tmp_path).create()
    leftover = jobs / f"{PREFIX}deadbeef"
    leftover.mkdir()
    warm = WarmExecutor(Sandbox("none"), jobs, {})
    await warm.start()
    spare = await eventually(lambda: warm.spare, timeout=60, message="a confined spare")
    assert not leftover.exists()

    await warm.stop()

    assert spare.process.returncode is not None and not spare.work_dir.exists()
    assert warm.spare is None
