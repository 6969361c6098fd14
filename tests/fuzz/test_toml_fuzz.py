"""Job files and node configs get random TOML: the documented error naming a key, or a result.

Documents are built from the real keys (the config models' fields, the job
file's vocabulary) with values of every TOML type, so most of them get past
the TOML parser and deep into validation; raw random text covers the parser.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from hypha.config.loader import load_settings
from hypha.errors import ConfigError, InvalidArgumentError
from hypha.jobfile import parse_job_toml

FUZZ = settings(
    max_examples=int(os.environ.get("HYPHA_FUZZ_EXAMPLES", "150")),
    deadline=None,
    derandomize=os.environ.get("HYPHA_FUZZ_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

#: Keys a job file uses (and a few it does not), so random tables hit the real readers.
JOB_KEYS = sorted(
    set(
        re.findall(
            r"""\.(?:string|number|integer|boolean|strings|table|mapping|get)\(\s*["'](\w+)["']""",
            Path(parse_job_toml.__code__.co_filename).read_text(),
        )
    )
    | {"job", "kind", "diloco", "task", "model", "dataset", "resources", "price", "retry", "unknown"}
)


def toml_value(value: Any) -> str:
    """``value`` as a TOML value; tables become inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(doc: dict[str, Any]) -> str:
    return "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in doc.items())


scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=20).filter(lambda s: "\x7f" not in s),
    st.sampled_from(["", "task", "diloco", "../x", "127.0.0.1:0", "0.0.0.0:99999", "echo"]),
    st.datetimes(timezones=st.just(dt.UTC)),
)


def tables(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    key = st.one_of(st.sampled_from(keys), st.text(min_size=1, max_size=8))
    return st.recursive(
        st.dictionaries(key, scalars, max_size=4),
        lambda inner: st.dictionaries(
            key, st.one_of(scalars, inner, st.lists(scalars, max_size=3)), max_size=4
        ),
        max_leaves=12,
    )


def names_a_key(message: str, doc: dict[str, Any], known: list[str] = ()) -> bool:  # type: ignore[assignment]
    """Whether every line of ``message`` names a key of ``doc`` (or a ``known`` one: a missing key)."""

    def keys(value: Any) -> set[str]:
        if isinstance(value, dict):
            return set(value) | {k for v in value.values() for k in keys(v)}
        if isinstance(value, list):
            return {k for v in value for k in keys(v)}
        return set()

    named = keys(doc) | set(known) | {"job"}
    return all(any(k in line or json.dumps(k) in line for k in named) for line in message.splitlines())


@pytest.mark.timeout(60)
@FUZZ
@given(st.one_of(tables(JOB_KEYS).map(lambda t: {"job": t}), tables(JOB_KEYS)))
def test_random_job_files_parse_or_fail_naming_the_key(doc: dict[str, Any]) -> None:
    try:
        parse_job_toml(toml_document(doc))
    except InvalidArgumentError as err:
        assert names_a_key(err.message, doc), err.message


@pytest.mark.timeout(60)
@FUZZ
@given(st.text(max_size=200))
def test_random_text_as_a_job_file_is_invalid_argument(text: str) -> None:
    try:
        parse_job_toml(text)
    except InvalidArgumentError as err:
        assert err.message.startswith(("job file:", "job")), err.message


def _settings_classes() -> list[type[BaseModel]]:
    from hypha.data.config import DataNodeSettings
    from hypha.gateway.config import GatewaySettings
    from hypha.scheduler.config import SchedulerSettings
    from hypha.worker.config import WorkerSettings

    return [GatewaySettings, SchedulerSettings, WorkerSettings, DataNodeSettings]


def config_keys(cls: type[BaseModel]) -> list[str]:
    found: set[str] = set()

    def walk(model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            found.add(name)
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel) and kind is not model:
                walk(kind)

    walk(cls)
    return sorted(found)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", _settings_classes(), ids=lambda c: c.__name__)
def test_random_configs_load_or_fail_with_config_error_naming_the_key(cls: type[BaseModel]) -> None:
    keys = config_keys(cls)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "node.toml"

        @FUZZ
        @given(st.one_of(tables(keys), st.text(max_size=120).map(lambda t: {"_raw": t})))
        def one(doc: dict[str, Any]) -> None:
            raw = doc.get("_raw")
            path.write_text(raw if isinstance(raw, str) else toml_document(doc), encoding="utf-8")
            try:
                load_settings(cls, path)  # type: ignore[type-var]
            except ConfigError as err:
                assert raw is not None or names_a_key(str(err), doc, keys) or "invalid TOML" in str(err), str(
                    err
                )

        one()
