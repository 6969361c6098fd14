"""A DiLoCo job's parameter-server state, kept by the scheduler so the job outlives its server.

After every completed round the parameter server packs θ_global, the outer
optimizer's momentum and the round number into one safetensors blob
(``hypha.diloco.checkpoint.pack``), publishes it as tensor kind ``ps-state``
and reports the round's metrics with ``state_round``. The scheduler pulls
that blob from the server's worker (``PullTensors``, verified chunks) and
writes it atomically under ``<state_dir>/ps-state/<job_id>/`` before it
answers the report: the report is the round's commit. The server publishes
the round's update before it reports (the pull runs while the next round
trains) and the next round's update only after the answer; a server restored
one round behind redoes that round from the trainers' kept deltas. When the server is lost, its
replacement is dispatched with ``start_round`` = the kept round and the blob
is pushed to it (``PushTensors``, kind ``ps-state``); see
``docs/fault-tolerance.md``.

The scheduler has no torch: the blob stays opaque here. Its round comes
from the safetensors header's metadata, read without parsing any tensor.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from hypha.errors import DataLossError
from hypha.fsutil import write_atomic
from hypha.scheduler.worker_calls import WorkerCalls

#: Tensor kind of the packed state, on both sides (``executors.parameter_server.STATE_KIND``).
STATE_KIND = "ps-state"
#: Metrics value by which the parameter server names the round whose state it published.
STATE_ROUND_KEY = "state_round"
#: Header metadata holding the blob's round (``hypha.diloco.checkpoint.PACKED_ROUND_KEY``).
PACKED_ROUND_KEY = "hypha.ps_round"
STATE_DIR = "ps-state"
#: Largest state pulled (θ_global and momentum: twice the model in fp32).
MAX_STATE_BYTES = 16 << 30
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class KeptState:
    """One kept state: the round it resumes, where it lies, its size and sha256."""

    round: int
    path: Path
    size: int
    sha256: str


def packed_round(blob: bytes) -> int:
    """The round a packed state holds, from its header; DataLossError if it names none."""
    try:
        (length,) = struct.unpack("<Q", blob[:8])
        if length > min(_MAX_HEADER_BYTES, len(blob) - 8):
            raise ValueError(f"header length {length} out of range")
        header = json.loads(blob[8 : 8 + length])
        return int(header["__metadata__"][PACKED_ROUND_KEY])
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise DataLossError(f"not a packed parameter-server state: {exc!r}") from None


class StateKeeper:
    """The kept states of one job: the newest wins; older ones are removed once it is in place."""

    def __init__(self, state_dir: Path, job_id: str) -> None:
        self.directory = state_dir / STATE_DIR / job_id
        self.latest: KeptState | None = None

    async def keep(self, blob: bytes, expected_round: int) -> KeptState:
        """Write ``blob`` durably (it must hold ``expected_round``); returns what is kept now."""
        found = packed_round(blob)
        if found != expected_round:
            raise DataLossError(f"the state pulled for round {expected_round} holds round {found}")
        if self.latest is not None and self.latest.round >= found:
            return self.latest
        kept = await asyncio.to_thread(self._write, blob, found)
        self.latest = kept
        return kept

    def _write(self, blob: bytes, round_: int) -> KeptState:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"round-{round_:08d}.safetensors"
        write_atomic(path, blob)
        for old in self.directory.glob("round-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        return KeptState(round_, path, len(blob), hashlib.sha256(blob).hexdigest())

    async def commit(
        self, calls: WorkerCalls, worker_id: str, job_id: str, round_: int, timeout_s: float
    ) -> KeptState:
        """Pull the state the server published for ``round_`` and keep it (the round's commit)."""
        if self.latest is not None and self.latest.round >= round_:
            return self.latest
        blob = await calls.pull_tensors(worker_id, job_id, STATE_KIND, round_, timeout_s, MAX_STATE_BYTES)
        return await self.keep(blob, round_)

    async def push(
        self, calls: WorkerCalls, worker_id: str, job_id: str, timeout_s: float
    ) -> KeptState | None:
        """Hand the newest kept state to a replacement server on ``worker_id`` (None: nothing kept)."""
        kept, blob = self.latest, await self.read()
        if kept is None or blob is None:
            return None
        reply = await calls.push_tensors(worker_id, job_id, STATE_KIND, kept.round, blob, timeout_s)
        if not reply.accepted:
            raise DataLossError(f"{worker_id} refused the state of round {kept.round}: {reply.message}")
        return kept

    async def read(self) -> bytes | None:
        """The newest kept blob (None: no round completed yet)."""
        if self.latest is None:
            return None
        return await asyncio.to_thread(self.latest.path.read_bytes)

    async def drop(self) -> None:
        """Forget the job's states (it ended and needs no server any more)."""
        self.latest = None
        await asyncio.to_thread(shutil.rmtree, self.directory, True)


__all__ = ["PACKED_ROUND_KEY", "STATE_KIND", "STATE_ROUND_KEY", "KeptState", "StateKeeper", "packed_round"]
