"""An in-process stand-in for the job bridges of several executors, connected to each other.

``FakeNetwork`` plays every worker and the scheduler at once: each executor
gets a ``FakeBridge`` bound to its peer id, tensors sent to a peer land in that
peer's inbox, published tensors can be fetched by (peer, kind, round), slices
come from per-trainer lists, and directives come from a policy function. The
benchmarks reuse it to measure the trainer loop without a real worker. The
worker's real bridge over the same network is ``hypha.testing.real_bridge``.

``FakeBridge`` keeps the real bridge's rules where an executor could come to
rely on their absence (tests/executors/test_bridge_contract.py runs the same
tests against both): paths must lie inside the job's work dir, states and log
streams are checked, inboxes are per tensor kind, slices are copies in the
work dir deleted once reported used, and metrics carry the tensor bytes the
worker measured.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypha.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from hypha.v1 import common_pb2


@dataclass(frozen=True)
class FakeJob:
    job_id: str
    spec: Any
    work_dir: Path
    batch_size: int
    parameter_server_id: str
    trainer_ids: tuple[str, ...]
    start_round: int = 0
    attempt: int = 0
    executor: str = "diloco-trainer"


@dataclass(frozen=True)
class FakeSlice:
    index: int
    epoch: int
    path: Path


@dataclass(frozen=True)
class FakeDirective:
    kind: str
    batches: int = 0
    round: int = 0


@dataclass(frozen=True)
class FakeReceived:
    data: bytes
    from_peer: str
    kind: str
    round: int
    samples: int


@dataclass(frozen=True)
class FakeSendResult:
    accepted: bool
    message: str = ""


@dataclass(frozen=True)
class Sent:
    """One send_tensors call, as the network saw it (bytes copied at send time)."""

    sender: str
    peer: str
    kind: str
    round: int
    samples: int
    data: bytes


#: (peer, round, batches done this round) -> directive.
Policy = Callable[[str, int, int], FakeDirective]


def sync_every(batches: Mapping[str, int], rounds: int | None = None) -> Policy:
    """Tell each trainer to sync after its own number of batches; ``done`` once ``rounds`` are over.

    The count is announced from the first report on (``sync_after``), as the
    scheduler's planner does: the trainer reads an answer one batch after its
    report, so only a count it knows ahead lands exactly.
    """

    def policy(peer: str, round_number: int, done: int) -> FakeDirective:
        if rounds is not None and round_number >= rounds:
            return FakeDirective("done", 0, round_number)
        left = batches[peer] - done
        if left <= 0:
            return FakeDirective("sync_now", 0, round_number)
        return FakeDirective("sync_after", left, round_number)

    return policy


def sync_after_first(batches: Mapping[str, int]) -> Policy:
    """After the first batch of a round, announce how many more to run (``sync_after K``), then repeat it."""

    def policy(peer: str, round_number: int, done: int) -> FakeDirective:
        return FakeDirective("sync_after", max(0, batches[peer] - 1), round_number)

    return policy


@dataclass
class FakeNetwork:
    spec: common_pb2.JobSpec
    root: Path
    model_dir: Path
    trainer_ids: tuple[str, ...]
    ps_id: str = "ps"
    batch_size: int = 8
    slices: dict[str, list[Path]] = field(default_factory=dict)
    policy: Policy | None = None
    start_rounds: dict[str, int] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    #: Real seconds an empty inbox waits at most (the PS's clock is what tests control).
    inbox_wait_cap_s: float = 0.05
    #: Seconds the scheduler's answer to a progress report takes through the real bridge (a WAN).
    progress_delay_s: float = 0.0
    preprocessor_dir: Path | None = None

    def __post_init__(self) -> None:
        self.sent: list[Sent] = []
        #: (peer, round, batches, samples, loss, next_batch_started) of every report.
        self.progress: list[tuple[str, int, int, int, float, bool]] = []
        self.progress_times: list[tuple[str, float, int]] = []
        self.metrics: list[tuple[str, int, dict[str, float]]] = []
        self.used: dict[str, list[int]] = {}
        self.statuses: dict[str, list[tuple[str, str]]] = {}
        self.results: dict[str, Path] = {}
        self.fetched: list[tuple[str, str, str, int]] = []
        self.published: dict[tuple[str, str, int], Path] = {}
        self.logs: list[tuple[str, str, str]] = []
        #: peer -> [pushed, pulled]: the tensor payload bytes its bridge moved (the worker measures them).
        self.tensor_bytes: dict[str, list[int]] = {}
        self._inboxes: dict[tuple[str, str], asyncio.Queue[FakeReceived]] = {}
        self._published_changed = asyncio.Condition()
        self._cursor: dict[str, int] = {}

    def bridge(self, peer: str) -> FakeBridge:
        return FakeBridge(self, peer)

    def inbox_of(self, peer: str, kind: str) -> asyncio.Queue[FakeReceived]:
        """``peer``'s queue of ``kind`` payloads: one per kind, as the worker's exchange keeps them."""
        return self._inboxes.setdefault((peer, kind), asyncio.Queue())

    def job_for(self, peer: str) -> FakeJob:
        work_dir = self.root / peer
        work_dir.mkdir(parents=True, exist_ok=True)
        return FakeJob(
            job_id="job-1",
            spec=self.spec,
            work_dir=work_dir,
            batch_size=self.batch_size,
            parameter_server_id=self.ps_id,
            trainer_ids=self.trainer_ids,
            start_round=self.start_rounds.get(peer, 0),
            attempt=self.attempts.get(peer, 0),
            executor="parameter-server" if peer == self.ps_id else "diloco-trainer",
        )

    def deliver(
        self, sender: str, peer: str, kind: str, round_number: int, samples: int, data: bytes
    ) -> None:
        """Put a payload in ``peer``'s inbox as if ``sender``'s worker had streamed it."""
        self.sent.append(Sent(sender, peer, kind, round_number, samples, data))
        self.inbox_of(peer, kind).put_nowait(FakeReceived(data, sender, kind, round_number, samples))

    async def publish(self, peer: str, kind: str, round_number: int, path: Path) -> None:
        async with self._published_changed:
            self.published[(peer, kind, round_number)] = Path(path)
            self._published_changed.notify_all()

    async def fetch(self, peer: str, kind: str, round_number: int, timeout_s: float) -> bytes | None:
        key = (peer, kind, round_number)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._published_changed:
                    await self._published_changed.wait_for(lambda: key in self.published)
        except TimeoutError:
            return None
        return await asyncio.to_thread(self.published[key].read_bytes)

    def next_slice(self, peer: str) -> FakeSlice | None:
        paths = self.slices.get(peer, [])
        if not paths:
            return None
        cursor = self._cursor.get(peer, 0)
        self._cursor[peer] = cursor + 1
        return FakeSlice(index=cursor, epoch=cursor // len(paths), path=paths[cursor % len(paths)])

    def directive(self, peer: str, round_number: int, batches: int) -> FakeDirective:
        if self.policy is None:
            return FakeDirective("continue", 0, round_number)
        return self.policy(peer, round_number, batches)

    def deltas(self, round_number: int | None = None) -> list[Sent]:
        return [
            s for s in self.sent if s.kind == "delta" and (round_number is None or s.round == round_number)
        ]


#: What the real bridge accepts as a reported state and as a log stream (hypha.worker.bridge).
REPORTED_STATES = frozenset({"running", "succeeded", "failed"})
LOG_STREAMS = frozenset({"stdout", "stderr", "system"})


def inside_work_dir(work_dir: Path, path: Path | str, want: str) -> Path:
    """``path`` resolved, refused as the real bridge refuses it: outside the work dir, or missing."""
    root = work_dir.resolve()
    candidate = Path(path)
    real = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if real != root and not real.is_relative_to(root):
        raise PermissionDeniedError(f"path {str(path)!r} is outside the job's work dir")
    if want == "file" and not real.is_file():
        raise NotFoundError(f"no file {str(path)!r} in the work dir")
    if want == "dir" and not real.is_dir():
        raise NotFoundError(f"no directory {str(path)!r} in the work dir")
    return real


def slice_copy(work_dir: Path, index: int) -> Path:
    return work_dir / "slices" / f"{index:06d}.safetensors"


def place_slice(work_dir: Path, index: int, source: Path) -> Path:
    """A copy of a slice in the work dir, as the real bridge hands it out (and deletes it once used)."""
    import shutil

    target = slice_copy(work_dir, index)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    shutil.copyfile(source, target)
    return target


class FakeBridge:
    """What one executor sees: the ``Bridge`` protocol over a ``FakeNetwork``."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        self.network = network
        self.peer = peer

    @property
    def _work_dir(self) -> Path:
        return self.network.job_for(self.peer).work_dir

    def _moved(self, pushed: int = 0, pulled: int = 0) -> None:
        counts = self.network.tensor_bytes.setdefault(self.peer, [0, 0])
        counts[0] += pushed
        counts[1] += pulled

    async def job(self) -> FakeJob:
        return self.network.job_for(self.peer)

    async def fetch_resource(self, name: str) -> Path:
        if name == "model":
            return self.network.model_dir
        if name == "preprocessor" and self.network.preprocessor_dir is not None:
            return self.network.preprocessor_dir
        raise NotFoundError(f"the job's spec names no {name} to fetch")

    async def next_slice(self) -> FakeSlice | None:
        info = self.network.next_slice(self.peer)
        if info is None:
            return None
        placed = await asyncio.to_thread(place_slice, self._work_dir, info.index, info.path)
        return FakeSlice(info.index, info.epoch, placed)

    async def slices_used(self, indices: Sequence[int]) -> None:
        # The real bridge deletes its copy of a used slice: an executor must not read it again.
        self.network.used.setdefault(self.peer, []).extend(indices)
        for index in indices:
            slice_copy(self._work_dir, index).unlink(missing_ok=True)

    async def progress(
        self,
        round: int,
        batches: int,
        samples: int,
        loss: float,
        batch_seconds: float,
        batch_size: int,
        next_batch_started: bool = False,
    ) -> FakeDirective:
        assert math.isfinite(loss)
        loop = asyncio.get_running_loop()
        self.network.progress.append((self.peer, round, batches, samples, loss, next_batch_started))
        self.network.progress_times.append((self.peer, loop.time(), batch_size))
        return self.network.directive(self.peer, round, batches)

    async def metrics(self, round: int, values: Mapping[str, float]) -> None:
        # The worker adds the job's tensor bytes so far, once there are any.
        pushed, pulled = self.network.tensor_bytes.get(self.peer, (0, 0))
        measured = (
            {"tensor_bytes_pushed": float(pushed), "tensor_bytes_pulled": float(pulled)}
            if pushed or pulled
            else {}
        )
        self.network.metrics.append((self.peer, round, {**dict(values), **measured}))

    async def log(self, stream: str, line: str) -> None:
        if stream not in LOG_STREAMS:
            raise InvalidArgumentError(f"'stream' must be one of {sorted(LOG_STREAMS)}")
        self.network.logs.append((self.peer, stream, line))

    async def send_tensors(
        self, peer: str, kind: str, round: int, samples: int, path: Path
    ) -> FakeSendResult:
        source = inside_work_dir(self._work_dir, path, "file")
        data = await asyncio.to_thread(source.read_bytes)
        self._moved(pushed=len(data))
        self.network.deliver(self.peer, peer, kind, round, samples, data)
        return FakeSendResult(True, "")

    async def inbox(self, kind: str, timeout_s: float) -> FakeReceived | None:
        queue = self.network.inbox_of(self.peer, kind)
        try:
            async with asyncio.timeout(min(timeout_s, self.network.inbox_wait_cap_s)):
                return await queue.get()
        except TimeoutError:
            return None

    async def publish_tensors(self, kind: str, round: int, path: Path) -> None:
        source = inside_work_dir(self._work_dir, path, "file")
        await self.network.publish(self.peer, kind, round, source)

    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        self.network.fetched.append((self.peer, peer, kind, round))
        data = await self.network.fetch(peer, kind, round, timeout_s)
        if data is not None:
            self._moved(pulled=len(data))
        return data

    async def result(self, path: Path) -> None:
        target = inside_work_dir(self._work_dir, path, "dir")
        if target == self._work_dir.resolve():
            raise InvalidArgumentError("the result must be a directory below the work dir, not the work dir")
        self.network.results[self.peer] = Path(path)

    async def status(self, state: str, message: str) -> None:
        if state not in REPORTED_STATES:
            raise InvalidArgumentError(f"'state' must be one of {sorted(REPORTED_STATES)}")
        self.network.statuses.setdefault(self.peer, []).append((state, message))


# ---- job and data helpers ------------------------------------------------------------------


def diloco_spec(
    *,
    rounds: int,
    model_type: int = common_pb2.MODEL_TYPE_CAUSAL_LM,
    inner_lr: float = 3e-3,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
    quorum: float = 0.0,
    round_timeout_s: float = 30.0,
    delta_dtype: int = common_pb2.DELTA_DTYPE_FP32,
) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(
        name="test",
        diloco=common_pb2.DilocoJobSpec(
            model=common_pb2.ModelSpec(local_path="/unused", type=model_type),  # type: ignore[arg-type]
            dataset="arith",
            inner_optimizer=common_pb2.AdamWConfig(
                learning_rate=inner_lr, beta1=0.9, beta2=0.99, epsilon=1e-8
            ),
            outer_optimizer=common_pb2.NesterovConfig(learning_rate=outer_lr, momentum=momentum),
            rounds=rounds,
            quorum=quorum,
            round_timeout_s=round_timeout_s,
            delta_dtype=delta_dtype,  # type: ignore[arg-type]
        ),
    )


def write_slices(data: Any, root: Path, name: str, samples_per_slice: int) -> list[Path]:
    """Install synthetic data as a dataset (the data node's format); the slice files in order."""
    from hypha.datasets.prepare import write_dataset

    dataset = write_dataset(data.tensors, root, name, samples_per_slice, data.metadata)
    return [dataset.slice_path(i) for i in range(dataset.manifest.slice_count)]
