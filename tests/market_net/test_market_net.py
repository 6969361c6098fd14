"""The market over the network: schedulers and workers are in-process nodes
built with their role's ``build()``, talking through real gateways with mTLS."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from hypha.market.leases import LeaseState
from hypha.market.pricing import PriceRange
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.net.channel import secure_channel
from hypha.net.messages import WORKER_TOPIC
from hypha.scheduler.app import SchedulerNode
from hypha.scheduler.app import build as build_scheduler
from hypha.scheduler.config import SchedulerSettings
from hypha.scheduler.lease_keeper import LeaseEventKind
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from hypha.worker import resources
from hypha.worker.app import WorkerNode
from hypha.worker.app import build as build_worker
from hypha.worker.config import WorkerSettings
from hypha.worker.resources import ResourceLimits
from tests.conftest import Pki
from tests.gateway.conftest import Mesh
from tests.helpers import eventually

MACHINE = {"cpu": 4.0, "memory_gb": 8.0, "storage_gb": 20.0, "gpu": 0.0, "gpu_memory_gb": 0.0}
CAPACITY = Resources(**MACHINE)
TASK = Requirements(Resources(cpu=1.0, memory_gb=1.0), ExecutorKind.TASK)


class Market:
    """A gateway mesh with worker and scheduler nodes attached to it."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.pki = mesh.pki
        self.nodes: list[WorkerNode | SchedulerNode] = []

    @property
    def gateways(self) -> list[str]:
        return [g.address for g in self.mesh.gateways]

    def _base(self, name: str, gateway: int, net: dict[str, Any] | None) -> dict[str, Any]:
        paths = self.pki.paths(name)
        return {
            "name": name,
            "tls": {"cert": paths.cert, "key": paths.key, "trust": paths.trust},
            "net": {
                "listen": "127.0.0.1:0",
                "gateways": [self.gateways[gateway % len(self.gateways)]],
                **(net or {}),
            },
        }

    async def worker(
        self, name: str, gateway: int = 0, net: dict[str, Any] | None = None, **worker: Any
    ) -> WorkerNode:
        self.pki.issue("worker", name)
        work_dir = self.pki.dir.parent / f"work-{name}"  # beside the PKI in the test's tmp dir
        settings = WorkerSettings(
            **self._base(name, gateway, net), worker={"resources": MACHINE, "work_dir": work_dir, **worker}
        )
        node = build_worker(settings, self.pki.tls(name))
        return await self._start(node)

    async def scheduler(
        self, name: str, gateway: int = 0, *, restart: bool = False, **scheduler: Any
    ) -> SchedulerNode:
        """``restart``: another process with the identity ``name`` already has (no new certificate)."""
        if not restart:
            self.pki.issue("scheduler", name)
        settings = SchedulerSettings(**self._base(name, gateway, None), scheduler=scheduler)
        node = build_scheduler(settings, self.pki.tls(name))
        return await self._start(node)

    async def _start(self, node: Any) -> Any:
        await node.start()
        self.nodes.append(node)
        assert node.link is not None
        await node.link.wait_connected(10)
        return node

    async def workers_listening(self, count: int) -> None:
        """Wait until ``count`` workers' subscriptions reached the gateways (ads would miss them before)."""
        await eventually(
            lambda: sum(len(g.hub.topics.get(WORKER_TOPIC, ())) for g in self.mesh.gateways) >= count,
            message=f"{count} workers subscribed",
        )

    async def close(self) -> None:
        for node in reversed(self.nodes):
            await node.stop()


def live(worker: WorkerNode) -> list[Any]:
    return worker.market.ledger.live()


async def test_a_scheduler_leases_n_workers_through_the_gateways(market: Market, pki: Pki) -> None:
    # Offers stay reserved for 5 s unless released, so a quick return to "all free"
    # proves the losers were released explicitly, not left to lapse.
    workers = [await market.worker(f"w-n{i}", gateway=i, offer_ttl_s=5.0) for i in range(4)]
    scheduler = await market.scheduler("s-n", offer_window_s=0.6)
    await market.workers_listening(4)

    held = await scheduler.market.allocate(TASK, 3)

    assert len(held) == 3
    assert len({lease.worker_id for lease in held}) == 3
    by_peer = {w.peer_id: w for w in workers}
    for lease in held:
        on_worker = by_peer[lease.worker_id].market.ledger.get(lease.lease_id)
        assert on_worker.state is LeaseState.ACTIVE
        assert on_worker.holder == scheduler.peer_id
        assert TASK.minimum.fits_in(lease.resources)
    idle = [w for w in workers if w.peer_id not in {lease.worker_id for lease in held}]
    assert len(idle) == 1
    await eventually(
        lambda: not live(idle[0]) and idle[0].market.ledger.free() == CAPACITY,
        timeout=3,
        message="the unchosen offer released",
    )

    # An operator sees the lease in the worker's status.
    async with secure_channel(pki.tls("admin"), by_peer[held[0].worker_id].address) as ch:
        status = await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetWorkerStatusRequest())
    assert [lease.lease_id for lease in status.leases] == [held[0].lease_id]
    assert status.leases[0].scheduler_id == scheduler.peer_id
    assert status.leases[0].state == common_pb2.LEASE_STATE_ACTIVE
    assert Resources.from_proto(status.free) == CAPACITY - held[0].resources

    # And the scheduler lists every worker that offered, leased or idle, by certificate name.
    async with secure_channel(pki.tls("client"), scheduler.address) as ch:
        listed = await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest())
    views = {view.peer.peer_id: view for view in listed.workers}
    assert set(views) == set(by_peer)
    assert {view.peer.name for view in listed.workers} == {f"w-n{i}" for i in range(4)}
    assert sorted(i for i, view in views.items() if view.leases) == sorted(lease.worker_id for lease in held)
    assert not views[idle[0].peer_id].leases and views[idle[0].peer_id].job_id == ""
    assert all(Resources.from_proto(view.capacity) == CAPACITY for view in listed.workers)
    assert all(abs(view.last_seen.seconds - time.time()) < 60 for view in listed.workers)


async def test_offers_above_the_max_are_ignored_and_freed(market: Market) -> None:
    cheap = await market.worker("w-cheap", price=1.0)
    dear = await market.worker("w-dear", gateway=1, price=5.0, offer_ttl_s=5.0)
    scheduler = await market.scheduler("s-max")
    await market.workers_listening(2)

    held = await scheduler.market.allocate(TASK, 2, PriceRange(bid=1.0, max=2.0), timeout_s=1.0)

    assert [lease.worker_id for lease in held] == [cheap.peer_id]
    assert scheduler.market.stats["offers_dropped_price"] >= 1
    assert dear.market.stats["offers_refused"] >= 1
    assert not live(dear) and dear.market.ledger.free() == CAPACITY


async def test_workers_below_their_floor_do_not_offer(market: Market) -> None:
    proud = await market.worker("w-proud", floor=3.0)
    scheduler = await market.scheduler("s-floor")
    await market.workers_listening(1)

    held = await scheduler.market.allocate(TASK, 1, PriceRange(bid=2.0, max=10.0), timeout_s=1.0)

    assert held == []
    assert proud.market.arbiter.dropped["floor"] >= 1
    assert proud.market.stats["offers_sent"] == 0
    assert scheduler.market.stats["offers"] == 0


async def test_competing_schedulers_never_get_the_same_resources(market: Market) -> None:
    workers = [
        await market.worker(f"w-c{i}", gateway=i, strategy="whole" if i % 2 else "flexible") for i in range(4)
    ]
    schedulers = [await market.scheduler(f"s-c{i}", gateway=i) for i in range(2)]
    await market.workers_listening(4)
    need = Requirements(Resources(cpu=2.0, memory_gb=1.0), ExecutorKind.TASK)

    results = await asyncio.gather(*(s.market.allocate(need, 4, timeout_s=2.0) for s in schedulers))

    assert all(results), "each scheduler got something"
    ids = [lease.lease_id for held in results for lease in held]
    assert len(ids) == len(set(ids))
    by_peer = {w.peer_id: w for w in workers}
    for scheduler, held in zip(schedulers, results, strict=True):
        assert len({lease.worker_id for lease in held}) == len(held), "one lease per worker per allocation"
        for lease in held:
            on_worker = by_peer[lease.worker_id].market.ledger.get(lease.lease_id)
            assert on_worker.state is LeaseState.ACTIVE and on_worker.holder == scheduler.peer_id
    for worker in workers:
        active = worker.market.ledger.active()
        assert Resources.total(lease.resources for lease in active).fits_in(CAPACITY)
        assert worker.market.ledger.used() + worker.market.ledger.free() == CAPACITY


async def test_leases_are_renewed_past_their_ttl_and_released_on_stop(market: Market) -> None:
    worker = await market.worker("w-renew")
    scheduler = await market.scheduler("s-renew", lease_ttl_s=1.0)
    await market.workers_listening(1)
    (held,) = await scheduler.market.allocate(TASK, 1)
    started = time.monotonic()

    await eventually(
        lambda: time.monotonic() - started > 2.2 and scheduler.market.stats["renewed"] >= 2,
        timeout=5,
        message="two lease lives passed with renewals",
    )

    lease = worker.market.ledger.get(held.lease_id)
    assert lease.state is LeaseState.ACTIVE
    assert worker.market.stats["leases_expired"] == 0
    assert held.lease_id in scheduler.market.book

    await scheduler.stop()
    assert worker.market.ledger.get(held.lease_id).state is LeaseState.RELEASED
    assert worker.market.ledger.free() == CAPACITY


async def test_a_restarted_scheduler_takes_back_the_leases_it_held(market: Market) -> None:
    # Prepare: a held lease the scheduler then forgets, as a process that died and came back.
    worker = await market.worker("w-adopt")
    scheduler = await market.scheduler("s-adopt", lease_ttl_s=2.0)
    await market.workers_listening(1)
    (held,) = await scheduler.market.allocate(TASK, 1)
    addresses = scheduler.market.worker_addresses(held.worker_id)
    scheduler.market.book.release(held.lease_id)

    # Execute
    adopted = await scheduler.market.adopt(held, addresses, CAPACITY)
    gone = await scheduler.market.adopt(replace(held, lease_id="no-such-lease"), addresses)

    # Assert: renewed (a later expiry), held and renewed on from then on; an unknown one is refused.
    assert adopted is not None and adopted.expires_at > held.expires_at
    assert held.lease_id in scheduler.market.book and gone is None
    started = time.monotonic()
    await eventually(
        lambda: time.monotonic() - started > 2.5 and scheduler.market.stats["renewed"] >= 1,
        timeout=6,
        message="renewed past its first life",
    )
    assert worker.market.ledger.get(held.lease_id).state is LeaseState.ACTIVE


async def test_a_restarted_scheduler_keeps_trying_a_worker_it_cannot_reach_for_a_while(
    market: Market,
) -> None:
    # Prepare: a lease the first process held and forgot; then its worker cannot be reached at all.
    worker = await market.worker("w-late")
    first = await market.scheduler("s-late", lease_ttl_s=5.0)
    await market.workers_listening(1)
    (held,) = await first.market.allocate(TASK, 1)
    addresses = first.market.worker_addresses(held.worker_id)
    first.market.book.release(held.lease_id)  # forgotten, so its stop leaves the lease alone
    await first.stop()
    await worker.stop()
    scheduler = await market.scheduler(
        "s-late", restart=True, lease_ttl_s=5.0, rpc_timeout_s=0.3, adopt_patience_s=1.5
    )

    # Execute: the restarted process tries to take the lease back.
    started = time.monotonic()
    adopted = await scheduler.market.adopt(held, addresses, CAPACITY)

    # Assert: it tried again (a path still coming up gets its chance) for the patience, not
    # longer, and then gave up without holding anything.
    assert adopted is None and held.lease_id not in scheduler.market.book
    assert scheduler.market.stats["adopt_retries"] >= 1
    assert 1.5 <= time.monotonic() - started < 10


async def test_advertisements_from_non_schedulers_and_malformed_ones_are_counted(market: Market) -> None:
    worker = await market.worker("w-guard")
    await market.workers_listening(1)
    good = common_pb2.Advertisement(request_id="r1", requirements=TASK.to_proto(), bid=1.0, count=1)
    impostor = await market.mesh.add_link("worker", "w-impostor", market.gateways)
    await impostor.publish(WORKER_TOPIC, good.SerializeToString())
    honest = await market.mesh.add_link("scheduler", "s-sloppy", market.gateways)
    await honest.publish(WORKER_TOPIC, b"\xff\xff\xff not a protobuf")
    await honest.publish(WORKER_TOPIC, common_pb2.Advertisement(request_id="r2", bid=1.0).SerializeToString())
    negative = common_pb2.Advertisement(
        request_id="r3",
        bid=1.0,
        requirements=common_pb2.Requirements(
            minimum=common_pb2.Resources(cpu=-1), executor=common_pb2.EXECUTOR_KIND_TASK
        ),
    )
    await honest.publish(WORKER_TOPIC, negative.SerializeToString())

    await eventually(
        lambda: worker.market.unauthorized == 1 and worker.market.malformed == 3,
        message="one unauthorized and three malformed advertisements counted",
    )
    assert not live(worker)
    assert worker.market.stats["offers_sent"] + worker.market.stats["offers_failed"] == 0


async def test_a_worker_without_a_reachable_address_is_leased_through_the_relay(market: Market) -> None:
    hidden = await market.worker("w-hidden", net={"external_addresses": ["127.0.0.1:1"]})
    scheduler = await market.scheduler("s-relay", lease_ttl_s=1.0)
    await market.workers_listening(1)

    (held,) = await scheduler.market.allocate(TASK, 1)

    assert held.worker_id == hidden.peer_id
    assert scheduler.connector.is_direct(hidden.peer_id) is False
    await eventually(lambda: scheduler.market.stats["renewed"] >= 1, timeout=3, message="renewed via relay")
    assert hidden.market.ledger.get(held.lease_id).state is LeaseState.ACTIVE


async def test_a_lost_lease_is_reported_and_replaced(market: Market) -> None:
    first = await market.worker("w-lost")
    scheduler = await market.scheduler("s-lost", lease_ttl_s=1.0)
    await market.workers_listening(1)
    events = scheduler.market.events()
    (held,) = await scheduler.market.allocate(TASK, 1, replace_lost=True)
    assert held.worker_id == first.peer_id
    second = await market.worker("w-spare", gateway=1)
    await market.workers_listening(2)

    await first.stop()
    lost = await asyncio.wait_for(events.get(), 3)
    replaced = await asyncio.wait_for(events.get(), 5)

    assert (lost.kind, lost.lease.lease_id) == (LeaseEventKind.LOST, held.lease_id)
    assert replaced.kind is LeaseEventKind.REPLACED and replaced.replacement is not None
    assert replaced.replacement.worker_id == second.peer_id
    assert [lease.worker_id for lease in scheduler.market.leases()] == [second.peer_id]


async def test_a_watched_lease_is_lost_when_its_worker_stops_answering_long_before_it_expires(
    market: Market,
) -> None:
    # A lease of 30 s: its loss would be noticed up to 30 s late; watched, within watch_lost_s.
    workers = [await market.worker("w-watched"), await market.worker("w-plain", gateway=1)]
    scheduler = await market.scheduler("s-watch", lease_ttl_s=30.0, watch_interval_s=0.2, watch_lost_s=1.0)
    await market.workers_listening(2)
    events = scheduler.market.events()
    leases = await scheduler.market.allocate(TASK, 2)
    watched = next(lease for lease in leases if lease.worker_id == workers[0].peer_id)
    plain = next(lease for lease in leases if lease.worker_id == workers[1].peer_id)
    scheduler.market.watch(watched.lease_id)

    # Heartbeats: renewed several times within a second, where the TTL alone renews at 20 s.
    await eventually(lambda: scheduler.market.stats["renewed"] >= 3, timeout=3, message="heartbeats")
    assert not any(e.kind is LeaseEventKind.LOST for e in _drain(events))

    for worker in workers:
        await worker.stop()
    stopped = time.monotonic()
    lost = await asyncio.wait_for(events.get(), 5)

    assert (lost.kind, lost.lease.lease_id) == (LeaseEventKind.LOST, watched.lease_id)
    assert time.monotonic() - stopped < 4.0
    assert "did not answer for 1 s" in lost.reason
    assert plain.lease_id in scheduler.market.book  # unwatched: still waiting for its expiry
    assert watched.lease_id not in scheduler.market.book


async def test_a_lease_whose_path_cannot_be_found_is_lost_at_its_expiry(
    market: Market, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Finding the path to a worker can wait on a gateway that is gone; the renewal must not
    # wait with it, or the lease is never lost and its job waits for ever on the part it held.
    worker = await market.worker("w-unfound")
    scheduler = await market.scheduler("s-unfound", lease_ttl_s=3.0)
    await market.workers_listening(1)
    events = scheduler.market.events()
    (lease,) = await scheduler.market.allocate(TASK, 1)

    async def never(worker_id: str) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(scheduler.market._workers, "stub", never)
    lost = await asyncio.wait_for(events.get(), 6)

    assert (lost.kind, lost.lease.lease_id) == (LeaseEventKind.LOST, lease.lease_id)
    assert "expired" in lost.reason
    assert lease.lease_id not in scheduler.market.book
    assert worker.peer_id == lease.worker_id


def _drain(queue: asyncio.Queue[Any]) -> list[Any]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_worker_sells_detected_capacity_with_overrides_and_caps(tmp_path: Path) -> None:
    detected = resources.detect(tmp_path, ResourceLimits(gpu=0, gpu_memory_gb=0))
    assert detected.cpu == len(os.sched_getaffinity(0))
    assert detected.memory_gb > 0 and detected.storage_gb > 0

    sold = resources.capacity(
        tmp_path,
        overrides=ResourceLimits(memory_gb=64.0, gpu=2, gpu_memory_gb=48.0),
        caps=ResourceLimits(cpu=0.5, memory_gb=16.0, storage_gb=1.0),
    )

    assert sold == Resources(
        cpu=0.5, memory_gb=16.0, storage_gb=min(1.0, detected.storage_gb), gpu=2, gpu_memory_gb=48.0
    )


async def test_a_window_longer_than_the_offer_ttl_still_leases(market: Market) -> None:
    worker = await market.worker("w-hasty", offer_ttl_s=0.3, batch_window_s=0.05)
    scheduler = await market.scheduler("s-slow", offer_window_s=2.0)
    await market.workers_listening(1)
    started = time.monotonic()

    # Two wanted, one exists: the window would wait 2 s for a second offer, far past the first's ttl.
    held = await scheduler.market.allocate(TASK, 2, timeout_s=2.5)

    assert [lease.worker_id for lease in held] == [worker.peer_id]
    assert scheduler.market.stats["accepts_failed"] == 0
    assert time.monotonic() - started >= 2.0  # it kept looking for the second worker meanwhile


async def test_lease_calls_are_checked_against_the_callers_identity(market: Market, pki: Pki) -> None:
    worker = await market.worker("w-auth")
    scheduler = await market.scheduler("s-auth")
    pki.issue("scheduler", "s-other")
    offer = worker.market.ledger.reserve(scheduler.peer_id, Resources(cpu=1), ttl_s=30, now=time.time())

    async def call(name: str, method: str, request: Any) -> Any:
        async with secure_channel(pki.tls(name), worker.address) as channel:
            return await getattr(worker_pb2_grpc.WorkerStub(channel), method)(request, timeout=5)

    for caller, code in (
        ("s-other", grpc.StatusCode.PERMISSION_DENIED),
        ("worker", grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(caller, "AcceptOffer", worker_pb2.AcceptOfferRequest(offer_id=offer.lease_id))
        assert err.value.code() == code
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call("s-auth", "RenewLease", worker_pb2.RenewLeaseRequest(lease_id="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    released = await call("s-auth", "ReleaseOffer", worker_pb2.ReleaseOfferRequest(offer_id=offer.lease_id))
    again = await call("s-auth", "ReleaseOffer", worker_pb2.ReleaseOfferRequest(offer_id=offer.lease_id))
    assert (released.released, again.released) == (True, False)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call("s-auth", "AcceptOffer", worker_pb2.AcceptOfferRequest(offer_id=offer.lease_id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert worker.market.ledger.free() == CAPACITY
