"""Loading settings: layer precedence, path rebasing, and errors that name key and source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from hypha.config.common import NodeSettings
from hypha.config.loader import load_settings, parse_overrides, print_config_error_and_exit
from hypha.errors import ConfigError

BASE = """
name = "w1"
[tls]
cert = "certs/w1-cert.pem"
key = "/abs/w1-key.pem"
trust = "certs/trust.pem"
"""


class Job(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Job name.")
    epochs: int = Field(1, description="Epochs to run.")
    data: Path | None = Field(None, description="Data file.")


class RoleSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[Job] = Field(default_factory=list, description="Jobs.")
    cache: Path = Field(Path("cache"), description="Cache dir.")


class RoleSettings(NodeSettings):
    role: RoleSection = Field(default_factory=RoleSection, description="Role section.")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in os.environ:
        if var.upper().startswith("HYPHA_"):
            monkeypatch.delenv(var)


def write(tmp_path: Path, extra: str = "", base: str = BASE) -> Path:
    path = tmp_path / "conf" / "worker.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(base + extra)
    return path


def error_of(path: Path | None, overrides: dict[str, object] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_settings(RoleSettings, path, overrides)
    return caught.value.message


def test_file_values_and_defaults_load(tmp_path: Path) -> None:
    settings = load_settings(RoleSettings, write(tmp_path, '[net]\ngateways = ["gw:7000"]\n'))
    assert settings.name == "w1"
    assert settings.net.gateways == ["gw:7000"]
    assert settings.net.listen == "127.0.0.1:0"
    assert settings.log.level == "info"


def test_env_beats_file_and_overrides_beat_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[net]\nlisten = "127.0.0.1:1000"\nkeepalive_s = 5.0\n[log]\nlevel = "debug"\n')
    monkeypatch.setenv("HYPHA_NET__LISTEN", "127.0.0.1:2000")
    monkeypatch.setenv("HYPHA_NET__KEEPALIVE_S", "7")
    monkeypatch.setenv("HYPHA_NAME", "from-env")

    settings = load_settings(RoleSettings, path, {"net.listen": "127.0.0.1:3000", "log": {"format": "json"}})

    assert settings.net.listen == "127.0.0.1:3000"
    assert settings.net.keepalive_s == 7.0
    assert settings.name == "from-env"
    # Tables merge key by key: the file's log.level survives an override of log.format.
    assert (settings.log.level, settings.log.format) == ("debug", "json")


def test_relative_paths_in_file_resolve_against_its_directory(tmp_path: Path) -> None:
    base = BASE.replace('name = "w1"', 'name = "w1"\nstate_dir = "st"')
    path = write(tmp_path, '[role]\ncache = "c"\n[[role.jobs]]\nname = "j"\ndata = "../d.bin"\n', base=base)
    conf = path.parent.absolute()

    settings = load_settings(RoleSettings, path)

    assert settings.tls.cert == conf / "certs/w1-cert.pem"
    assert settings.tls.key == Path("/abs/w1-key.pem")
    assert settings.state_dir == conf / "st"
    assert settings.role.cache == conf / "c"
    assert settings.role.jobs[0].data == conf / "../d.bin"


def test_relative_default_path_resolves_against_the_config_directory(tmp_path: Path) -> None:
    path = write(tmp_path, "[[role.jobs]]\nname = 'j'\n")
    assert load_settings(RoleSettings, path).role.cache == path.parent.absolute() / "cache"


def test_without_a_file_every_relative_path_resolves_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(
        RoleSettings, None, {"name": "n", "tls": {"cert": "c", "key": "k", "trust": "t"}}
    )
    assert settings.role.cache == tmp_path / "cache"
    assert settings.tls.cert == tmp_path / "c"


def test_relative_paths_from_env_and_flags_resolve_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HYPHA_STATE_DIR", "here")
    settings = load_settings(
        RoleSettings, write(tmp_path), {"role.cache": "flag-cache", "role.jobs": [{"name": "j", "data": "d"}]}
    )
    assert settings.state_dir == cwd / "here"
    assert settings.role.cache == cwd / "flag-cache"
    assert settings.role.jobs[0].data == cwd / "d"
    # The file's own paths still resolve against the file's directory.
    assert settings.tls.cert == tmp_path / "conf" / "certs/w1-cert.pem"


def test_no_relative_path_survives_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYPHA_TLS__CRL", "crl.pem")
    settings = load_settings(RoleSettings, write(tmp_path), {"state_dir": "~/st"})
    paths = [settings.tls.cert, settings.tls.key, settings.tls.trust, settings.tls.crl, settings.state_dir]
    assert all(p is not None and p.is_absolute() for p in [*paths, settings.role.cache])
    assert settings.state_dir == Path.home() / "st"


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[net]\nlistn = "127.0.0.1:1"\n')
    # The keys the table accepts come with the error, so the typo's fix is in sight.
    assert error_of(path) == (
        f"config error in {path}: net.listn: unknown key "
        "(known here: external_addresses, gateways, keepalive_s, listen, max_concurrent_rpcs, "
        "max_message_bytes, max_rpcs_per_peer, relay_max_call_s, relay_max_calls, relay_max_calls_per_peer)"
    )


def test_wrong_type_in_file_names_key_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, '[net]\nkeepalive_s = "abc"\n')
    message = error_of(path)
    assert message.startswith(f"config error in {path}: net.keepalive_s: input should be a valid number")
    assert message.endswith('(got "abc")')


def test_every_bad_key_is_reported_on_its_own_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[[role.jobs]]\nname = "a"\nepochs = "x"\nbogus = 1\n[log]\nlevel = "loud"\n')
    lines = error_of(path).splitlines()
    assert len(lines) == 3
    assert any("role.jobs[0].epochs: input should be a valid integer" in line for line in lines)
    assert any("role.jobs[0].bogus: unknown key (known here: " in line and "epochs" in line for line in lines)
    assert any("log.level: input should be" in line and '(got "loud")' in line for line in lines)


def test_missing_required_key_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, base=BASE.replace('cert = "certs/w1-cert.pem"\n', ""))
    assert error_of(path) == f"config error in {path}: tls.cert: field required"


def test_missing_required_key_without_file() -> None:
    assert "name: field required" in error_of(None, {"tls": {"cert": "c", "key": "k", "trust": "t"}})


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[net]\nlisten = 127.0.0.1:0\n")
    message = error_of(path)
    assert message.startswith(f"config error in {path}, line 8,")
    assert "invalid TOML" in message


def test_missing_file_is_named(tmp_path: Path) -> None:
    assert error_of(tmp_path / "nope.toml") == f"config file {tmp_path / 'nope.toml'} not found"


def test_invalid_listen_address_is_rejected(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, '[net]\nlisten = "x"\ngateways = ["gw:1", "gw"]\n'))
    assert 'net.listen: expected HOST:PORT (got "x")' in message
    assert 'net.gateways[1]: expected HOST:PORT (got "gw")' in message


def test_env_var_with_wrong_type_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPHA_NET__KEEPALIVE_S", "abc")
    message = error_of(write(tmp_path))
    assert message.startswith(
        "config error in environment variable HYPHA_NET__KEEPALIVE_S: net.keepalive_s: "
    )
    assert '(got "abc")' in message


def test_env_var_with_invalid_json_list_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPHA_NET__GATEWAYS", "gw:7000")
    monkeypatch.setenv("HYPHA_NET__LISTEN", "127.0.0.1:1")
    assert error_of(write(tmp_path)).startswith("config error in environment variable HYPHA_NET__GATEWAYS:")


def test_env_var_with_json_list_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPHA_NET__GATEWAYS", '["gw:1", "gw:2"]')
    assert load_settings(RoleSettings, write(tmp_path)).net.gateways == ["gw:1", "gw:2"]


def test_unrelated_hypha_env_var_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPHA_HOME", "/somewhere")
    assert load_settings(RoleSettings, write(tmp_path)).name == "w1"


def test_unknown_env_var_under_a_known_section_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPHA_NET__LISTN", "127.0.0.1:1")
    assert (
        error_of(write(tmp_path))
        == "config error in environment variable HYPHA_NET__LISTN: net.listn: unknown key "
        "(known here: external_addresses, gateways, keepalive_s, listen, max_concurrent_rpcs, "
        "max_message_bytes, max_rpcs_per_peer, relay_max_call_s, relay_max_calls, relay_max_calls_per_peer)"
    )


def test_bad_override_is_attributed_to_the_command_line(tmp_path: Path) -> None:
    message = error_of(write(tmp_path), parse_overrides(["net.keepalive_s=abc"]))
    assert message.startswith("config error in command-line overrides: net.keepalive_s:")


def test_parse_overrides_nests_dotted_keys_and_reads_toml_arrays() -> None:
    parsed = parse_overrides(["net.listen=0.0.0.0:5000", 'net.gateways=["a:1", "b:2"]', "log.level = debug"])
    assert parsed == {
        "net": {"listen": "0.0.0.0:5000", "gateways": ["a:1", "b:2"]},
        "log": {"level": "debug"},
    }


def test_parse_overrides_keeps_scalars_as_strings_for_the_field_to_convert() -> None:
    assert parse_overrides(["name=123", "x='quoted'", "y=", "z=a=b"]) == {
        "name": "123",
        "x": "quoted",
        "y": "",
        "z": "a=b",
    }


def test_override_scalars_convert_by_field_type(tmp_path: Path) -> None:
    overrides = parse_overrides(["name=123", "net.keepalive_s=30", "telemetry.sample_ratio=0.5"])
    settings = load_settings(RoleSettings, write(tmp_path), overrides)
    assert (settings.name, settings.net.keepalive_s, settings.telemetry.sample_ratio) == ("123", 30.0, 0.5)


def test_override_inline_table_keys_are_not_dotted_paths() -> None:
    parsed = parse_overrides(['role.tags={ "gpu kind" = "h100", "a.b" = 1 }', "role.tags.x=y"])
    assert parsed == {"role": {"tags": {"gpu kind": "h100", "a.b": 1, "x": "y"}}}


def test_later_override_wins() -> None:
    assert parse_overrides(["net.listen=a:1", "net.listen=b:2"]) == {"net": {"listen": "b:2"}}


@pytest.mark.parametrize("item", ["novalue", "=x", "net..listen=x", "net.=x", "bad key=1", "_env_prefix=X"])
def test_malformed_override_is_rejected(item: str) -> None:
    with pytest.raises(ConfigError, match="bad override"):
        parse_overrides([item])


def test_override_setting_a_value_and_a_subkey_conflicts() -> None:
    with pytest.raises(ConfigError, match="net is already set"):
        parse_overrides(["net=1", "net.listen=a:1"])


def test_print_config_error_and_exit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        print_config_error_and_exit(ConfigError("config error in x.toml: name: field required"))
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: config error in x.toml: name: field required\n"
