"""``hypha-gateway``: init, run and probe a gateway node."""

from __future__ import annotations

from hypha.cli.node import RoleCli, main_for
from hypha.gateway.config import GatewaySettings
from hypha.pki.identity import Role

CLI = RoleCli(
    role=Role.GATEWAY,
    prog="hypha-gateway",
    settings_cls=GatewaySettings,
    build="hypha.gateway.app:build",
    description="Gateway: the meeting point that relays pub/sub, direct messages and calls.",
)


def main(argv: list[str] | None = None) -> int:
    return main_for(CLI, argv)


if __name__ == "__main__":
    raise SystemExit(main())
