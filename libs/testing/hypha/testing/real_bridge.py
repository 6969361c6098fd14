"""The worker's real job bridge for one peer, with the scheduler and the other peers played by a
``FakeNetwork`` (``hypha.testing.executors``).

``start_real_bridge`` serves a real ``JobBridge`` (aiohttp over a Unix socket)
whose tensor exchange, scheduler link and slice fetcher are the network's, so
an executor process can run against the real bridge's HTTP API while the test
sees every tensor, progress report and slice on the network as with a
``FakeBridge``. It needs the worker role (``hypha-ml-worker``), imported when
called; ``executor_env`` is the environment a worker gives an executor process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypha.testing.executors import FakeBridge, FakeNetwork
from hypha.v1 import common_pb2


@dataclass(frozen=True)
class _Payload:
    data: bytes
    from_peer: str
    kind: str
    round: int
    samples: int
    #: Always in memory here (a real exchange spools large payloads; see TensorPayload).
    path: None = None


class NetworkExchange:
    """The worker's ``TensorExchange`` for one peer, as ``JobBridge`` calls it, over a FakeNetwork."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        self.network, self.peer = network, peer
        self.pushed_bytes = 0
        self.pulled_bytes = 0

    def job_bytes(self, job_id: str) -> tuple[int, int]:
        """(pushed, pulled): the tensor payload bytes this peer sent and fetched (no framing here)."""
        return self.pushed_bytes, self.pulled_bytes

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
        self.pushed_bytes += len(data)
        self.network.deliver(self.peer, peer_id, kind, round, samples, data)
        return True, "queued"

    async def next_received(self, job_id: str, kind: str, timeout_s: float) -> _Payload | None:
        received = await FakeBridge(self.network, self.peer).inbox(kind, timeout_s)
        if received is None:
            return None
        return _Payload(received.data, received.from_peer, received.kind, received.round, received.samples)

    async def publish(self, job_id: str, kind: str, round: int, path: Path, samples: int = 0) -> None:
        await self.network.publish(self.peer, kind, round, path)

    async def fetch(
        self, job_id: str, peer_id: str, addresses: Sequence[str], kind: str, round: int, timeout_s: float
    ) -> _Payload | None:
        self.network.fetched.append((self.peer, peer_id, kind, round))
        data = await self.network.fetch(peer_id, kind, round, timeout_s)
        if data is None:
            return None
        self.pulled_bytes += len(data)
        return _Payload(data, peer_id, kind, round, 0)


class NetworkLink:
    """The scheduler as the bridge's ``SchedulerLink`` sees it: the network's policy and slice lists."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        self.network, self.peer = network, peer
        self.slice_paths: dict[int, Path] = {}

    async def progress(self, report: Any) -> Any:
        from hypha.v1 import scheduler_pb2

        loop = asyncio.get_running_loop()
        self.network.progress.append(
            (
                self.peer,
                report.round,
                report.batches,
                report.samples,
                report.loss,
                report.next_batch_started,
            )
        )
        self.network.progress_times.append((self.peer, loop.time(), report.batch_size))
        directive = self.network.directive(self.peer, report.round, report.batches)
        if self.network.progress_delay_s > 0:
            await asyncio.sleep(self.network.progress_delay_s)  # the scheduler's round trip, simulated
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
    from hypha.worker.execution_state import ExecutionRecord, JobDispatch
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
