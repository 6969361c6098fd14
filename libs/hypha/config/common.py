"""The configuration sections every node shares, and the base of each role's settings.

Every field carries a ``description`` that states its meaning and default:
``hypha.config.template`` writes the commented example config from them, so the
description is the user-facing documentation of the key.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

_REL = "A relative path is resolved against the config file's directory."


def _check_host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError("expected HOST:PORT")
    return value


class TlsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cert: Path = Field(
        description=f"PEM certificate of this node, issued by the network's CA; it carries the node's role "
        f"and peer id. {_REL}",
        examples=["certs/node-cert.pem"],
    )
    key: Path = Field(
        description=f"PEM private key of the certificate. {_REL}", examples=["certs/node-key.pem"]
    )
    trust: Path = Field(
        description=f"PEM bundle of the CA certificates peers must chain to. {_REL}",
        examples=["certs/node-trust.pem"],
    )
    crl: Path | None = Field(
        None,
        description=f"PEM certificate revocation list to honour; unset: no revocation checks. {_REL}",
        examples=["certs/network.crl.pem"],
    )


class NetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen: str = Field(
        "127.0.0.1:0", description="HOST:PORT this node serves gRPC on; port 0 picks any free port."
    )
    external_addresses: list[str] = Field(
        default_factory=list,
        description="Addresses (HOST:PORT) to advertise to peers, e.g. behind NAT; empty: the bound listen "
        "address, or for a wildcard listen (0.0.0.0, ::) this host's non-loopback addresses, never "
        "127.0.0.1 unless it has no other. Peers check the address dialled against the certificate's "
        "SANs (hypha-certutil node --san).",
    )
    gateways: list[Annotated[str, AfterValidator(_check_host_port)]] = Field(
        default_factory=list, description="Gateways (HOST:PORT) to connect to, tried in this order."
    )
    max_message_bytes: int = Field(
        2 * 1024 * 1024, ge=1024, description="Largest gRPC message sent or accepted, in bytes."
    )
    keepalive_s: float = Field(
        20.0, gt=0, description="Seconds between gRPC keepalive pings on idle connections."
    )
    max_concurrent_rpcs: int = Field(
        1024,
        ge=1,
        description="Most gRPC calls (streams included) this node's server runs at once; more are "
        "refused with RESOURCE_EXHAUSTED.",
    )
    max_rpcs_per_peer: int = Field(
        256,
        ge=1,
        description="Of those, most one peer (one certificate's peer id) may hold at once; more are refused "
        "with RESOURCE_EXHAUSTED, so one peer cannot take every slot.",
    )
    relay_max_calls: int = Field(
        64,
        ge=1,
        description="Most relayed calls this node serves at once; more are refused RESOURCE_EXHAUSTED.",
    )
    relay_max_calls_per_peer: int = Field(
        16,
        ge=1,
        description="Of those, most one calling peer may hold at once; more are refused RESOURCE_EXHAUSTED.",
    )
    relay_max_call_s: float = Field(
        3600.0,
        gt=0,
        description="Longest a relayed call this node serves may run: the deadline of a call whose caller "
        "set none, and the cap of a longer one (it ends DEADLINE_EXCEEDED).",
    )

    _listen = field_validator("listen")(_check_host_port)


class LogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Least severe log level written: debug, info, warning or error."
    )
    format: Literal["text", "json"] = Field(
        "text", description="Log line format: text for people, json (one object per line) for collectors."
    )


class TelemetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(
        None,
        description="OTLP endpoint traces and metrics are exported to; unset: OTEL_EXPORTER_OTLP_ENDPOINT "
        "if set, else no export.",
        examples=["http://127.0.0.1:4317"],
    )
    service_name: str | None = Field(
        None, description="Service name reported to telemetry; unset: the program name and node name."
    )
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of traces sampled, from 0 (none) to 1 (all)."
    )


#: The parsed config file of the ``load_settings`` call in progress (see ``_FileSource``).
FILE_VALUES: ContextVar[dict[str, Any] | None] = ContextVar("hypha_config_file_values", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The config file, as ``load_settings`` parsed it (relative paths already rebased).

    The loader reads the TOML itself, rather than through ``TomlConfigSettingsSource``,
    so that syntax errors name the line and paths can be rebased on the file's directory.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return FILE_VALUES.get() or {}


class NodeSettings(BaseSettings):
    """Settings every role shares; a role's subclass adds its own ``[role]`` section.

    Layers, lowest to highest: config file < ``HYPHA_*`` environment < init arguments
    (the CLI's overrides); pydantic-settings merges them, nested tables key by key.
    Load through ``hypha.config.loader.load_settings``, which supplies the file layer
    and turns validation errors into a ``ConfigError`` naming each key and its source.

    Environment: ``HYPHA_NAME``, ``HYPHA_NET__LISTEN``, ``HYPHA_TLS__CERT``; lists and
    whole tables as JSON (``HYPHA_NET__GATEWAYS='["gw:7000"]'``). A ``HYPHA_*``
    variable that names no field (``HYPHA_HOME``) is ignored, so variables meant for
    other tools never break a node. One under a known section (``HYPHA_NET__LISTN``)
    is an unknown key and an error, like a typo in the file, and a variable whose
    value has the wrong type is an error naming the variable. ``.env`` files and
    secrets directories are not read.
    """

    model_config = SettingsConfigDict(extra="forbid", env_prefix="HYPHA_", env_nested_delimiter="__")

    name: str = Field(
        description="Node name, used in logs and as part of the default telemetry service name.",
        examples=["node-1"],
    )
    tls: TlsConfig = Field(description="mTLS identity of this node.")
    net: NetConfig = Field(default_factory=NetConfig, description="Network addresses and gRPC limits.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging.")
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="OpenTelemetry traces and metrics."
    )
    state_dir: Path | None = Field(
        None,
        description=f"Directory for state that should survive a restart; unset: nothing kept on disk. {_REL}",
        examples=["state"],
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)
