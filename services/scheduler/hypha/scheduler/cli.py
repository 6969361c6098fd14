"""``hypha-scheduler``: init, run and probe a scheduler node."""

from __future__ import annotations

from hypha.cli.node import RoleCli, main_for
from hypha.pki.identity import Role
from hypha.scheduler.config import DEFAULT_STATE_DIR, SchedulerSettings

CLI = RoleCli(
    role=Role.SCHEDULER,
    prog="hypha-scheduler",
    settings_cls=SchedulerSettings,
    build="hypha.scheduler.app:build",
    description="Scheduler: leases workers through the market and runs jobs.",
    # Jobs, their history and results survive a restart unless the operator removes this.
    init_values=lambda args: {"state_dir": DEFAULT_STATE_DIR},
)


def main(argv: list[str] | None = None) -> int:
    return main_for(CLI, argv)


if __name__ == "__main__":
    raise SystemExit(main())
