"""An in-process stand-in for the job bridges of several executors, connected to each other.

``FakeNetwork`` plays every worker and the scheduler at once: each executor
gets a ``FakeBridge`` bound to its peer id, tensors sent to a peer land in that
peer's inbox, published tensors can be fetched by (peer, kind, round), slices
come from per-trainer lists, and directives come from a policy function. The
benchmarks reuse it to measure the trainer loop without a real worker.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypha.errors import NotFoundError
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
    """Tell each trainer to sync after its own number of batches; ``done`` once ``rounds`` are over."""

    def policy(peer: str, round_number: int, done: int) -> FakeDirective:
        if rounds is not None and round_number >= rounds:
            return FakeDirective("done", 0, round_number)
        if done >= batches[peer]:
            return FakeDirective("sync_now", 0, round_number)
        return FakeDirective("continue", 0, round_number)

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
    preprocessor_dir: Path | None = None

    def __post_init__(self) -> None:
        self.sent: list[Sent] = []
        self.progress: list[tuple[str, int, int, int, float]] = []
        self.progress_times: list[tuple[str, float, int]] = []
        self.metrics: list[tuple[str, int, dict[str, float]]] = []
        self.used: dict[str, list[int]] = {}
        self.statuses: dict[str, list[tuple[str, str]]] = {}
        self.results: dict[str, Path] = {}
        self.fetched: list[tuple[str, str, str, int]] = []
        self.published: dict[tuple[str, str, int], Path] = {}
        self.logs: list[tuple[str, str, str]] = []
        self._inboxes: dict[str, asyncio.Queue[FakeReceived]] = {}
        self._published_changed = asyncio.Condition()
        self._cursor: dict[str, int] = {}

    def bridge(self, peer: str) -> FakeBridge:
        return FakeBridge(self, peer)

    def inbox_of(self, peer: str) -> asyncio.Queue[FakeReceived]:
        return self._inboxes.setdefault(peer, asyncio.Queue())

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
        self.inbox_of(peer).put_nowait(FakeReceived(data, sender, kind, round_number, samples))

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


class FakeBridge:
    """What one executor sees: the ``Bridge`` protocol over a ``FakeNetwork``."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        self.network = network
        self.peer = peer

    async def job(self) -> FakeJob:
        return self.network.job_for(self.peer)

    async def fetch_resource(self, name: str) -> Path:
        if name == "model":
            return self.network.model_dir
        if name == "preprocessor" and self.network.preprocessor_dir is not None:
            return self.network.preprocessor_dir
        raise NotFoundError(f"the job's spec names no {name} to fetch")

    async def next_slice(self) -> FakeSlice | None:
        return self.network.next_slice(self.peer)

    async def slices_used(self, indices: Sequence[int]) -> None:
        self.network.used.setdefault(self.peer, []).extend(indices)

    async def progress(
        self, round: int, batches: int, samples: int, loss: float, batch_seconds: float, batch_size: int
    ) -> FakeDirective:
        assert math.isfinite(loss)
        loop = asyncio.get_running_loop()
        self.network.progress.append((self.peer, round, batches, samples, loss))
        self.network.progress_times.append((self.peer, loop.time(), batch_size))
        return self.network.directive(self.peer, round, batches)

    async def metrics(self, round: int, values: Mapping[str, float]) -> None:
        self.network.metrics.append((self.peer, round, dict(values)))

    async def log(self, stream: str, line: str) -> None:
        self.network.logs.append((self.peer, stream, line))

    async def send_tensors(
        self, peer: str, kind: str, round: int, samples: int, path: Path
    ) -> FakeSendResult:
        data = await asyncio.to_thread(Path(path).read_bytes)
        self.network.deliver(self.peer, peer, kind, round, samples, data)
        return FakeSendResult(True, "")

    async def inbox(self, kind: str, timeout_s: float) -> FakeReceived | None:
        queue = self.network.inbox_of(self.peer)
        try:
            async with asyncio.timeout(min(timeout_s, self.network.inbox_wait_cap_s)):
                return await queue.get()
        except TimeoutError:
            return None

    async def publish_tensors(self, kind: str, round: int, path: Path) -> None:
        await self.network.publish(self.peer, kind, round, path)

    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        self.network.fetched.append((self.peer, peer, kind, round))
        return await self.network.fetch(peer, kind, round, timeout_s)

    async def result(self, path: Path) -> None:
        self.network.results[self.peer] = Path(path)

    async def status(self, state: str, message: str) -> None:
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
    from hypha.data.prepare import write_dataset

    dataset = write_dataset(data.tensors, root, name, samples_per_slice, data.metadata)
    return [dataset.slice_path(i) for i in range(dataset.manifest.slice_count)]


# ---- the real job bridge, with the scheduler and the peers played by a FakeNetwork ----------


@dataclass(frozen=True)
class _Payload:
    data: bytes
    from_peer: str
    kind: str
    round: int
    samples: int


class NetworkExchange:
    """The worker's ``TensorExchange`` for one peer, as ``JobBridge`` calls it, over a FakeNetwork."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        self.network, self.peer = network, peer

    async def send(
        self,
        job_id: str,
        peer_id: str,
        addresses: Sequence[str],
        kind: str,
        round: int,
        samples: int,
        path: Path,
    ) -> tuple[bool, str]:
        data = await asyncio.to_thread(Path(path).read_bytes)
        self.network.deliver(self.peer, peer_id, kind, round, samples, data)
        return True, "queued"

    async def next_received(self, job_id: str, kind: str, timeout_s: float) -> FakeReceived | None:
        return await FakeBridge(self.network, self.peer).inbox(kind, timeout_s)

    async def publish(self, job_id: str, kind: str, round: int, path: Path, samples: int = 0) -> None:
        await self.network.publish(self.peer, kind, round, path)

    async def fetch(
        self, job_id: str, peer_id: str, addresses: Sequence[str], kind: str, round: int, timeout_s: float
    ) -> _Payload | None:
        self.network.fetched.append((self.peer, peer_id, kind, round))
        data = await self.network.fetch(peer_id, kind, round, timeout_s)
        return None if data is None else _Payload(data, peer_id, kind, round, 0)


class NetworkLink:
    """The scheduler as the bridge's ``SchedulerLink`` sees it: the network's policy and slice lists."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        self.network, self.peer = network, peer
        self.slice_paths: dict[int, Path] = {}

    async def progress(self, report: Any) -> Any:
        from hypha.v1 import scheduler_pb2

        loop = asyncio.get_running_loop()
        self.network.progress.append((self.peer, report.round, report.batches, report.samples, report.loss))
        self.network.progress_times.append((self.peer, loop.time(), report.batch_size))
        directive = self.network.directive(self.peer, report.round, report.batches)
        kinds = {
            "continue": scheduler_pb2.DIRECTIVE_KIND_CONTINUE,
            "sync_after": scheduler_pb2.DIRECTIVE_KIND_SYNC_AFTER,
            "sync_now": scheduler_pb2.DIRECTIVE_KIND_SYNC_NOW,
            "done": scheduler_pb2.DIRECTIVE_KIND_DONE,
        }
        return scheduler_pb2.Directive(
            kind=kinds[directive.kind], batches=directive.batches, round=directive.round
        )

    async def next_slice(self, request: Any) -> Any:
        from hypha.v1 import scheduler_pb2

        self.network.used.setdefault(self.peer, []).extend(request.used)
        info = self.network.next_slice(self.peer)
        if info is None:
            return scheduler_pb2.NextSliceResponse(available=False)
        self.slice_paths[info.index] = info.path
        return scheduler_pb2.NextSliceResponse(
            available=True, index=info.index, epoch=info.epoch, dataset="arith"
        )

    async def metrics(self, report: Any) -> None:
        self.network.metrics.append((self.peer, report.round, dict(report.values)))

    async def logs(self, lines: Any) -> None:
        return None

    async def status(self, report: Any) -> None:
        return None

    async def close(self) -> None:
        return None


class NetworkSlices:
    """The worker's slice fetcher: the files the network's slice lists name."""

    def __init__(self, link: NetworkLink) -> None:
        self.link = link

    async def fetch(self, dataset: str, index: int, providers: Sequence[Any]) -> Path:
        return self.link.slice_paths[index]

    def prefetch(self, dataset: str, index: int, providers: Sequence[Any]) -> bool:
        return False


async def start_real_bridge(network: FakeNetwork, peer: str) -> tuple[Any, Any, Path]:
    """A real ``JobBridge`` (aiohttp over a Unix socket) for ``peer``; (bridge, record, work dir).

    The model is fetched by the worker's real ``ResourceFetcher`` from the
    network's model dir (a local path); the scheduler and the other peers
    are the FakeNetwork.
    """
    from hypha.market.resources import ExecutorKind
    from hypha.worker.bridge import BridgeContext, JobBridge
    from hypha.worker.job_state import ExecutionRecord, JobDispatch
    from hypha.worker.model_fetch import HubSettings, ResourceFetcher
    from hypha.worker.scheduler_link import LogForwarder

    spec = common_pb2.JobSpec()
    spec.CopyFrom(network.spec)
    spec.diloco.model.local_path = str(network.model_dir)
    job = network.job_for(peer)
    work_dir = job.work_dir
    work_dir.chmod(0o700)
    dispatch = JobDispatch(
        job_id=job.job_id,
        lease_id="lease-1",
        executor=ExecutorKind.DILOCO_TRAINER if peer != network.ps_id else ExecutorKind.PARAMETER_SERVER,
        spec=spec,
        scheduler_id="scheduler",
        parameter_server_id=network.ps_id,
        trainer_ids=network.trainer_ids,
        batch_size=network.batch_size,
        start_round=job.start_round,
        attempt=job.attempt,
    )
    record = ExecutionRecord(job_id=job.job_id, execution_id=f"{job.job_id}-{peer}")
    link = NetworkLink(network, peer)
    context = BridgeContext(
        dispatch=dispatch,
        work_dir=work_dir,
        record=record,
        link=link,
        exchange=NetworkExchange(network, peer),  # type: ignore[arg-type]
        logs=LogForwarder(link, job.job_id),
        resources=ResourceFetcher(
            HubSettings(cache_dir=network.root / "hub-cache", local_roots=(network.model_dir.parent,))
        ),
        slices=NetworkSlices(link),
    )
    bridge = JobBridge(context)
    await bridge.start()
    return bridge, record, work_dir


def executor_env(socket_path: Path, work_dir: Path, executor: str = "diloco-trainer") -> dict[str, str]:
    """The environment a worker gives an executor process (docs/job-bridge.md)."""
    import os

    return {
        **os.environ,
        "HYPHA_BRIDGE_SOCKET": str(socket_path),
        "HYPHA_WORK_DIR": str(work_dir),
        "HYPHA_JOB_ID": "job-1",
        "HYPHA_EXECUTOR": executor,
        "HYPHA_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
