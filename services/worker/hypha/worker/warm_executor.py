"""A spare executor process, started ahead with torch imported, that the next built-in executor becomes.

A parameter server restored on another worker, or a trainer that replaces a
lost one, spent its first seconds importing torch while its job waited: 2 s on
an idle machine, 10-12 s in a container sharing 2 cores with other jobs'
trainers (the container chaos runs, docs/fault-tolerance.md). With
``worker.jobs.warm_executor`` the worker keeps one spare
(``hypha.worker.executors.warm``) started through the same launcher and
sandbox as every executor, in a work dir of its own under the jobs dir
(``.warm-<hex>``, 0700). When a built-in executor starts in a fresh work dir,
that dir is the spare's, renamed to the execution's name before anything is
put in it: Landlock's rules follow the directory, not its name, so the spare
may write there and nowhere else, as if it had been started for it. At spawn
the spare is handed the execution's environment and storage cap on its stdin
and runs the executor's module: it is the execution's process from then on.
The next spare starts ``replenish_after_s`` later, so that it does not
compete with the execution's own start.

Only the ``landlock`` and ``none`` sandboxes: bubblewrap mounts the work dir
at its path when the sandbox starts, and a rename outside does not move it.
A command that replaces a built-in executor (``executor_commands``, a
reference-style executor) and a work dir kept from an earlier attempt start
cold, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from hypha.worker.executors import BUILTIN_MODULES
from hypha.worker.executors.warm import READY
from hypha.worker.process_group import signal_group, spawn_group_leader
from hypha.worker.sandbox import Sandbox
from hypha.worker.work_dirs import WorkDirs

log = logging.getLogger(__name__)

WARM_MODULE = "hypha.worker.executors.warm"  # (READY: what it writes first, once confined)
#: Name prefix of a spare's work dir under the jobs dir (the sweep leaves dot-dirs alone).
PREFIX = ".warm-"
#: A spare that died unclaimed is started again after this long; after this many in a row, never.
RETRY_AFTER_S = 30.0
MAX_FAILURES = 3
#: How long a spare may take to say READY (its launcher and interpreter starting on a busy machine).
READY_TIMEOUT_S = 120.0


@dataclass
class Spare:
    process: asyncio.subprocess.Process
    stdout: int
    stderr: int
    work_dir: Path

    async def end(self) -> None:
        """Kill it, reap it and close what the worker reads of it (its dir is the caller's to remove)."""
        signal_group(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        for fd in (self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                os.close(fd)


async def confined(spare: Spare, timeout_s: float) -> bool:
    """Whether the spare said READY (its sandbox in place) within ``timeout_s``.

    Reads exactly READY's bytes and no more: what follows on stdout is the
    execution's output, for its log.
    """
    loop = asyncio.get_running_loop()
    os.set_blocking(spare.stdout, False)
    got = bytearray()
    done = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(spare.stdout, len(READY) - len(got))
        except BlockingIOError:
            return
        got.extend(chunk)
        if (not chunk or len(got) == len(READY)) and not done.done():
            done.set_result(None)

    loop.add_reader(spare.stdout, readable)
    try:
        async with asyncio.timeout(timeout_s):
            await done
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(spare.stdout)
    return bytes(got) == READY


class WarmExecutor:
    """One spare at a time: started, claimed by an execution's fresh work dir, handed its order."""

    def __init__(
        self, sandbox: Sandbox, jobs_dir: Path, env: dict[str, str], replenish_after_s: float = 10.0
    ) -> None:
        """``env``: the worker-wide part of every executor's environment (``worker_environment``)."""
        self.sandbox = sandbox
        self.jobs_dir = jobs_dir
        self.env = env
        self.replenish_after_s = replenish_after_s
        #: The spare an execution may claim: its sandbox is in place.
        self.spare: Spare | None = None
        #: A spare started but not yet confined (its launcher still setting the sandbox up).
        self._starting: Spare | None = None
        self._failures = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    @staticmethod
    def supported(sandbox: Sandbox) -> bool:
        return sandbox.mode in ("landlock", "none")

    async def start(self) -> None:
        """Remove spares' dirs a previous run left (their processes died with it), start one."""
        for path in self.jobs_dir.glob(f"{PREFIX}*"):
            await asyncio.to_thread(shutil.rmtree, path, True)
        self._later(self._spawn, 0.0)

    async def stop(self) -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for spare in (self.spare, self._starting):
            if spare is not None:
                await self._discard(spare)
        self.spare = self._starting = None

    def claim(self, argv: list[str], work_dir: Path) -> Spare | None:
        """The spare, its dir renamed to ``work_dir``, when an executor running ``argv`` there can
        be it (a built-in module, a fresh work dir); None: start it cold."""
        spare = self.spare
        if spare is None or spare.process.returncode is not None or work_dir.exists():
            return None
        if argv[:2] != [sys.executable, "-m"] or len(argv) != 3 or argv[2] not in BUILTIN_MODULES.values():
            return None
        os.rename(spare.work_dir, work_dir)
        spare.work_dir = work_dir
        self.spare = None
        self._failures = 0
        self._later(self._spawn, self.replenish_after_s)
        return spare

    @staticmethod
    async def order(spare: Spare, module: str, env: dict[str, str], max_file_bytes: int | None) -> None:
        """Tell a claimed spare what to become (``hypha.worker.executors.warm``)."""
        assert spare.process.stdin is not None
        order = {"module": module, "env": env, "max_file_bytes": max_file_bytes}
        spare.process.stdin.write(json.dumps(order).encode() + b"\n")
        with contextlib.suppress(ConnectionError):  # it died: its exit is what the caller sees
            await spare.process.stdin.drain()
        spare.process.stdin.close()

    # ---- the spare ---------------------------------------------------------------------------

    async def _spawn(self) -> None:
        if self._stopped or self.spare is not None or self._starting is not None:
            return
        work_dir = self.jobs_dir / f"{PREFIX}{secrets.token_hex(6)}"
        await asyncio.to_thread(WorkDirs.make_private, work_dir)
        env = {
            **self.env,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TMPDIR": str(work_dir / "tmp"),
            # Named under the jobs dir: a spare that outlived a killed worker is found and ended.
            "HYPHA_WORK_DIR": str(work_dir),
        }
        env = self.sandbox.environment(env, work_dir)
        argv = self.sandbox.wrap(
            [sys.executable, "-P", "-m", WARM_MODULE], work_dir, env.get("PATH"), network=False
        )
        try:
            process, out, err = await spawn_group_leader(argv, work_dir, env, stdin=asyncio.subprocess.PIPE)
        except OSError as exc:
            log.warning("could not start a warm executor: %s", exc)
            await asyncio.to_thread(shutil.rmtree, work_dir, True)
            return
        spare = self._starting = Spare(process, out, err, work_dir)
        # NOTE: claimable only once confined: its launcher grants its dir by path, and a dir
        # renamed before that would be granted to nobody.
        code: int | None = None
        if await confined(spare, READY_TIMEOUT_S) and not self._stopped:
            self._starting, self.spare = None, spare
            log.info("warm executor ready (pid %d)", process.pid)
            code = await process.wait()
            if self.spare is not spare:
                return  # claimed: its execution watches it now
            self.spare = None
        else:
            code = process.returncode
            self._starting = None
        await self._discard(spare)
        if self._stopped:
            return
        self._failures += 1
        if self._failures >= MAX_FAILURES:
            log.error(
                "warm executor failed %d times in a row (last exit %s): executors start cold",
                MAX_FAILURES,
                code,
            )
            return
        log.warning(
            "warm executor ended (exit %s) before it was needed; another in %.0f s", code, RETRY_AFTER_S
        )
        self._later(self._spawn, RETRY_AFTER_S)

    @staticmethod
    async def _discard(spare: Spare) -> None:
        await spare.end()
        await asyncio.to_thread(shutil.rmtree, spare.work_dir, True)

    def _later(self, step: Callable[[], Awaitable[None]], delay_s: float) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            await step()

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
