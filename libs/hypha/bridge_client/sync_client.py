"""``SyncBridgeClient``: the job bridge client for plain scripts, without asyncio.

Split from ``client``: each method runs the same call of ``BridgeClient`` on a
private event loop, so a task's ``train.py`` can talk to its worker with no
async code (docs/job-bridge.md).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from hypha.bridge_client.client import (
    ENV_SOCKET,
    BridgeClient,
    Directive,
    JobInfo,
    LogStream,
    Received,
    ReportedState,
    SliceInfo,
)
from hypha.errors import FailedPreconditionError

T = TypeVar("T")


class SyncBridgeClient:
    """Blocking wrapper for plain scripts: the same methods, each run on a private event loop.

    Not for use inside a running event loop (use ``BridgeClient`` there).
    """

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
        self._runner = asyncio.Runner()
        self.client = BridgeClient(socket_path, timeout_s=timeout_s)

    @classmethod
    def from_env(cls, *, timeout_s: float = 60.0) -> SyncBridgeClient:
        path = os.environ.get(ENV_SOCKET)
        if not path:
            raise FailedPreconditionError(
                f"{ENV_SOCKET} is not set: this process was not started by a Hypha worker"
            )
        return cls(path, timeout_s=timeout_s)

    def _run(self, call: Awaitable[T]) -> T:
        return self._runner.run(call)  # type: ignore[arg-type]

    def close(self) -> None:
        self._runner.run(self.client.close())
        self._runner.close()

    def __enter__(self) -> SyncBridgeClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def job(self) -> JobInfo:
        return self._run(self.client.job())

    def fetch_resource(self, name: str, *, timeout_s: float = 3600.0) -> Path:
        return self._run(self.client.fetch_resource(name, timeout_s=timeout_s))

    def next_slice(self, *, timeout_s: float = 600.0) -> SliceInfo | None:
        return self._run(self.client.next_slice(timeout_s=timeout_s))

    def slices_used(self, indices: Sequence[int]) -> None:
        self._run(self.client.slices_used(indices))

    def progress(
        self,
        round: int,
        batches: int,
        samples: int,
        loss: float,
        batch_seconds: float,
        batch_size: int,
        next_batch_started: bool = False,
    ) -> Directive:
        return self._run(
            self.client.progress(round, batches, samples, loss, batch_seconds, batch_size, next_batch_started)
        )

    def metrics(self, round: int, values: Mapping[str, float]) -> None:
        self._run(self.client.metrics(round, values))

    def log(self, stream: LogStream | str, line: str) -> None:
        self._run(self.client.log(stream, line))

    def status(self, state: ReportedState | str, message: str = "") -> None:
        self._run(self.client.status(state, message))

    def result(self, path: str | os.PathLike[str]) -> None:
        self._run(self.client.result(path))

    def send_tensors(
        self, peer: str, kind: str, round: int, samples: int, path: str | os.PathLike[str]
    ) -> tuple[bool, str]:
        return self._run(self.client.send_tensors(peer, kind, round, samples, path))

    def inbox(self, kind: str, timeout_s: float) -> Received | None:
        return self._run(self.client.inbox(kind, timeout_s))

    def publish_tensors(self, kind: str, round: int, path: str | os.PathLike[str]) -> None:
        self._run(self.client.publish_tensors(kind, round, path))

    def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        return self._run(self.client.fetch_tensors(peer, kind, round, timeout_s))
