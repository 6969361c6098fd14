"""The typed TOML-table reader every job kind's parser uses.

``Table`` wraps one table of a job file (or a JSON job body): its getters read
a key as the type asked for and name the dotted key on error (``bad``), and
``done()`` refuses every key nobody asked for, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hypha.errors import InvalidArgumentError

#: Largest integer a job file may give (every integer field of a JobSpec holds it).
MAX_INTEGER = 2**31 - 1


def bad(path: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path}: {message}")


class Table:
    """A TOML table being read: typed getters that name the dotted key, and a
    final ``done()`` that refuses every key nobody asked for."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise bad(path, "must be a table")
        self.data = data
        self.path = path
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}"

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        # TOML has no null; a JSON body's null would otherwise read as "absent".
        if name in self.data and self.data[name] is None:
            raise bad(self.key(name), "must not be null (leave the key out for its default)")
        return self.data.get(name)

    def string(self, name: str, default: str = "", *, required: bool = False) -> str:
        value = self.raw(name)
        if value is None:
            if required:
                raise bad(self.key(name), "missing (required)")
            return default
        if not isinstance(value, str):
            raise bad(self.key(name), "must be a string")
        if required and not value.strip():
            raise bad(self.key(name), "must not be empty")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad(self.key(name), "must be a number")
        try:
            number = float(value)  # an int too large for a float overflows
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise bad(self.key(name), "must be a finite number")
        return number

    def integer(self, name: str, default: int) -> int:
        value = self.raw(name)
        if value is None:
            return default
        # A whole float (1.0) is an integer, as JSON Schema counts them: a JSON body's 1.0 is 1.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(self.key(name), "must be an integer")
        if value < 0:
            raise bad(self.key(name), "must not be negative")
        if value > MAX_INTEGER:
            raise bad(self.key(name), f"must be at most {MAX_INTEGER}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad(self.key(name), "must be true or false")
        return value

    def strings(self, name: str) -> list[str]:
        value = self.raw(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(self.key(name), "must be a list of strings")
        return list(value)

    def string_map(self, name: str) -> dict[str, str]:
        """A table of scalars, kept as strings (environment, config overrides)."""
        value = self.raw(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise bad(self.key(name), "must be a table")
        out: dict[str, str] = {}
        for k, v in value.items():
            if isinstance(v, bool):
                out[k] = "true" if v else "false"
            elif isinstance(v, str | int | float):
                out[k] = str(v)
            else:
                raise bad(f"{self.key(name)}.{k}", "must be a string or number")
        return out

    def table(self, name: str) -> Table | None:
        value = self.raw(name)
        return None if value is None else Table(value, self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise bad(self.key(unknown[0]), f"unknown key (known here: {known})")


__all__ = ["MAX_INTEGER", "Table", "bad"]
