"""``hypha-worker``: init, run and probe a worker node (``probe --machine``: what this machine offers)."""

from __future__ import annotations

from typing import Any

from hypha.cli.node import RoleCli, main_for
from hypha.pki.identity import Role
from hypha.worker.config import WorkerSettings


def _machine() -> dict[str, Any]:
    from hypha.worker.machine import describe

    return describe()


def _harden() -> None:
    # Jobs run as this worker's user (all modes but bwrap): its /proc files must stay closed to them.
    from hypha.worker.confine import make_non_dumpable

    make_non_dumpable()


CLI = RoleCli(
    role=Role.WORKER,
    prog="hypha-worker",
    settings_cls=WorkerSettings,
    build="hypha.worker.app:build",
    description="Worker: sells compute and runs executors. `hypha-worker probe --machine` prints which "
    "executor sandbox works here (bwrap, landlock) and the resources it would sell.",
    prepare_run=_harden,
    machine_probe=_machine,
)


def main(argv: list[str] | None = None) -> int:
    return main_for(CLI, argv)


if __name__ == "__main__":
    raise SystemExit(main())
