"""The ``hypha`` subcommand table, exit codes and the usage error every command may raise.

Kept apart from ``cli`` so that command modules (and other packages adding
subcommands) can register without importing the entry point.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Missing or inconsistent CLI settings: exit 2."""


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


#: Subcommands in the order ``hypha --help`` lists them.
COMMANDS: dict[str, Command] = {}


def register(name: str, command: Command) -> None:
    """Add a subcommand (another module may call this before ``main``)."""
    COMMANDS[name] = command
