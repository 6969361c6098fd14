"""One node of every role, each built by its role's ``build()``, serving on 127.0.0.1:0 with mTLS.

The nodes run on an event loop in a background thread, so hypothesis
(synchronous, one call per example) can drive them through ordinary
blocking gRPC channels. The nodes are not linked to each other (but for
``scheduler_on_market``): fuzzed job submissions are stored and queued but
never reach a worker.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc

from hypha.pki.identity import Role
from hypha.testing.pki import Pki

#: The service each node serves, by the node's role.
SERVICES = {
    "hypha.v1.Gateway": "gateway",
    "hypha.v1.Scheduler": "scheduler",
    "hypha.v1.SchedulerControl": "scheduler",
    "hypha.v1.Worker": "worker",
    "hypha.v1.DataNode": "data",
    # Every node serves these; one of each kind is enough.
    "grpc.health.v1.Health": "worker",
    "grpc.reflection.v1alpha.ServerReflection": "scheduler",
}


class LoopThread:
    """An event loop running in a daemon thread; ``run`` a coroutine on it from blocking code."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class FuzzCluster:
    """A gateway, a scheduler (with its REST API), a worker and a data node on a private loop."""

    def __init__(self, pki: Pki, base: Path, *, scheduler_on_market: bool = False) -> None:
        self.pki = pki
        self.base = base
        #: Link the scheduler to the gateway: its jobs then wait for a worker (none offers) instead of
        #: failing at once for want of a market, so they can be cancelled, scaled, watched.
        self.scheduler_on_market = scheduler_on_market
        self._loop = LoopThread("fuzz-cluster")
        self.run = self._loop.run
        self.nodes: dict[str, Any] = {}
        self._channels: dict[tuple[str, Role], grpc.Channel] = {}

    def start(self) -> None:
        self.run(self._start())

    async def _start(self) -> None:
        from hypha.data.app import build as build_data
        from hypha.data.config import DataNodeSettings
        from hypha.gateway.app import build as build_gateway
        from hypha.scheduler.app import build as build_scheduler
        from hypha.scheduler.config import SchedulerSettings
        from hypha.testing.mesh import gateway_settings
        from hypha.worker.app import build as build_worker
        from hypha.worker.config import WorkerSettings

        def base(name: str) -> dict[str, Any]:
            paths = self.pki.paths(name)
            return {
                "name": name,
                "tls": {"cert": paths.cert, "key": paths.key, "trust": paths.trust},
                "net": {"listen": "127.0.0.1:0"},
            }

        def on_market(settings: dict[str, Any]) -> dict[str, Any]:
            if self.scheduler_on_market:
                settings["net"]["gateways"] = [str(self.nodes["gateway"].address)]
            return settings

        machine = {"cpu": 2.0, "memory_gb": 2.0, "storage_gb": 1.0, "gpu": 0.0, "gpu_memory_gb": 0.0}
        (self.base / "data").mkdir(parents=True, exist_ok=True)
        builders = {
            "gateway": lambda: build_gateway(gateway_settings(self.pki, "gateway"), self.pki.tls("gateway")),
            "scheduler": lambda: build_scheduler(
                SchedulerSettings(
                    **on_market(base("scheduler")),
                    state_dir=self.base / "scheduler",
                    scheduler={"rest_listen": "127.0.0.1:0"},
                ),
                self.pki.tls("scheduler"),
            ),
            "worker": lambda: build_worker(
                WorkerSettings(
                    **base("worker"), state_dir=self.base / "worker", worker={"resources": machine}
                ),
                self.pki.tls("worker"),
            ),
            "data": lambda: build_data(
                DataNodeSettings(**base("data"), data={"data_dir": self.base / "data"}), self.pki.tls("data")
            ),
        }
        for role, make in builders.items():
            node = make()
            await node.start()
            self.nodes[role] = node

    def address(self, service: str) -> str:
        return str(self.nodes[SERVICES[service]].address)

    @property
    def rest_url(self) -> str:
        return str(self.nodes["scheduler"].rest.url)

    def channel(self, service: str, role: Role) -> grpc.Channel:
        """A blocking mTLS channel to the node serving ``service``, with the certificate of ``role``."""
        key = (service, role)
        if key not in self._channels:
            tls = self.pki.tls(role.value)
            self._channels[key] = grpc.secure_channel(self.address(service), tls.channel_credentials())
        return self._channels[key]

    def stop(self) -> None:
        for channel in self._channels.values():
            channel.close()
        try:
            for node in reversed(list(self.nodes.values())):
                self.run(node.stop())
        finally:
            self._loop.close()


class FuzzBridge:
    """A worker's job bridge for a DiLoCo trainer, also served on TCP 127.0.0.1:0 so an HTTP
    fuzzer can reach it (the executor's Unix socket stays as in production)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._loop = LoopThread("fuzz-bridge")
        self.url = ""
        self._bridge: Any = None
        self._logs: Any = None

    def start(self) -> None:
        self._loop.run(self._start())

    async def _start(self) -> None:
        from aiohttp import web

        from hypha.market.resources import ExecutorKind
        from hypha.v1 import common_pb2
        from hypha.worker.bridge import BridgeContext, BridgeLimits, JobBridge
        from hypha.worker.execution_state import ExecutionRecord, JobDispatch
        from hypha.worker.scheduler_link import LogForwarder
        from hypha.worker.transfer import TensorExchange
        from tests.worker.fakes import FakeSchedulerLink
        from tests.worker.test_bridge import FakeSlices

        spec = common_pb2.JobSpec(
            name="fuzz", diloco=common_pb2.DilocoJobSpec(model=common_pb2.ModelSpec(), dataset="tiny")
        )
        dispatch = JobDispatch(
            "job-1", "lease-1", ExecutorKind.DILOCO_TRAINER, spec, "scheduler-1", batch_size=8
        )
        work_dir = self.base / "job"
        work_dir.mkdir(mode=0o700)
        (work_dir / "file.txt").write_text("x")
        (self.base / "slices").mkdir()
        link = FakeSchedulerLink()
        exchange = TensorExchange(None)
        exchange.open_job(dispatch.job_id)
        self._logs = LogForwarder(link, dispatch.job_id)  # type: ignore[arg-type]
        self._logs.start()
        self._bridge = JobBridge(
            BridgeContext(
                dispatch=dispatch,
                work_dir=work_dir,
                record=ExecutionRecord(dispatch.job_id, "exec-1"),
                link=link,  # type: ignore[arg-type]
                exchange=exchange,
                logs=self._logs,
                slices=FakeSlices(self.base / "slices"),
                # Long polls (inbox, fetch) are legitimate waits: bounded here so examples stay fast.
                limits=BridgeLimits(max_body_bytes=64 * 1024, max_wait_s=1.0),
            )
        )
        await self._bridge.start()
        site = web.TCPSite(self._bridge._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        async def _stop() -> None:
            if self._bridge is not None:
                await self._bridge.stop()
            if self._logs is not None:
                await self._logs.close()

        try:
            self._loop.run(_stop())
        finally:
            self._loop.close()
