"""Which scheduler a command talks to, with which certificate, and the channel it uses.

Flags win over ``HYPHA_SCHEDULER`` / ``HYPHA_CERTS`` / ``HYPHA_CLIENT_NAME``;
without either, the local cluster started by ``hypha up`` (its
``cluster.json`` in ``HYPHA_STATE_DIR`` or ``.hypha``) supplies both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypha.client.registry import UsageError
from hypha.errors import ConfigError, HyphaError, UnavailableError
from hypha.net.channel import check_server, secure_channel
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.pki.identity import Role
from hypha.v1 import scheduler_pb2_grpc

DEFAULT_TIMEOUT_S = 10.0


def _local_cluster() -> dict[str, Any] | None:
    """The state file of a local cluster started by ``hypha up``, if there is one."""
    state = Path(os.environ.get("HYPHA_STATE_DIR", ".hypha")).absolute() / "cluster.json"
    try:
        data = json.loads(state.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Target:
    address: str
    tls: TlsMaterial
    server_name: str | None
    timeout_s: float


def target_of(args: argparse.Namespace) -> Target:
    address = getattr(args, "scheduler", None) or os.environ.get("HYPHA_SCHEDULER")
    certs = getattr(args, "certs", None) or os.environ.get("HYPHA_CERTS")
    name = getattr(args, "name", None) or os.environ.get("HYPHA_CLIENT_NAME")
    if not address or not certs:
        cluster = _local_cluster()
        if cluster is not None:
            node = cluster.get("nodes", {}).get("scheduler", {})
            address = address or node.get("address")
            certs = certs or cluster.get("pki")
    if not address:
        raise UsageError("no scheduler: give --scheduler HOST:PORT (or set HYPHA_SCHEDULER)")
    if not certs:
        raise UsageError("no client certificate: give --certs DIR --name N (or set HYPHA_CERTS)")
    try:
        tls = TlsMaterial.load(
            PathsTls.from_certs_dir(Path(certs).absolute(), name or "client", _crl_of(Path(certs).absolute()))
        )
    except ConfigError as err:
        raise UsageError(f"client certificate: {err.message}") from None
    timeout = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    return Target(address, tls, getattr(args, "server_name", None), timeout)


def _crl_of(certs: Path) -> Path | None:
    """The CRL a client honours: ``HYPHA_CRL``, else ``crl.pem`` beside its certificates, if there."""
    named = os.environ.get("HYPHA_CRL")
    if named:
        return Path(named).absolute()
    beside = certs / "crl.pem"
    return beside if beside.is_file() else None


class Session:
    """One channel to the scheduler for the duration of a command.

    On entry the server's certificate is checked (a scheduler's, not revoked):
    a client hands the scheduler its job files and secrets, so it must not
    talk to a revoked node that still holds the address.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self.channel = secure_channel(target.tls, target.address, server_name=target.server_name)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.timeout = target.timeout_s

    async def __aenter__(self) -> Session:
        try:
            await check_server(
                self.target.tls,
                self.target.address,
                roles=frozenset({Role.SCHEDULER}),
                server_name=self.target.server_name,
                timeout_s=self.timeout,
            )
        except UnavailableError as err:
            await self.channel.close()
            raise UnavailableError(f"cannot reach the scheduler: {err.message}") from None
        except HyphaError:
            await self.channel.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()


def run_session(args: argparse.Namespace, body: Callable[[Session], Awaitable[int]]) -> int:
    """Resolve the target from ``args``, open a session and run ``body`` in it; its exit code."""
    target = target_of(args)

    async def go() -> int:
        async with Session(target) as session:
            return await body(session)

    return asyncio.run(go())
