"""Configuration: TOML file < ``HYPHA_*`` environment < CLI flags (ARCHITECTURE §9).

``load_settings`` builds a role's settings with that precedence and turns every
failure into a ``ConfigError`` naming the key and where the bad value came from;
``render_example`` writes the commented example config that ``init`` hands out.
"""

from hypha.config.common import LogConfig, NetConfig, NodeSettings, TelemetryConfig, TlsConfig
from hypha.config.loader import load_settings, parse_overrides, print_config_error_and_exit
from hypha.config.template import render_example

__all__ = [
    "LogConfig",
    "NetConfig",
    "NodeSettings",
    "TelemetryConfig",
    "TlsConfig",
    "load_settings",
    "parse_overrides",
    "print_config_error_and_exit",
    "render_example",
]
