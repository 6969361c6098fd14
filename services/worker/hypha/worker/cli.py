"""``hypha-worker``: init, run and probe a worker node."""

from __future__ import annotations

from hypha.cli.node import RoleCli, main_for
from hypha.pki.identity import Role
from hypha.worker.config import WorkerSettings

CLI = RoleCli(
    role=Role.WORKER,
    prog="hypha-worker",
    settings_cls=WorkerSettings,
    build="hypha.worker.app:build",
    description="Worker: sells compute and runs executors.",
)


def main(argv: list[str] | None = None) -> int:
    return main_for(CLI, argv)


if __name__ == "__main__":
    raise SystemExit(main())
