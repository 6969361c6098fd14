"""The commented example config a role's ``init`` writes, generated from its settings class.

Each key is preceded by its field's description and default, so the example can
never drift from what the loader accepts; the output loads back into an equal
object. ``tomllib`` only reads, so a small TOML writer lives here.
"""

from __future__ import annotations

import enum
import math
import re
import textwrap
import types
import typing
from datetime import date, datetime, time
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_WIDTH = 100
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {i: f"\\u{i:04x}" for i in [*range(0x20), 0x7F]} | {ord('"'): '\\"', ord("\\"): "\\\\"}
_NOT_SET = object()


def render_example(cls: type[BaseModel], values: dict[str, Any] | None = None, header: str = "") -> str:
    """A complete TOML file for ``cls``: ``values`` where given, else defaults, each key documented.

    Optional keys that default to None, required keys without a value and empty
    lists of tables are written commented out, with an example value.
    """
    out = _comment(header)
    _table(cls, (), None, values or {}, out)
    return "\n".join(out).strip("\n") + "\n"


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (inline tables and arrays included)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, str | PurePath):
        return '"' + str(value).translate(_ESCAPES) + '"'
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        pairs = [f"{_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(pairs) + " }" if pairs else "{}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else toml_value(name)


def _comment(text: str) -> list[str]:
    return [f"# {line}" for line in textwrap.wrap(text, _WIDTH - 2)]


def _doc(info: FieldInfo, note: str) -> list[str]:
    return _comment(f"{(info.description or '').strip()} {note}".strip())


def _table(
    cls: type[BaseModel],
    path: tuple[str, ...],
    base: BaseModel | None,
    values: dict[str, Any],
    out: list[str],
) -> None:
    """Write the keys of one table, then its sub-tables; ``base`` supplies defaults when set."""
    unknown = set(values) - set(cls.model_fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    fields = [(name, info, _shape(info.annotation)) for name, info in cls.model_fields.items()]
    for name, info, (kind, _) in fields:
        if kind != "value":
            continue
        default = _default(info, base, name)
        value = values.get(name, None if default is _NOT_SET else default)
        out.append("")
        out.extend(_doc(info, _default_note(default)))
        key = _key(info.alias or name)  # the name the file uses (e.g. `class`, a Python keyword)
        if value is None:
            out.append(f"# {key} = {toml_value(_example(info))}")
        else:
            out.append(f"{key} = {toml_value(value)}")
    for name, info, (kind, model) in fields:
        if kind == "value" or model is None:
            continue
        default = _default(info, base, name)
        dotted = ".".join(_key(part) for part in (*path, name))
        block: list[str] = []
        if kind == "table":
            given = values.get(name)
            sub_values = _as_dict(given) if given is not None else {}
            sub_base = default if isinstance(default, BaseModel) else None
            block.append(f"[{dotted}]")
            _table(model, (*path, name), sub_base, sub_values, block)
            commented = given is None and default is None
            note = "(optional: uncomment to set)" if commented else ""
        else:
            items = values.get(name, [] if default is _NOT_SET else default) or []
            for item in items:
                block.append(f"[[{dotted}]]")
                _table(model, (*path, name), None, _as_dict(item), block)
            commented = not items
            if commented:
                block.append(f"[[{dotted}]]")
                _table(model, (*path, name), None, {}, block)
            note = "(default: none; one entry per [[table]], example below)" if commented else ""
        out.append("")
        out.extend(_doc(info, note))
        out.extend("# " + line if commented and line and not line.startswith("#") else line for line in block)


def _default_note(default: Any) -> str:
    if default is _NOT_SET:
        return "(required)"
    return "(default: unset)" if default is None else f"(default: {toml_value(default)})"


def _shape(annotation: Any) -> tuple[Literal["value", "table", "array"], type[BaseModel] | None]:
    """How a field is written: a key = value, a [table], or an [[array of tables]]."""
    for kind in _unwrap(annotation):
        args = typing.get_args(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return "table", kind
        if (
            typing.get_origin(kind) is list
            and args
            and isinstance(args[0], type)
            and issubclass(args[0], BaseModel)
        ):
            return "array", args[0]
    return "value", None


def _unwrap(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return (annotation,)


def _default(info: FieldInfo, base: BaseModel | None, name: str) -> Any:
    if base is not None:
        return getattr(base, name)
    if info.is_required():
        return _NOT_SET
    return info.get_default(call_default_factory=True)


def _as_dict(value: Any) -> dict[str, Any]:
    return value.model_dump() if isinstance(value, BaseModel) else dict(value)


def _example(info: FieldInfo) -> Any:
    """A value to show, commented out, for a key that has none."""
    if info.examples:
        return info.examples[0]
    kind = _unwrap(info.annotation)[0]
    origin = typing.get_origin(kind)
    if origin is Literal:
        return typing.get_args(kind)[0]
    if origin in (list, set, tuple, frozenset):
        return []
    if origin is dict:
        return {}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(iter(kind)).value
    return {bool: False, int: 0, float: 0.0}.get(kind, "")
