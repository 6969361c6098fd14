"""What every built-in executor process does around its own work: set up, report a failure, exit.

The trainer, the parameter server and the inference executor each run as
``python -m hypha.worker.executors.<kind>``; their ``main`` hands their run to
``main`` here, so the process settings, the failure report and the exit code
are the same for all three.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

from hypha.bridge_client import torch_threads
from hypha.errors import HyphaError
from hypha.worker.confine import make_non_dumpable

logger = logging.getLogger("hypha.worker.executors.process")

#: What an executor's run reports as the job's failure and exits 1 on. Anything else is a bug in
#: the executor: it escapes with its traceback into the job's log (the worker sees a non-zero exit).
FAILURES: tuple[type[BaseException], ...] = (HyphaError, OSError, RuntimeError, ValueError)

#: Torch threads of an executor the worker named no count for (module NOTE of ``configure_process``).
DEFAULT_TORCH_THREADS = 1


class StatusReporter(Protocol):
    """The one bridge call a failure report needs."""

    async def status(self, state: str, message: str) -> None: ...


def failure_message(exc: BaseException) -> str:
    """What the job's status says: a Hypha error's own message, else the exception's type and text."""
    return exc.message if isinstance(exc, HyphaError) else f"{type(exc).__name__}: {exc}"


async def report_failure(bridge: StatusReporter, what: str, exc: BaseException) -> int:
    """Log ``exc`` and report it as the job's failure; the exit code (1).

    The report is best effort: the bridge itself may be what failed, and the
    worker learns of the failure from the exit code anyway.
    """
    message = failure_message(exc)
    logger.error("%s failed: %s", what, message)
    try:
        await bridge.status("failed", message)
    except Exception as err:  # the bridge itself may be what failed
        logger.warning("could not report the failure to the bridge: %s", err)
    return 1


def configure_process() -> None:
    """Process-wide settings of an executor: non-dumpable, logging, one torch thread count per process.

    Non-dumpable: a task job of another client may run as the same user (every
    sandbox mode but bwrap); its /proc files (environ, memory) stay closed to it.
    Several trainers share a machine: with torch's default (every core each)
    four trainers on two cores ran 3x slower than with one thread each, so the
    worker's count (``HYPHA_TORCH_THREADS``, read by ``hypha.bridge_client``'s one
    rule) applies, and one thread when it names none or something unusable.
    """
    make_non_dumpable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(torch_threads() or DEFAULT_TORCH_THREADS)
    hf_logging.disable_progress_bar()  # per-file bars would flood the job's log stream


def main(run: Callable[[Any], Awaitable[int]]) -> NoReturn:
    """Set the process up, connect to the job's bridge, hand it to ``run`` and exit with its code."""
    configure_process()
    sys.exit(asyncio.run(_serve(run)))


async def _serve(run: Callable[[Any], Awaitable[int]]) -> int:
    from hypha.bridge_client import BridgeClient

    async with BridgeClient.from_env() as client:
        return await run(client)
