"""The worker's side of the market on the network.

Advertisements arrive on ``hypha/worker`` through the gateway link. Only the
gateway's sender stamp says who sent one: an advertisement whose sender is
not a scheduler is ignored and counted (``stats["unauthorized"]``), one that
does not parse is counted as malformed. The rest feed the ``Arbiter``, which
decides once per batch window; each offer it makes is already backed by a
temporary lease in the ``LeaseLedger`` and goes to the advertising scheduler
with ``SchedulerControl.SubmitOffer`` (direct address first, relay fallback).

An advertisement may ask only some workers to answer (``offer_probability``);
the arbiter draws that lottery. One this worker will consider also opens the
channel to its scheduler at once if there is none yet: the batch window is
idle time, and a first offer would otherwise wait for two TLS handshakes
(the connector's identity check and the channel's) after the window closed.

An offer the scheduler answers ``received=false`` (it is above its max, late,
or the request is over), or that cannot be delivered, frees its reservation
at once instead of waiting for the temporary lease to lapse.

The accept/renew/release operations the ``Worker`` servicer exposes live here
too, so that every change of the ledger happens in one place and one event
loop (the ledger is single-writer). A pruner ends expired leases every
``prune_interval_s`` and reports the leases that had been accepted to the
``on_lease_end`` callbacks (the job manager cancels the jobs under them);
releases by the holder are reported the same way.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from hypha.errors import FailedPreconditionError, HyphaError, InvalidArgumentError, PermissionDeniedError
from hypha.market.arbiter import AdvertisementView, Arbiter, ArbiterConfig, OfferDecision, OfferStrategy
from hypha.market.leases import Lease, LeaseLedger, LeaseState
from hypha.market.resources import ExecutorKind, Resources
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink, Subscription
from hypha.net.messages import WORKER_TOPIC, Message
from hypha.pki.identity import Role
from hypha.service import BackgroundTasks, Service
from hypha.v1 import common_pb2, scheduler_pb2_grpc
from hypha.worker.config import WorkerSection

log = logging.getLogger(__name__)

#: Told about every accepted lease that ended (expired or released by its holder).
LeaseEndCallback = Callable[[Lease], Awaitable[None] | None]


def arbiter_config(section: WorkerSection) -> ArbiterConfig:
    return ArbiterConfig(
        price=section.price,
        floor=section.floor,
        strategy=OfferStrategy.parse(section.strategy),
        executors=frozenset(ExecutorKind.parse(name) for name in section.executors),
        offer_ttl_s=section.offer_ttl_s,
        batch_window_s=section.batch_window_s,
        batch_max=section.batch_max,
        buffer_max=section.buffer_max,
    )


@dataclass(frozen=True)
class MarketStatus:
    capacity: Resources
    free: Resources
    leases: list[Lease]


class WorkerMarket(Service):
    """Arbiter, ledger and pruner of one worker, wired to its gateway link."""

    def __init__(
        self,
        peer_id: str,
        link: NodeLink | None,
        connector: PeerConnector,
        section: WorkerSection,
        capacity: Resources,
        *,
        addresses: Callable[[], list[str]] = list,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.section = section
        self.peer_id = peer_id
        self.link = link
        self.connector = connector
        self.ledger = LeaseLedger(capacity, max_ttl_s=section.max_lease_ttl_s, max_live=section.max_leases)
        self.arbiter = Arbiter(self.ledger, arbiter_config(section))
        self.stats: Counter[str] = Counter()
        self.on_lease_end: list[LeaseEndCallback] = []
        #: Where this worker can be called directly (told to schedulers in offers).
        self.addresses = addresses
        self._clock = clock
        self._slots = asyncio.Semaphore(section.max_concurrent_offers)
        self._tasks = BackgroundTasks(log)
        self._warming: set[str] = set()  # schedulers a channel is being opened to ahead of an offer
        self._started = False
        # NOTE: subscribe now, before the link connects: the link sends its
        # subscriptions when a session opens, so none can fall between the two.
        # Without a link (no gateway configured) the worker is simply not on the market.
        self._ads: Subscription | None = (
            None if link is None else link.subscribe(WORKER_TOPIC, maxsize=section.buffer_max)
        )
        self._stopped = False

    @property
    def malformed(self) -> int:
        """Advertisements that could not be parsed or carried impossible values."""
        return self.arbiter.dropped["malformed"]

    @property
    def unauthorized(self) -> int:
        """Advertisements whose gateway-stamped sender was not a scheduler."""
        return self.stats["unauthorized"]

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("worker market already started")
        self._started = True
        self._tasks.spawn(self._prune_loop(), "worker-market pruner")
        if self._ads is not None:
            self._tasks.spawn(self._intake(self._ads), "worker-market intake")

    async def stop(self) -> None:
        """Idempotent: stop deciding and pruning, abandon offers in flight."""
        if self._stopped:
            return
        self._stopped = True
        if self._ads is not None:
            self._ads.close()
        await self._tasks.cancel()

    # ---- what the Worker servicer calls ---------------------------------------

    def accept_offer(self, offer_id: str, holder: str, ttl_s: float) -> Lease:
        # NOTE: the arbiter reserves with offer_id == lease_id, so the offer id finds the lease.
        lease = self.ledger.activate(offer_id, holder, ttl_s or self.section.lease_ttl_s, self._clock())
        self.stats["accepted"] += 1
        return lease

    def release_offer(self, offer_id: str, holder: str) -> bool:
        """False when the offer had already ended (lapsed or released): nothing to do."""
        lease = self._held_by(offer_id, holder)
        if lease.state is LeaseState.ACTIVE:
            raise FailedPreconditionError(f"offer {offer_id!r} was accepted; release the lease instead")
        if not lease.is_live:
            return False
        self.ledger.release(offer_id, holder, self._clock())
        self.stats["offers_released"] += 1
        return True

    def renew_lease(self, lease_id: str, holder: str, ttl_s: float) -> Lease:
        return self.ledger.renew(lease_id, holder, ttl_s or self.section.lease_ttl_s, self._clock())

    def release_lease(self, lease_id: str, holder: str) -> bool:
        """False when the lease had already ended (a retried release)."""
        lease = self._held_by(lease_id, holder)
        if not lease.is_live:
            return False
        ended = self.ledger.release(lease_id, holder, self._clock())
        self.stats["leases_released"] += 1
        if lease.state is LeaseState.ACTIVE:
            self._report(ended)
        return True

    def _held_by(self, lease_id: str, holder: str) -> Lease:
        lease = self.ledger.get(lease_id)
        if lease.holder != holder:
            raise PermissionDeniedError(f"lease {lease_id!r} is held by another peer")
        return lease

    def status(self) -> MarketStatus:
        return MarketStatus(self.ledger.capacity, self.ledger.free(), self.ledger.live())

    # ---- advertisements in, offers out ------------------------------------------

    async def _intake(self, ads: Subscription) -> None:
        while True:
            decide_at = self.arbiter.decide_at()
            if not self.arbiter.ready(self._clock()):
                timeout = None if decide_at is None else max(0.0, decide_at - self._clock())
                try:
                    message = await ads.get(timeout)
                except TimeoutError:
                    pass
                except StopAsyncIteration:
                    return
                else:
                    self._ingest(message)
                    continue
            now = self._clock()
            if self.arbiter.ready(now):
                for decision in self.arbiter.decide(now):
                    self._tasks.spawn(self._submit(decision), f"offer {decision.offer_id}")

    def _ingest(self, message: Message) -> None:
        self.stats["ads"] += 1
        if message.from_role is not Role.SCHEDULER:
            self.stats["unauthorized"] += 1
            if self.stats["unauthorized"] % 100 == 1:  # a flood must not flood the log too
                log.warning(
                    "advertisement from %s (role %s) ignored (%d so far)",
                    message.from_peer,
                    message.from_role.value,
                    self.stats["unauthorized"],
                )
            return
        try:
            msg = common_pb2.Advertisement.FromString(message.payload)
            ad = AdvertisementView.from_proto(msg, scheduler_id=message.from_peer)
        except (DecodeError, InvalidArgumentError) as err:
            self.arbiter.note_malformed()
            log.info("malformed advertisement from %s: %s", message.from_peer, err)
            return
        if self.arbiter.add(ad, self._clock()):
            self._prewarm(ad)

    def _prewarm(self, ad: AdvertisementView) -> None:
        """Open the channel to ``ad``'s scheduler during the batch window, if none is open."""
        scheduler_id = ad.scheduler_id
        if scheduler_id in self._warming or self.connector.is_direct(scheduler_id) is not None:
            return
        self._warming.add(scheduler_id)

        async def warm() -> None:
            try:
                await self.connector.channel(scheduler_id, list(ad.scheduler_addresses))
            except HyphaError as err:  # the offer itself will try again and count the failure
                log.debug("no channel to %s yet: %s", scheduler_id, err.message)
            finally:
                self._warming.discard(scheduler_id)

        self._tasks.spawn(warm(), f"channel to {scheduler_id}")

    async def _submit(self, decision: OfferDecision) -> None:
        async with self._slots:
            try:
                channel = await self.connector.channel(
                    decision.scheduler_id, list(decision.scheduler_addresses)
                )
                stub = scheduler_pb2_grpc.SchedulerControlStub(channel)
                offer = decision.to_proto(
                    worker_id=self.peer_id,
                    worker_addresses=tuple(self.addresses()),
                    capacity=self.ledger.capacity,
                    active_leases=len(self.ledger.active()),
                )
                left = decision.expires_at - self._clock()
                reply = await stub.SubmitOffer(
                    offer, timeout=max(0.05, min(self.section.offer_timeout_s, left))
                )
            except grpc.aio.AioRpcError as err:
                self.stats["offers_failed"] += 1
                log.info("offer to %s failed: %s", decision.scheduler_id, err.code().name)
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    await self.connector.invalidate(decision.scheduler_id)
            except HyphaError as err:  # no path to the scheduler at all
                self.stats["offers_failed"] += 1
                log.info("offer to %s not sent: %s", decision.scheduler_id, err.message)
            else:
                if reply.received:
                    self.stats["offers_sent"] += 1
                    return
                self.stats["offers_refused"] += 1
            self._withdraw(decision)

    def _withdraw(self, decision: OfferDecision) -> None:
        """Free the reservation behind an offer nobody will accept (unless it was accepted meanwhile)."""
        lease = self.ledger.find(decision.lease_id)
        if lease is not None and lease.state is LeaseState.TEMPORARY:
            self.ledger.release(lease.lease_id, lease.holder, self._clock())

    # ---- expiry ---------------------------------------------------------------

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self.section.prune_interval_s)
            self.prune()

    def prune(self) -> list[Lease]:
        """End every overdue lease now; returns those that had been accepted."""
        now = self._clock()
        accepted = {lease.lease_id for lease in self.ledger.active() if lease.is_overdue(now)}
        ended = self.ledger.expire_due(now)
        lost = [lease for lease in ended if lease.lease_id in accepted]
        self.stats["offers_lapsed"] += len(ended) - len(lost)
        self.stats["leases_expired"] += len(lost)
        for lease in lost:
            log.info("lease %s of %s expired", lease.lease_id, lease.holder)
            self._report(lease)
        return lost

    def _report(self, lease: Lease) -> None:
        for callback in list(self.on_lease_end):
            try:
                result = callback(lease)
            except Exception:
                log.exception("lease-end callback failed for %s", lease.lease_id)
                continue
            if inspect.isawaitable(result):
                self._tasks.spawn(_logged(result, lease.lease_id), f"lease-end {lease.lease_id}")


async def _logged(result: Awaitable[Any], lease_id: str) -> None:
    try:
        await result
    except Exception:
        log.exception("lease-end callback failed for %s", lease_id)
