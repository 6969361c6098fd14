"""Which torch model factories a job may name: a worker-side allowlist, checked before any import.

A ``torch`` model spec names a callable by import path and the job file
supplies its keyword arguments, so an unchecked path is arbitrary code on the
worker (``subprocess:run`` with ``args`` and ``shell``). The scheduler cannot
know each worker's list, so the worker refuses the dispatch
(PERMISSION_DENIED, naming the setting) and the executor checks again, from
the list the worker hands it in ``HYPHA_MODEL_FACTORIES``, before
``importlib`` sees the path. This module imports nothing heavy: the worker
checks without loading torch.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from hypha.errors import InvalidArgumentError, PermissionDeniedError

#: Factories every worker accepts: none ship with Hypha today (the built-in models are
#: Hugging Face configurations, built through the Auto classes, not factories).
BUILTIN_FACTORIES: frozenset[str] = frozenset()
#: The environment variable an executor reads its worker's allowlist from (comma-separated).
ENV_VAR = "HYPHA_MODEL_FACTORIES"
#: The setting operators extend; named in every refusal.
SETTING = "worker.jobs.model_factories"


def split_path(path: str) -> tuple[str, str]:
    """(module, attribute) of ``"pkg.mod:factory"``; InvalidArgumentError for anything else."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise InvalidArgumentError(f"torch_factory must look like 'pkg.module:factory', got {path!r}")
    return module, attr


def is_allowed(path: str, allowed: Collection[str]) -> bool:
    """Whether ``path`` is listed, exactly or by its module's ``pkg.module:*``."""
    module, _ = split_path(path)
    entries = set(allowed) | BUILTIN_FACTORIES
    return path in entries or f"{module}:*" in entries


def check(path: str, allowed: Collection[str]) -> None:
    """Refuse a factory that is not on the allowlist (PermissionDeniedError naming the setting)."""
    if not is_allowed(path, allowed):
        raise PermissionDeniedError(
            f"torch_factory {path!r} is not allowed on this worker (add it to {SETTING} to allow it)"
        )


def from_env() -> frozenset[str]:
    """The allowlist the worker handed this executor."""
    return frozenset(entry.strip() for entry in os.environ.get(ENV_VAR, "").split(",") if entry.strip())


def to_env(allowed: Collection[str]) -> str:
    return ",".join(sorted(set(allowed)))


__all__ = [
    "BUILTIN_FACTORIES",
    "ENV_VAR",
    "SETTING",
    "check",
    "from_env",
    "is_allowed",
    "split_path",
    "to_env",
]
