"""The executor side of the job bridge: what a training script calls to reach its worker.

An executor process (the built-in DiLoCo trainer, the parameter server, or a
user's own script) never speaks gRPC and knows nothing about peers or
gateways: it talks HTTP/1.1 over the Unix socket the worker created in its
private work dir (``docs/job-bridge.md`` is the contract). ``BridgeClient`` is
the asyncio client; ``SyncBridgeClient`` wraps it for plain scripts.

Errors come back as ``BridgeError`` (a ``HyphaError``) carrying the HTTP
status and the bridge's message, so ``except NotFoundError`` style handling
works the same on both sides of the socket.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import aiohttp

from hypha.directives import DirectiveKind
from hypha.errors import (
    DataLossError,
    FailedPreconditionError,
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from hypha.memtune import tune_malloc
from hypha.service import Resource

if TYPE_CHECKING:
    from hypha.v1 import common_pb2

T = TypeVar("T")

#: Environment variables the worker sets for every executor process.
ENV_SOCKET = "HYPHA_BRIDGE_SOCKET"
ENV_WORK_DIR = "HYPHA_WORK_DIR"
ENV_JOB_ID = "HYPHA_JOB_ID"
ENV_EXECUTOR = "HYPHA_EXECUTOR"
ENV_TORCH_THREADS = "HYPHA_TORCH_THREADS"

# A sun_path holds 108 bytes on Linux; longer socket paths are reached through the directory's fd.
_MAX_SUN_PATH = 100

LogStream = Literal["stdout", "stderr", "system"]
ReportedState = Literal["running", "succeeded", "failed"]


class BridgeError(HyphaError):
    """The bridge refused a request; ``http_status`` is its HTTP status."""

    def __init__(self, http_status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = http_status


class BridgeInvalidError(BridgeError, InvalidArgumentError):
    """400 (malformed) or 413 (too large)."""


class BridgeForbiddenError(BridgeError, PermissionDeniedError):
    """403: a path outside the job's work dir."""


class BridgeNotFoundError(BridgeError, NotFoundError):
    """404: unknown resource, file or job."""


class BridgeConflictError(BridgeError, FailedPreconditionError):
    """409: the request does not fit the job's state."""


class BridgeUnavailableError(BridgeError, UnavailableError):
    """503 (and other 5xx): the scheduler, a peer or the hub did not answer; retry later."""


_ERRORS: dict[int, type[BridgeError]] = {
    400: BridgeInvalidError,
    403: BridgeForbiddenError,
    404: BridgeNotFoundError,
    409: BridgeConflictError,
    413: BridgeInvalidError,
}


@dataclass(frozen=True)
class JobInfo:
    """What the worker tells an executor about its job (``GET /v1/job``)."""

    job_id: str
    executor: str
    #: The JobSpec as protobuf JSON (field names as in the .proto); ``spec_proto()`` parses it.
    spec: dict[str, Any]
    work_dir: Path
    batch_size: int = 0
    parameter_server_id: str = ""
    trainer_ids: tuple[str, ...] = ()
    start_round: int = 0
    attempt: int = 0

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> JobInfo:
        return cls(
            job_id=str(body["job_id"]),
            executor=str(body["executor"]),
            spec=dict(body.get("spec") or {}),
            work_dir=Path(body["work_dir"]),
            batch_size=int(body.get("batch_size") or 0),
            parameter_server_id=str(body.get("parameter_server_id") or ""),
            trainer_ids=tuple(body.get("trainer_ids") or ()),
            start_round=int(body.get("start_round") or 0),
            attempt=int(body.get("attempt") or 0),
        )

    def spec_proto(self) -> common_pb2.JobSpec:
        from google.protobuf import json_format

        from hypha.v1 import common_pb2

        return json_format.ParseDict(self.spec, common_pb2.JobSpec(), ignore_unknown_fields=True)


@dataclass(frozen=True)
class SliceInfo:
    """A verified data slice, already on disk in the work dir."""

    index: int
    epoch: int
    path: Path


@dataclass(frozen=True)
class Directive:
    """The scheduler's answer to a progress report.

    ``continue``: keep training; ``sync_after``: run ``batches`` more batches,
    then sync; ``sync_now``: sync now; ``done``: the job is over, stop.
    """

    kind: DirectiveKind
    batches: int = 0
    round: int = 0


@dataclass(frozen=True)
class Received:
    """A complete, checksum-verified tensor payload a peer pushed to this job."""

    data: bytes = field(repr=False)
    from_peer: str
    kind: str
    round: int
    samples: int


def torch_threads() -> int | None:
    """The torch thread count the worker chose for this process (``HYPHA_TORCH_THREADS``), if any."""
    value = os.environ.get(ENV_TORCH_THREADS, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def apply_torch_threads() -> int | None:
    """Call ``torch.set_num_threads`` with the worker's choice; the count applied, or None.

    Executors call this once at start: several trainers on one machine each
    using every core run several times slower than with a share each.
    """
    threads = torch_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return threads


class BridgeClient(Resource):
    """Asyncio client of one job's bridge. Cheap to create; one HTTP session, closed by ``close()``.

    ``timeout_s`` bounds ordinary calls; the calls that wait on purpose
    (``inbox``, ``fetch_tensors``, ``send_tensors``, ``fetch_resource``) get
    their own, longer bound.
    """

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
        tune_malloc()  # a job process moves whole tensor payloads (hypha.memtune)
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._dir_fd: int | None = None

    @classmethod
    def from_env(cls, *, timeout_s: float = 60.0) -> BridgeClient:
        """The client for the job this process runs (``HYPHA_BRIDGE_SOCKET``)."""
        path = os.environ.get(ENV_SOCKET)
        if not path:
            raise FailedPreconditionError(
                f"{ENV_SOCKET} is not set: this process was not started by a Hypha worker"
            )
        return cls(path, timeout_s=timeout_s)

    # ---- lifecycle -------------------------------------------------------------

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    # ---- the job and its resources -----------------------------------------------

    async def job(self) -> JobInfo:
        return JobInfo.from_json(await self._json("GET", "/v1/job"))

    async def fetch_resource(self, name: str, *, timeout_s: float = 3600.0) -> Path:
        """Download (or link) a resource of the job's spec (``model``, ``preprocessor``); its dir."""
        body = await self._json("POST", "/v1/resources/fetch", {"resource": name}, timeout_s=timeout_s)
        return Path(body["path"])

    async def next_slice(self, *, timeout_s: float = 600.0) -> SliceInfo | None:
        """The next data slice assigned to this worker, or None when the scheduler has none for now."""
        status, body, _ = await self._request("GET", "/v1/slices/next", timeout_s=timeout_s)
        if status == 204:
            return None
        data = _decode_json(body)
        return SliceInfo(int(data["index"]), int(data.get("epoch") or 0), Path(data["path"]))

    async def slices_used(self, indices: Sequence[int]) -> None:
        await self._json("POST", "/v1/slices/used", {"indices": [int(i) for i in indices]})

    # ---- reports ------------------------------------------------------------------

    async def progress(
        self,
        round: int,
        batches: int,
        samples: int,
        loss: float,
        batch_seconds: float,
        batch_size: int,
        next_batch_started: bool = False,
    ) -> Directive:
        """Report the round's progress; the scheduler's directive.

        ``next_batch_started``: the caller started its next batch without waiting
        for this answer and acts on it after that batch (a ``sync_after`` count
        still counts from the batch reported here).
        """
        body = await self._json(
            "POST",
            "/v1/progress",
            {
                "round": round,
                "batches": batches,
                "samples": samples,
                "loss": loss,
                "batch_seconds": batch_seconds,
                "batch_size": batch_size,
                "next_batch_started": next_batch_started,
            },
        )
        return Directive(
            kind=DirectiveKind.parse(body.get("kind", "continue")),
            batches=int(body.get("batches") or 0),
            round=int(body.get("round") or 0),
        )

    async def metrics(self, round: int, values: Mapping[str, float]) -> None:
        await self._json(
            "POST", "/v1/metrics", {"round": round, "values": {k: float(v) for k, v in values.items()}}
        )

    async def log(self, stream: LogStream | str, line: str) -> None:
        await self._json("POST", "/v1/log", {"stream": stream, "line": line})

    async def status(self, state: ReportedState | str, message: str = "") -> None:
        await self._json("POST", "/v1/status", {"state": state, "message": message})

    async def result(self, path: str | os.PathLike[str]) -> None:
        """Mark a dir in the work dir as the job's final artefacts."""
        await self._json("POST", "/v1/result", {"path": str(path)})

    # ---- tensors ---------------------------------------------------------------------

    async def send_tensors(
        self,
        peer: str,
        kind: str,
        round: int,
        samples: int,
        path: str | os.PathLike[str],
        *,
        timeout_s: float = 3600.0,
    ) -> tuple[bool, str]:
        """Stream a SafeTensors file of the work dir to a peer's job; (accepted, message)."""
        body = await self._json(
            "POST",
            "/v1/tensors/send",
            {"peer": peer, "kind": kind, "round": round, "samples": samples, "path": str(path)},
            timeout_s=timeout_s,
        )
        return bool(body.get("accepted")), str(body.get("message") or "")

    async def inbox(self, kind: str, timeout_s: float) -> Received | None:
        """The next payload of ``kind`` peers pushed to this job; None after ``timeout_s``."""
        status, body, headers = await self._request(
            "GET",
            "/v1/tensors/inbox",
            params={"kind": kind, "timeout_s": f"{timeout_s:g}"},
            timeout_s=timeout_s + self.timeout_s,
        )
        if status == 204:
            return None
        return Received(
            data=body,
            from_peer=headers.get("X-Hypha-From", ""),
            kind=headers.get("X-Hypha-Kind", kind),
            round=int(headers.get("X-Hypha-Round", "0")),
            samples=int(headers.get("X-Hypha-Samples", "0")),
        )

    async def publish_tensors(self, kind: str, round: int, path: str | os.PathLike[str]) -> None:
        """Serve a SafeTensors file of the work dir to peers pulling (this job, kind, round)."""
        await self._json("POST", "/v1/tensors/publish", {"kind": kind, "round": round, "path": str(path)})

    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        """Pull a payload a peer's job published; waits up to ``timeout_s`` for it, else None."""
        received = await self.fetch_tensors_received(peer, kind, round, timeout_s)
        return None if received is None else received.data

    async def fetch_tensors_received(
        self, peer: str, kind: str, round: int, timeout_s: float
    ) -> Received | None:
        """Like ``fetch_tensors``, with the round actually served (a ``global`` pull may get a newer one)."""
        status, body, headers = await self._request(
            "GET",
            "/v1/tensors/fetch",
            params={"peer": peer, "kind": kind, "round": str(round), "timeout_s": f"{timeout_s:g}"},
            timeout_s=timeout_s + self.timeout_s,
        )
        if status == 204:
            return None
        return Received(
            data=body,
            from_peer=headers.get("X-Hypha-From", peer),
            kind=headers.get("X-Hypha-Kind", kind),
            round=int(headers.get("X-Hypha-Round", str(round))),
            samples=int(headers.get("X-Hypha-Samples", "0")),
        )

    # ---- transport -----------------------------------------------------------------------

    def _connect_path(self) -> str:
        path = str(self.socket_path)
        if len(path.encode()) <= _MAX_SUN_PATH:
            return path
        # NOTE: deep work dirs exceed sun_path; the directory's fd in /proc is a short alias.
        if self._dir_fd is None:
            self._dir_fd = os.open(self.socket_path.parent, os.O_PATH | os.O_DIRECTORY)
        return f"/proc/self/fd/{self._dir_fd}/{self.socket_path.name}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.UnixConnector(path=self._connect_path())
            self._session = aiohttp.ClientSession(
                base_url="http://hypha-bridge", connector=connector, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes, Mapping[str, str]]:
        timeout = aiohttp.ClientTimeout(total=timeout_s if timeout_s is not None else self.timeout_s)
        try:
            async with self._client().request(
                method, path, json=payload, params=params, timeout=timeout
            ) as response:
                body = await response.read()
                if response.status >= 400:
                    raise _error(response.status, body)
                return response.status, body, dict(response.headers)
        except (aiohttp.ClientConnectionError, TimeoutError) as err:
            raise BridgeUnavailableError(0, f"job bridge at {self.socket_path} unreachable: {err!r}") from err

    async def _json(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        _, body, _ = await self._request(method, path, payload, timeout_s=timeout_s)
        return _decode_json(body) if body else {}


def _decode_json(body: bytes) -> dict[str, Any]:
    import json

    try:
        data = json.loads(body)
    except ValueError as err:
        raise DataLossError(f"job bridge sent malformed JSON: {err}") from None
    if not isinstance(data, dict):
        raise DataLossError("job bridge sent JSON that is not an object")
    return data


def _error(status: int, body: bytes) -> BridgeError:
    try:
        message = str(_decode_json(body).get("error") or "")
    except DataLossError:
        message = body[:200].decode(errors="replace")
    kind = _ERRORS.get(status, BridgeUnavailableError if status >= 500 else BridgeError)
    return kind(status, message or f"HTTP {status}")
