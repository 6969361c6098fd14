"""The example config: documents every key, and loads back into an equal object."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel, ConfigDict, Field

from hypha.config.common import NodeSettings
from hypha.config.loader import load_settings
from hypha.config.template import render_example, toml_value
from hypha.errors import ConfigError

S = TypeVar("S", bound=NodeSettings)


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu: float = Field(1.5, description="CPU cores one job may use.")
    tags: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")


class Job(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Job name, unique per node.")
    epochs: int = Field(1, description="How many passes over the data.")
    data: Path | None = Field(None, description="Where the training data lives.")
    limits: Limits = Field(default_factory=Limits, description="Resource limits of this job.")


class RoleSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: str = Field("fast", description='Scheduling mode; "fast" or "fair".')
    jobs: list[Job] = Field(default_factory=list, description="Jobs started at boot.")
    limits: Limits = Field(default_factory=lambda: Limits(cpu=4.0), description="Limits of the whole role.")
    backup: Limits | None = Field(None, description="Limits in backup mode; unset: no backup mode.")
    note: str = Field('quote " backslash \\ tab \t', description="A string that needs escaping.")


class RoleSettings(NodeSettings):
    role: RoleSection = Field(default_factory=RoleSection, description="Settings of this role.")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in os.environ:
        if var.upper().startswith("HYPHA_"):
            monkeypatch.delenv(var)


def init_values(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": "node-7",
        "tls": {
            "cert": str(tmp_path / "c.pem"),
            "key": str(tmp_path / "k.pem"),
            "trust": str(tmp_path / "t.pem"),
        },
        "net": {"listen": "0.0.0.0:7000", "gateways": ["gw1:7000", "gw2:7000"]},
    }


def round_trip(tmp_path: Path, values: dict[str, Any], cls: type[S]) -> tuple[S, S]:
    """``cls`` loaded from its full example, and from a file holding only ``values``."""
    example, minimal = tmp_path / "example.toml", tmp_path / "minimal.toml"
    example.write_text(render_example(cls, values, header="Example config."))
    minimal.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
    return load_settings(cls, example), load_settings(cls, minimal)


def test_example_with_init_values_loads_back_equal(tmp_path: Path) -> None:
    loaded, expected = round_trip(tmp_path, init_values(tmp_path), RoleSettings)
    assert loaded == expected
    assert loaded.net.gateways == ["gw1:7000", "gw2:7000"]


def test_example_with_nested_tables_and_lists_loads_back_equal(tmp_path: Path) -> None:
    values = init_values(tmp_path)
    values["state_dir"] = str(tmp_path / "state")
    values["tls"]["crl"] = str(tmp_path / "crl.pem")
    values["role"] = {
        "mode": "fair",
        "jobs": [
            {
                "name": "a",
                "data": str(tmp_path / "a.bin"),
                "limits": {"cpu": 2.0, "tags": {"gpu kind": "h100"}},
            },
            {"name": "b", "epochs": 3},
        ],
        "backup": {"cpu": 0.5},
    }
    loaded, expected = round_trip(tmp_path, values, RoleSettings)
    assert loaded == expected
    assert loaded.role.jobs[1].epochs == 3
    assert loaded.role.jobs[0].limits.tags == {"gpu kind": "h100"}
    assert loaded.role.limits.cpu == 4.0


def test_unset_optional_keys_and_empty_tables_are_written_commented_out(tmp_path: Path) -> None:
    text = render_example(RoleSettings, init_values(tmp_path))
    assert re.search(r"^# crl = ", text, re.M)
    assert re.search(r"^# state_dir = ", text, re.M)
    assert re.search(r"^# \[role.backup\]$", text, re.M)
    assert re.search(r"^# \[\[role.jobs\]\]$", text, re.M)
    assert re.search(r"^# name = ", text, re.M)  # the example job's required name


def test_required_keys_without_values_are_left_for_the_loader_to_report(tmp_path: Path) -> None:
    path = tmp_path / "bare.toml"
    path.write_text(render_example(RoleSettings))
    with pytest.raises(ConfigError) as caught:
        load_settings(RoleSettings, path)
    assert set(re.findall(r": ([\w.]+): field required", caught.value.message)) == {
        "name",
        "tls.cert",
        "tls.key",
        "tls.trust",
    }


def test_comment_shows_the_default_of_the_enclosing_table(tmp_path: Path) -> None:
    text = render_example(RoleSettings, init_values(tmp_path))
    section = text.split("[role.limits]")[1]
    assert "(default: 4.0)\ncpu = 4.0" in section


def _fields(cls: type[BaseModel]) -> list[str]:
    found = []
    for info in cls.model_fields.values():
        found.append(info.description or "")
        for arg in [info.annotation, *getattr(info.annotation, "__args__", ())]:
            for inner in [arg, *getattr(arg, "__args__", ())]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    found.extend(_fields(inner))
    return found


def test_example_contains_every_field_description() -> None:
    text = " ".join(line.removeprefix("# ") for line in render_example(RoleSettings).splitlines())
    descriptions = _fields(RoleSettings)
    assert len(descriptions) > 25
    for description in descriptions:
        assert description and description in text


def test_header_is_a_comment() -> None:
    assert render_example(RoleSettings, header="hypha-worker configuration.").startswith(
        "# hypha-worker configuration.\n"
    )


def test_unknown_value_key_is_refused() -> None:
    with pytest.raises(ValueError, match="lisen"):
        render_example(RoleSettings, {"net": {"lisen": "x"}})


@pytest.mark.parametrize(
    "value",
    [
        True,
        0,
        -3,
        1.5,
        1e300,
        float("inf"),
        "",
        'a"b\\c\n\x7f\x00é',
        [1, [2, "x"]],
        {"a b": 1, "c": [True]},
        {},
    ],
)
def test_toml_value_reads_back_with_tomllib(value: Any) -> None:
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


def test_every_role_example_loads_back(tmp_path: Path) -> None:
    from hypha.data.config import DataNodeSettings
    from hypha.gateway.config import GatewaySettings
    from hypha.scheduler.config import SchedulerSettings
    from hypha.worker.config import WorkerSettings

    for cls in (GatewaySettings, SchedulerSettings, WorkerSettings, DataNodeSettings):
        loaded, expected = round_trip(tmp_path, init_values(tmp_path), cls)
        assert loaded == expected
