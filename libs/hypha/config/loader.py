"""Loading a role's settings: TOML file < ``HYPHA_*`` environment < CLI overrides.

Every failure becomes one ``ConfigError`` whose message names, for each bad key,
its dotted path and where the bad value came from (the file, the environment
variable, or the command line), so a CLI prints it and exits without a traceback.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from hypha.config.common import FILE_VALUES, NodeSettings
from hypha.errors import ConfigError

S = TypeVar("S", bound=NodeSettings)

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # no leading "_": those are BaseSettings options
_TOML_POSITION = re.compile(r"^(.*) \(at line (\d+), column (\d+)\)$")
#: A TOML bare key: printed as is in messages, any other key quoted.
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ABSENT = object()


def load_settings(cls: type[S], path: Path | None, overrides: Mapping[str, Any] | None = None) -> S:
    """Build ``cls`` from ``path`` < ``HYPHA_*`` environment < ``overrides``.

    ``overrides`` keys may be dotted (``{"net.listen": "0.0.0.0:0"}``) or nested
    dicts, as ``parse_overrides`` returns. Every path in the result is absolute:
    relative paths in the file, and relative default paths, are rebased on the
    file's directory; those from the environment or flags (and defaults when there
    is no file) on the working directory at load time, as a shell user expects.
    Resolving here, once, matters because nodes hand paths to processes that run
    elsewhere (an executor's working directory is its job's work dir).
    """
    file_values = _read_file(cls, path) if path is not None else {}
    layer: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        _put(layer, key, value)
    token = FILE_VALUES.set(file_values)
    try:
        settings = cls(**layer)
        _make_absolute(settings, path.absolute().parent if path is not None else Path.cwd(), Path.cwd())
        return settings
    except ValidationError as err:
        raise ConfigError(_describe(err, cls, path, layer)) from None
    except SettingsError as err:
        raise ConfigError(_describe_env_error(cls, err)) from None
    finally:
        FILE_VALUES.reset(token)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set KEY.PATH=VALUE`` flags -> nested dict, later flags winning.

    Arrays, inline tables and quoted strings are read as TOML values; anything
    else stays a string, which pydantic converts by the field's type just as it
    does an environment variable (so ``name=123`` stays the string ``"123"``,
    while ``net.keepalive_s=30`` still becomes 30.0).
    """
    result: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"bad override {item!r}: expected KEY.PATH=VALUE")
        raw = raw.strip()
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        if not isinstance(value, list | dict) and not raw.startswith(("'", '"')):
            value = raw
        _put(result, key.strip(), value)
    return result


def print_config_error_and_exit(err: ConfigError) -> NoReturn:
    print(f"error: {err.message}", file=sys.stderr)
    sys.exit(2)


def _put(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(_SEGMENT.fullmatch(part) for part in parts):
        raise ConfigError(f"bad override key {dotted!r}: expected dotted names like net.listen")
    for i, part in enumerate(parts[:-1]):
        node = target.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"bad override {dotted}: {'.'.join(parts[: i + 1])} is already set to a value")
        target = node
    _merge(target, parts[-1], value)


def _merge(target: dict[str, Any], key: str, value: Any) -> None:
    """Set ``target[key]``, merging tables key by key (their keys are not dotted paths)."""
    if not isinstance(value, Mapping):
        target[key] = value
        return
    if not isinstance(target.get(key), dict):
        target[key] = {}
    for sub_key, item in value.items():
        _merge(target[key], sub_key, item)


def _read_file(cls: type[BaseModel], path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        found = _TOML_POSITION.match(str(err))
        if found is None:
            raise ConfigError(f"config error in {path}: invalid TOML: {err}") from None
        message, line, column = found.groups()
        raise ConfigError(
            f"config error in {path}, line {line}, column {column}: invalid TOML: {message}"
        ) from None
    _rebase_paths(cls, data, path.absolute().parent)
    return data


def _rebase_paths(cls: type[BaseModel], data: dict[str, Any], base: Path) -> None:
    """Make relative path strings in ``data`` absolute, guided by ``cls``'s field types."""
    for name, info in cls.model_fields.items():
        value = data.get(name)
        for kind in _unwrap(info.annotation):
            args = typing.get_args(kind)
            if kind is Path and isinstance(value, str):
                data[name] = str(base / Path(value).expanduser())
            elif typing.get_origin(kind) is list and args and args[0] is Path and isinstance(value, list):
                data[name] = [str(base / Path(v).expanduser()) if isinstance(v, str) else v for v in value]
            elif _is_model(kind) and isinstance(value, dict):
                _rebase_paths(kind, value, base)
            elif typing.get_origin(kind) is list and args and _is_model(args[0]) and isinstance(value, list):
                for item in value:
                    if isinstance(item, dict):
                        _rebase_paths(args[0], item, base)


def _make_absolute(model: BaseModel, defaults_base: Path, given_base: Path) -> None:
    """Make every relative path left in ``model`` absolute, in place.

    Paths from the file arrive absolute already (``_rebase_paths``). A default
    path is anchored on ``defaults_base`` (the config file's directory, so a key
    means the same whether ``init`` wrote it out or the user deleted the line);
    a path given through the environment or a flag on ``given_base`` (the
    working directory).
    """
    for name in type(model).model_fields:
        value = getattr(model, name)
        base = given_base if name in model.model_fields_set else defaults_base
        if isinstance(value, Path) and not value.is_absolute():
            setattr(model, name, base / value.expanduser())
        elif isinstance(value, list) and any(isinstance(item, Path) for item in value):
            setattr(model, name, [base / v.expanduser() if isinstance(v, Path) else v for v in value])
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                _make_absolute(item, defaults_base, given_base)


def _unwrap(annotation: Any) -> tuple[Any, ...]:
    """The members of ``X | Y | None`` (without None), or ``(annotation,)``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return (annotation,)


def _is_model(kind: Any) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _known_keys(cls: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the table at ``loc`` accepts (as in job-file errors), so a typo shows its fix."""
    model: type[BaseModel] | None = cls
    for part in loc:
        if model is None:
            return []
        if isinstance(part, int):
            continue  # an item of a list of tables: the list's field already chose the model
        field = model.model_fields.get(part)
        if field is None:
            return []
        kinds = [k for kind in _unwrap(field.annotation) for k in (kind, *typing.get_args(kind))]
        model = next((kind for kind in kinds if _is_model(kind)), None)
    return sorted(model.model_fields) if model is not None else []


def _key_part(part: int | str) -> str:
    """One step of a dotted key; odd names are quoted as TOML quotes them, so a
    control character in a key cannot reach the operator's terminal raw."""
    if isinstance(part, int):
        return f"[{part}]"
    return f".{part}" if _BARE_KEY.fullmatch(part) else f".{json.dumps(part)}"


def _describe(
    err: ValidationError, cls: type[NodeSettings], path: Path | None, overrides: dict[str, Any]
) -> str:
    env = _env_names(cls)
    lines = []
    for problem in err.errors():
        loc = problem["loc"]
        key = "".join(_key_part(p) for p in loc).lstrip(".")
        if problem["type"] == "extra_forbidden":
            known = _known_keys(cls, loc[:-1])
            message = f"unknown key (known here: {', '.join(known)})" if known else "unknown key"
        elif problem["type"] == "missing":
            message = "field required"
        else:
            message = str(problem.get("ctx", {}).get("error", "")) if problem["type"] == "value_error" else ""
            message = message or problem["msg"][:1].lower() + problem["msg"][1:]
            given = problem.get("input")
            if isinstance(given, str | int | float | bool):
                message += f" (got {json.dumps(given)})"
        lines.append(f"config error{_source(loc, path, overrides, env)}: {key}: {message}")
    return "\n".join(lines)


def _source(
    loc: tuple[int | str, ...], path: Path | None, overrides: dict[str, Any], env: dict[str, str]
) -> str:
    """Which layer the value at ``loc`` came from, the highest that supplies it winning."""
    node: Any = overrides
    for part in loc:
        if not isinstance(node, dict):
            break
        node = node.get(part, _ABSENT)
    if node is not _ABSENT:
        return " in command-line overrides"
    for depth in range(len(loc), 0, -1):
        name = "__".join(str(part) for part in loc[:depth]).upper()
        if name in env:
            return f" in environment variable {env[name]}"
    return f" in {path}" if path is not None else ""


def _env_names(cls: type[NodeSettings]) -> dict[str, str]:
    """Environment variables under the prefix, by their upper-cased name less the prefix."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    return {var.upper()[len(prefix) :]: var for var in os.environ if var.upper().startswith(prefix)}


def _describe_env_error(cls: type[NodeSettings], err: SettingsError) -> str:
    """pydantic-settings raises these for a list or table variable that is not valid JSON."""
    found = re.search(r'field "(\w+)"', str(err))
    field = found.group(1).upper() if found else ""
    names = {key: var for key, var in _env_names(cls).items() if key == field or key.startswith(field + "__")}
    structured = sorted(var for key, var in names.items() if _is_structured(cls, key.lower().split("__")))
    where = ", ".join(structured or sorted(names.values())) or "HYPHA_*"
    return (
        f"config error in environment variable {where}: value is not valid JSON (lists and tables are JSON)"
    )


def _is_structured(cls: type[BaseModel], parts: list[str]) -> bool:
    """Whether the field at ``parts`` takes a list or table, which the environment gives as JSON."""
    kind: Any = cls
    for part in parts:
        model = next((k for k in _unwrap(kind) if _is_model(k)), None)
        if model is None or part not in model.model_fields:
            return False
        kind = model.model_fields[part].annotation
    return any(_is_model(k) or typing.get_origin(k) in (list, dict, set, tuple) for k in _unwrap(kind))
