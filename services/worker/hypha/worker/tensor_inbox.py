"""What the tensor exchange keeps: its bounds, the verified payloads it hands out, and per job
its inboxes and publications (split from ``transfer``, which moves the bytes)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hypha.errors import InvalidArgumentError
from hypha.tensors.chunks import DEFAULT_CHUNK_SIZE
from hypha.worker.tensor_files import SharedDigest

_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class ChannelSource(Protocol):
    """What ``PeerConnector`` offers: a channel to a peer (direct or relayed), and forgetting it."""

    async def channel(self, peer_id: str, addresses: list[str]) -> Any: ...

    async def invalidate(self, peer_id: str) -> None: ...


@dataclass(frozen=True)
class TransferSettings:
    """Bounds of the exchange; every wait and every buffer has one."""

    #: Complete payloads waiting per (job, kind) before pushes wait, then get RESOURCE_EXHAUSTED.
    inbox_max: int = 16
    #: How long a completed push waits for room in a full inbox.
    inbox_put_timeout_s: float = 30.0
    #: Largest payload accepted (declared size, checked before the first byte is kept).
    max_payload_bytes: int = 8 << 30
    #: Larger payloads are spooled to a file in ``spool_dir`` as they arrive, not held in memory.
    memory_payload_bytes: int = 64 << 20
    #: Where spooled payloads go (None: a ``hypha-tensor-spool`` dir in the system temp dir).
    spool_dir: Path | None = None
    #: Bytes of complete payloads queued per job (memory and spool) before pushes wait, then fail.
    inbox_max_bytes: int = 16 << 30
    chunk_size: int = DEFAULT_CHUNK_SIZE
    #: Attempts of one send when the stream breaks or the peer is unreachable.
    send_attempts: int = 4
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 5.0
    #: Deadline of one PushTensors call (a whole payload).
    push_timeout_s: float = 600.0
    #: Rounds kept published per (job, kind); older ones are forgotten.
    keep_published: int = 4
    #: Longest a PullTensors call waits for its round when the caller set no deadline.
    max_pull_wait_s: float = 3600.0


@dataclass(frozen=True)
class TensorPayload:
    """A complete, verified payload and who sent it (from the TLS session, not the message).

    Either ``data`` holds it, or (larger than ``memory_payload_bytes``) ``path`` names a spool
    file that the consumer owns: ``read()`` returns the bytes either way, ``release()`` deletes
    the file once it has been used.
    """

    job_id: str
    kind: str
    round: int
    samples: int
    from_peer: str
    data: bytes = field(default=b"", repr=False)
    path: Path | None = None
    size: int = -1

    @property
    def nbytes(self) -> int:
        return self.size if self.size >= 0 else len(self.data)

    def read(self) -> bytes:
        """The payload's bytes (read from the spool file when there is one)."""
        return self.path.read_bytes() if self.path is not None else self.data

    def release(self) -> None:
        """Delete the spool file, if any (idempotent)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Published:
    """A file served to pullers of one (job, kind, round), hashed once for all of them."""

    path: Path
    samples: int
    digest: SharedDigest | None = None


class JobTensors:
    """One job's inboxes (per kind), publications, byte budget and byte counters."""

    def __init__(self, inbox_max: int) -> None:
        self.inbox_max = inbox_max
        self.inboxes: dict[str, asyncio.Queue[TensorPayload]] = {}
        self.published: dict[str, dict[int, Published]] = {}
        self.changed = asyncio.Condition()
        self.users = 0
        #: Bytes of the payloads queued or being received, against ``inbox_max_bytes``.
        self.held_bytes = 0
        self.room = asyncio.Condition()
        #: Bytes of the streams this worker opened for the job: pushes sent, pulls received.
        #: Every stream has one opener, so summed over a job's workers each byte counts once.
        self.pushed_bytes = 0
        self.pulled_bytes = 0

    def inbox(self, kind: str) -> asyncio.Queue[TensorPayload]:
        queue = self.inboxes.get(kind)
        if queue is None:
            queue = self.inboxes[kind] = asyncio.Queue(maxsize=self.inbox_max)
        return queue


def check_kind(kind: str) -> str:
    if not _KIND.match(kind):
        raise InvalidArgumentError(f"tensor kind {kind!r} must match {_KIND.pattern}")
    return kind


__all__ = ["ChannelSource", "JobTensors", "Published", "TensorPayload", "TransferSettings", "check_kind"]
