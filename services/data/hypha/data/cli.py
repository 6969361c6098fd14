"""``hypha-data``: init, run and probe a data node."""

from __future__ import annotations

from hypha.cli.node import RoleCli, main_for
from hypha.data.config import DataNodeSettings
from hypha.datasets.prepare_cli import main_prepare
from hypha.pki.identity import Role

CLI = RoleCli(
    role=Role.DATA,
    prog="hypha-data",
    settings_cls=DataNodeSettings,
    build="hypha.data.app:build",
    description="Data node: serves prepared datasets as slices.",
    commands={"prepare": ("turn raw data into a dataset directory of slices", main_prepare)},
)


def main(argv: list[str] | None = None) -> int:
    return main_for(CLI, argv)


if __name__ == "__main__":
    raise SystemExit(main())
