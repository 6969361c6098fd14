"""The job bridge as the executors see it: the calls they make and the tensor kinds they exchange.

The executors talk to their worker only through the job bridge
(docs/job-bridge.md). ``Bridge`` is the part of ``hypha.bridge_client.BridgeClient``
they use, written as a Protocol so that tests and benchmarks can connect a
trainer and a parameter server in one process through a fake.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from hypha.errors import UnavailableError


class JobInfo(Protocol):
    """``GET /v1/job``: who this executor is in the job."""

    @property
    def job_id(self) -> str: ...
    @property
    def spec(self) -> Any: ...  # JobSpec proto, or its JSON form as a dict
    @property
    def work_dir(self) -> Path | str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def parameter_server_id(self) -> str: ...
    @property
    def trainer_ids(self) -> Sequence[str]: ...
    @property
    def start_round(self) -> int: ...
    @property
    def attempt(self) -> int: ...


class SliceInfo(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def path(self) -> Path | str: ...


class Directive(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def batches(self) -> int: ...
    @property
    def round(self) -> int: ...


class Received(Protocol):
    @property
    def data(self) -> bytes: ...
    @property
    def from_peer(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def round(self) -> int: ...
    @property
    def samples(self) -> int: ...


class Bridge(Protocol):
    """The job-bridge calls the DiLoCo executors make (``hypha.bridge_client.BridgeClient``)."""

    async def job(self) -> JobInfo: ...
    async def fetch_resource(self, name: str) -> Path: ...
    async def next_slice(self) -> SliceInfo | None: ...
    async def slices_used(self, indices: Sequence[int]) -> None: ...
    async def progress(
        self,
        round: int,
        batches: int,
        samples: int,
        loss: float,
        batch_seconds: float,
        batch_size: int,
        next_batch_started: bool = False,
    ) -> Directive: ...
    async def metrics(self, round: int, values: Mapping[str, float]) -> None: ...
    async def log(self, stream: str, line: str) -> None: ...
    async def send_tensors(self, peer: str, kind: str, round: int, samples: int, path: Path) -> Any: ...
    async def inbox(self, kind: str, timeout_s: float) -> Received | None: ...
    async def publish_tensors(self, kind: str, round: int, path: Path) -> None: ...
    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None: ...
    async def result(self, path: Path) -> None: ...
    async def status(self, state: str, message: str) -> None: ...


def send_outcome(reply: Any) -> tuple[bool, str]:
    """``send_tensors``' reply as (accepted, message), whether a tuple or an object."""
    if isinstance(reply, tuple):
        return bool(reply[0]), str(reply[1]) if len(reply) > 1 else ""
    return bool(reply.accepted), str(getattr(reply, "message", ""))


#: Tensor kinds exchanged between trainers and the parameter server.
DELTA, UPDATE, GLOBAL = "delta", "update", "global"
#: Payload metadata key on published θ_global: the round it is the starting point of.
GLOBAL_ROUND_KEY = "global_round"


def raise_if_bridge_gone(exc: UnavailableError) -> None:
    """Re-raise when the job bridge itself cannot be reached: the worker is gone.

    NOTE: the bridge is a local Unix socket, so a refused or missing
    connection (an OSError behind the error, other than a timeout) does not
    heal; carrying on would leave an orphaned executor retrying for as long as
    its patience lasts. Failures the bridge reports (503: a peer or the
    scheduler is unreachable) stay retryable.
    """
    cause = exc.__cause__
    if isinstance(cause, OSError) and not isinstance(cause, TimeoutError):
        raise exc
