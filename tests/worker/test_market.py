"""The worker's side of the market: which advertisements become offers, what a refused or
undeliverable offer gives back, and how accepting, renewing, releasing and expiry move the lease
ledger and tell the job manager. Ledger operations run on an injected clock; advertisements and
offers travel over a real gateway and a real scheduler-role server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from hypha.errors import FailedPreconditionError, PermissionDeniedError
from hypha.market.arbiter import AdvertisementView, OfferDecision
from hypha.market.leases import Lease, LeaseState
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.messages import WORKER_TOPIC
from hypha.net.server import NodeServer
from hypha.testing.mesh import Mesh
from hypha.testing.polling import until
from hypha.timestamps import to_timestamp
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hypha.worker.config import WorkerSection
from hypha.worker.market import WorkerMarket
from tests.conftest import Pki
from tests.helpers import FakeClock

CAPACITY = Resources(cpu=8, memory_gb=32)
SMALL = Resources(cpu=2, memory_gb=4)
T0 = 1_000_000.0


# ---- a market on an injected clock, without a gateway ---------------------------------------------


@dataclass
class Harness:
    market: WorkerMarket
    clock: FakeClock
    ended: list[Lease] = field(default_factory=list)

    def offer(self, request: str, scheduler: str = "sched", minimum: Resources = SMALL) -> OfferDecision:
        """One advertisement through the arbiter: the offer made for it, its resources reserved."""
        ad = AdvertisementView(
            request_id=request,
            scheduler_id=scheduler,
            requirements=Requirements(minimum, ExecutorKind.TASK),
            bid=1.0,
            deadline=self.clock() + 60,
        )
        assert self.market.arbiter.add(ad, self.clock())
        (decision,) = self.market.arbiter.decide(self.clock())
        return decision


@pytest.fixture
async def harness(pki: Pki) -> AsyncIterator[Harness]:
    clock = FakeClock(T0)
    section = WorkerSection(strategy="flexible", offer_ttl_s=5.0, lease_ttl_s=10.0, max_lease_ttl_s=30.0)
    connector = PeerConnector(pki.tls("worker"), None)
    market = WorkerMarket("worker-1", None, connector, section, CAPACITY, clock=clock)
    h = Harness(market, clock)
    market.on_lease_end.append(h.ended.append)
    yield h
    await market.stop()
    await connector.close()


def test_an_offer_holds_its_resources_until_it_lapses_unreported(harness: Harness) -> None:
    # Prepare
    decision = harness.offer("r1")
    assert harness.market.status().free == CAPACITY - SMALL
    assert harness.market.ledger.get(decision.lease_id).state is LeaseState.TEMPORARY

    # Execute: nobody accepts it before its TTL.
    harness.clock.now += 4.9
    assert harness.market.prune() == []
    harness.clock.now += 0.1
    lost = harness.market.prune()

    # Assert: the reservation is back, counted as a lapsed offer, and no job is told (none ran).
    assert lost == [] and harness.ended == []
    assert harness.market.status().free == CAPACITY
    assert harness.market.stats["offers_lapsed"] == 1 and harness.market.stats["leases_expired"] == 0


def test_accepting_an_offer_activates_its_lease_for_the_default_or_capped_ttl(harness: Harness) -> None:
    first, second = harness.offer("r1"), harness.offer("r2")

    default = harness.market.accept_offer(first.offer_id, "sched", ttl_s=0)
    capped = harness.market.accept_offer(second.offer_id, "sched", ttl_s=1_000)

    assert default.state is LeaseState.ACTIVE and default.expires_at == T0 + 10.0  # lease_ttl_s
    assert capped.expires_at == T0 + 30.0  # max_lease_ttl_s
    assert harness.market.stats["accepted"] == 2
    assert [lease.lease_id for lease in harness.market.status().leases] == [first.lease_id, second.lease_id]


def test_only_the_advertising_scheduler_may_accept_or_release_its_offer(harness: Harness) -> None:
    decision = harness.offer("r1", scheduler="sched")

    with pytest.raises(PermissionDeniedError):
        harness.market.accept_offer(decision.offer_id, "intruder", ttl_s=5)
    with pytest.raises(PermissionDeniedError):
        harness.market.release_offer(decision.offer_id, "intruder")

    assert harness.market.ledger.get(decision.lease_id).state is LeaseState.TEMPORARY


def test_releasing_an_offer_frees_it_once_and_an_accepted_one_must_be_released_as_a_lease(
    harness: Harness,
) -> None:
    declined, taken = harness.offer("r1"), harness.offer("r2")
    harness.market.accept_offer(taken.offer_id, "sched", ttl_s=5)

    assert harness.market.release_offer(declined.offer_id, "sched") is True
    assert harness.market.release_offer(declined.offer_id, "sched") is False  # a retry: nothing to do
    with pytest.raises(FailedPreconditionError, match="release the lease instead"):
        harness.market.release_offer(taken.offer_id, "sched")

    assert harness.market.stats["offers_released"] == 1
    assert harness.market.status().free == CAPACITY - SMALL  # only the accepted one still holds
    assert harness.ended == []  # an offer never ran a job


async def test_releasing_an_accepted_lease_tells_every_callback_once(harness: Harness) -> None:
    # Prepare: a failing callback and an async one beside the harness's own.
    told_async: list[str] = []

    def broken(lease: Lease) -> None:
        raise RuntimeError("callback bug")

    async def later(lease: Lease) -> None:
        told_async.append(lease.lease_id)

    harness.market.on_lease_end[:0] = [broken]
    harness.market.on_lease_end.append(later)
    decision = harness.offer("r1")
    harness.market.accept_offer(decision.offer_id, "sched", ttl_s=5)

    # Execute: released, then released again (a retried call).
    assert harness.market.release_lease(decision.lease_id, "sched") is True
    assert harness.market.release_lease(decision.lease_id, "sched") is False

    # Assert: one report, despite the broken callback; the async one ran too.
    assert [(lease.lease_id, lease.state) for lease in harness.ended] == [
        (decision.lease_id, LeaseState.RELEASED)
    ]
    await until(lambda: told_async == [decision.lease_id], "the async callback ran")
    assert harness.market.stats["leases_released"] == 1
    assert harness.market.status().free == CAPACITY


def test_an_unaccepted_offer_released_as_a_lease_is_not_reported(harness: Harness) -> None:
    decision = harness.offer("r1")

    assert harness.market.release_lease(decision.lease_id, "sched") is True

    assert harness.ended == []
    assert harness.market.status().free == CAPACITY


def test_renewal_extends_from_now_and_an_overdue_lease_is_not_revived(harness: Harness) -> None:
    decision = harness.offer("r1")
    harness.market.accept_offer(decision.offer_id, "sched", ttl_s=5)

    harness.clock.now += 4
    renewed = harness.market.renew_lease(decision.lease_id, "sched", ttl_s=0)
    assert renewed.expires_at == harness.clock.now + 10.0  # the default lease_ttl_s

    harness.clock.now += 10
    with pytest.raises(FailedPreconditionError, match="expired"):
        harness.market.renew_lease(decision.lease_id, "sched", ttl_s=5)


def test_an_expired_accepted_lease_is_ended_and_reported(harness: Harness) -> None:
    # Prepare: one accepted lease and one offer, both overdue.
    accepted, offered = harness.offer("r1"), harness.offer("r2")
    harness.market.accept_offer(accepted.offer_id, "sched", ttl_s=5)
    harness.clock.now += 5

    # Execute
    lost = harness.market.prune()

    # Assert: only the accepted one is reported (its job must be cancelled).
    assert [lease.lease_id for lease in lost] == [accepted.lease_id]
    assert [(lease.lease_id, lease.state) for lease in harness.ended] == [
        (accepted.lease_id, LeaseState.EXPIRED)
    ]
    assert harness.market.ledger.get(offered.lease_id).state is LeaseState.EXPIRED
    assert (harness.market.stats["leases_expired"], harness.market.stats["offers_lapsed"]) == (1, 1)
    assert harness.market.status().free == CAPACITY


async def test_the_pruner_ends_leases_on_its_own(pki: Pki) -> None:
    # Prepare: a started market whose pruner runs every 10 ms, on a clock the test moves.
    clock = FakeClock(T0)
    connector = PeerConnector(pki.tls("worker"), None)
    market = WorkerMarket(
        "worker-1", None, connector, WorkerSection(prune_interval_s=0.01), CAPACITY, clock=clock
    )
    ended: list[Lease] = []
    market.on_lease_end.append(ended.append)
    await market.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            await market.start()
        ad = AdvertisementView("r1", "sched", Requirements(SMALL, ExecutorKind.TASK), 1.0, T0 + 60)
        market.arbiter.add(ad, clock())
        (decision,) = market.arbiter.decide(clock())
        market.accept_offer(decision.offer_id, "sched", ttl_s=3)

        # Execute
        clock.now += 3

        # Assert
        await until(lambda: [lease.lease_id for lease in ended] == [decision.lease_id], "lease expired")
    finally:
        await market.stop()
        await market.stop()  # idempotent
        await connector.close()


# ---- advertisements in, offers out, over a real gateway -----------------------------------------


class Control(scheduler_pb2_grpc.SchedulerControlServicer):
    """The scheduler's SubmitOffer: records each offer and answers per request."""

    def __init__(self) -> None:
        self.offers: list[common_pb2.Offer] = []
        self.refuse: set[str] = set()
        #: Runs before the answer (a scheduler that accepts before its reply is read).
        self.before_answer: Callable[[common_pb2.Offer], object] | None = None

    async def SubmitOffer(
        self, request: common_pb2.Offer, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitOfferResponse:
        self.offers.append(request)
        if self.before_answer is not None:
            self.before_answer(request)
        return scheduler_pb2.SubmitOfferResponse(received=request.request_id not in self.refuse)


@dataclass
class Network:
    scheduler: NodeLink
    scheduler_address: str
    control: Control
    market: WorkerMarket
    outsider: NodeLink
    #: A second scheduler, with no server: nothing it advertises can be answered.
    unreachable: NodeLink


@pytest.fixture
async def mesh(pki: Pki) -> AsyncIterator[Mesh]:
    m = Mesh(pki)
    yield m
    await m.close()


@pytest.fixture
async def network(mesh: Mesh) -> AsyncIterator[Network]:
    """A gateway; a scheduler (link and server), a worker's market, a worker that is not a scheduler,
    and a scheduler that cannot be reached."""
    (gw,) = await mesh.full_mesh(1)
    scheduler = await mesh.add_link("scheduler", "mk-sched", [gw.address])
    control = Control()
    server = NodeServer(
        mesh.pki.tls("mk-sched"),
        "127.0.0.1:0",
        [(scheduler_pb2_grpc.add_SchedulerControlServicer_to_server, control, "hypha.v1.SchedulerControl")],
    )
    await server.start()
    worker_link = await mesh.add_link("worker", "mk-worker", [gw.address])
    outsider = await mesh.add_link("worker", "mk-outsider", [gw.address])
    unreachable = await mesh.add_link("scheduler", "mk-sched-gone", [gw.address])
    connector = PeerConnector(mesh.pki.tls("mk-worker"), None)
    section = WorkerSection(strategy="flexible", batch_window_s=0.05, offer_ttl_s=30.0, offer_timeout_s=5.0)
    market = WorkerMarket(worker_link.peer_id, worker_link, connector, section, CAPACITY)
    await market.start()
    await until(lambda: worker_link.peer_id in gw.hub.topics.get(WORKER_TOPIC, ()), "listening for ads")
    try:
        yield Network(scheduler, server.address, control, market, outsider, unreachable)
    finally:
        await market.stop()
        await connector.close()
        await server.stop(0)


def advertisement(request: str, addresses: list[str], minimum: Resources = SMALL, bid: float = 3.0) -> bytes:
    return common_pb2.Advertisement(
        request_id=request,
        scheduler_addresses=addresses,
        requirements=Requirements(minimum, ExecutorKind.TASK).to_proto(),
        bid=bid,
        deadline=to_timestamp(time.time() + 60),
    ).SerializeToString()


async def test_an_advertisement_becomes_an_offer_backed_by_a_reservation(network: Network) -> None:
    # Execute
    await network.scheduler.publish(WORKER_TOPIC, advertisement("r1", [network.scheduler_address]))

    # Assert: the offer reached the scheduler; its resources stay reserved for it.
    await until(lambda: network.market.stats["offers_sent"] == 1, "offer received")
    (offer,) = network.control.offers
    assert offer.request_id == "r1" and offer.worker_id == network.market.peer_id
    assert Resources.from_proto(offer.resources) == SMALL and offer.price == 3.0  # flexible: the bid
    assert Resources.from_proto(offer.capacity) == CAPACITY
    (lease,) = network.market.ledger.live()
    assert (lease.lease_id, lease.holder, lease.state) == (
        offer.offer_id,
        network.scheduler.peer_id,  # the gateway's stamp, not a field of the advertisement
        LeaseState.TEMPORARY,
    )


async def test_a_refused_or_undeliverable_offer_frees_its_reservation_at_once(network: Network) -> None:
    # Prepare: the scheduler refuses r1; r2 comes from a scheduler with no address (and there is no relay).
    network.control.refuse.add("r1")

    # Execute
    await network.scheduler.publish(WORKER_TOPIC, advertisement("r1", [network.scheduler_address]))
    await network.unreachable.publish(WORKER_TOPIC, advertisement("r2", []))

    # Assert: both reservations are back long before their 30 s offer TTL.
    await until(
        lambda: network.market.stats["offers_refused"] == 1 and network.market.stats["offers_failed"] == 1,
        "both offers ended",
    )
    assert network.market.ledger.live() == []
    assert network.market.status().free == CAPACITY


async def test_an_offer_accepted_before_its_refusal_arrives_keeps_its_lease(network: Network) -> None:
    # Prepare: the scheduler accepts the offer, then (late, over its max) answers received=false.
    market = network.market
    network.control.refuse.add("r1")
    network.control.before_answer = lambda offer: market.accept_offer(
        offer.offer_id, network.scheduler.peer_id, 5
    )

    # Execute
    await network.scheduler.publish(WORKER_TOPIC, advertisement("r1", [network.scheduler_address]))

    # Assert: the refusal does not free a lease that is now active.
    await until(lambda: market.stats["offers_refused"] == 1, "refusal read")
    (lease,) = market.ledger.live()
    assert lease.state is LeaseState.ACTIVE


async def test_advertisements_from_non_schedulers_or_unparsable_ones_get_no_offer(network: Network) -> None:
    # Execute: a worker advertises (only the gateway's stamp says who sent it), and a scheduler
    # sends bytes that are no advertisement, and one without requirements.
    await network.outsider.publish(WORKER_TOPIC, advertisement("fake", [network.scheduler_address]))
    await network.scheduler.publish(WORKER_TOPIC, b"\xff\xff\xff")
    await network.scheduler.publish(
        WORKER_TOPIC, common_pb2.Advertisement(request_id="bare", bid=1.0).SerializeToString()
    )

    # Assert
    market = network.market
    await until(lambda: market.stats["ads"] == 3, "all three read")
    assert (market.unauthorized, market.malformed) == (1, 2)
    assert market.arbiter.pending() == 0 and market.ledger.live() == [] and network.control.offers == []
