"""``hypha-scheduler``: init, run and probe a scheduler node."""

from __future__ import annotations

from hypha.cli.node import RoleCli, main_for
from hypha.pki.identity import Role
from hypha.scheduler.app import build
from hypha.scheduler.config import SchedulerSettings

CLI = RoleCli(
    role=Role.SCHEDULER,
    prog="hypha-scheduler",
    settings_cls=SchedulerSettings,
    build=build,
    description="Scheduler: leases workers through the market and runs jobs.",
)


def main(argv: list[str] | None = None) -> int:
    return main_for(CLI, argv)


if __name__ == "__main__":
    raise SystemExit(main())
