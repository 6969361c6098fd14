"""The scheduler's side of the market on the network: advertise, collect, accept,
keep leases alive, and replace the ones that are lost.

``allocate`` publishes an advertisement on ``hypha/worker`` and waits while the
``SchedulerControl.SubmitOffer`` handler feeds the offers workers send into
the round's ``Allocation`` (the worker id is the caller's TLS or relay
identity, never the message's field). When enough distinct workers offered or
the window closed, the policy picks the winners: they are accepted with
``Worker.AcceptOffer``, the losers released with ``Worker.ReleaseOffer``.
Offers refused on arrival (above the private max, late, unknown request)
are answered ``received=false`` and the worker frees them itself. A round
that ends short (too few offers, an accept that failed because the offer
lapsed) is followed by another advertisement for the rest, until
``allocate_timeout_s``.

Held leases live in a ``LeaseBook``. A renewal loop renews each at 2/3 of its
life; a renewal the worker refuses (the lease is gone) or one that keeps
failing until the lease is overdue makes the lease *lost*: it leaves the book,
a ``LeaseEvent`` goes to the listeners, and when its allocation asked for it a
replacement is advertised for until one is found. ``stop`` releases every
held lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import grpc

from hypha.errors import HyphaError, UnavailableError
from hypha.market.allocator import Allocation, HeldLease, LeaseBook
from hypha.market.arbiter import AdvertisementView
from hypha.market.policies import BalancedPolicy, OfferView, SelectionPolicy, get_policy
from hypha.market.pricing import PriceRange
from hypha.market.resources import (
    ExecutorKind,
    Requirements,
    Resources,
    seconds_from_timestamp,
    timestamp_from_seconds,
)
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.messages import WORKER_TOPIC
from hypha.scheduler.config import SchedulerSection
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

#: Renewal refusals that mean the worker no longer has the lease (retrying cannot help).
_GONE = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class LeaseEventKind(StrEnum):
    LOST = "lost"  # the worker no longer honours the lease
    REPLACED = "replaced"  # a lost lease's replacement is held


@dataclass(frozen=True)
class LeaseEvent:
    kind: LeaseEventKind
    lease: HeldLease
    reason: str = ""
    replacement: HeldLease | None = None


@dataclass
class _Terms:
    """How an allocation buys, kept with each of its leases for a replacement."""

    price: PriceRange
    policy: SelectionPolicy
    replace_lost: bool
    tag: str


@dataclass
class _Round:
    allocation: Allocation
    exclude: frozenset[str]
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _WorkerInfo:
    addresses: tuple[str, ...] = ()
    capacity: Resources = field(default_factory=Resources)


class SchedulerMarket:
    """Allocation rounds, held leases and their renewal, for one scheduler."""

    def __init__(
        self,
        peer_id: str,
        link: NodeLink | None,
        connector: PeerConnector,
        section: SchedulerSection,
        *,
        addresses: Callable[[], list[str]] = list,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.peer_id = peer_id
        self.link = link
        self.connector = connector
        self.section = section
        #: Where workers can call this scheduler directly (told in advertisements).
        self.addresses = addresses
        self.book = LeaseBook()
        self.stats: Counter[str] = Counter()
        #: Called with every LeaseEvent; must not block.
        self.listeners: list[Callable[[LeaseEvent], None]] = []
        self._clock = clock
        self._rounds: dict[str, _Round] = {}
        self._terms: dict[str, _Terms] = {}
        self._workers: dict[str, _WorkerInfo] = {}
        self._renewing: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._started = False
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("scheduler market already started")
        self._started = True
        self._loops.append(asyncio.create_task(self._renewal_loop(), name="scheduler-market renewals"))
        if self.section.pool.count > 0:
            if self.link is None:
                log.warning("scheduler.pool is set but no gateway is configured: the pool stays empty")
            else:
                self._loops.append(asyncio.create_task(self._keep_pool(), name="scheduler-market pool"))

    async def stop(self) -> None:
        """Idempotent: stop allocating and renewing, then release every held lease."""
        if self._stopping:
            return
        self._stopping = True
        tasks = [*self._loops, *self._tasks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.release_all()

    async def __aenter__(self) -> SchedulerMarket:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- queries ---------------------------------------------------------------

    def leases(self) -> list[HeldLease]:
        return self.book.leases()

    def worker_addresses(self, worker_id: str) -> tuple[str, ...]:
        info = self._workers.get(worker_id)
        return () if info is None else info.addresses

    def worker_capacity(self, worker_id: str) -> Resources:
        info = self._workers.get(worker_id)
        return Resources() if info is None else info.capacity

    def events(self, maxsize: int = 256) -> asyncio.Queue[LeaseEvent]:
        """A queue that receives every later LeaseEvent (events beyond ``maxsize`` are dropped, counted)."""
        queue: asyncio.Queue[LeaseEvent] = asyncio.Queue(maxsize)

        def put(event: LeaseEvent) -> None:
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self.stats["events_dropped"] += 1

        self.listeners.append(put)
        return queue

    # ---- offers in (from the SchedulerControl servicer) --------------------------

    def submit_offer(self, offer: OfferView) -> bool:
        """Consider one offer; False tells the worker to free it (nobody will accept it)."""
        self.stats["offers"] += 1
        current = self._rounds.get(offer.request_id)
        if current is None:
            self.stats["offers_unknown"] += 1
            return False
        if offer.worker_id in current.exclude:
            self.stats["offers_excluded"] += 1
            return False
        if not current.allocation.offer(offer, self._clock()):
            return False
        info = self._workers.setdefault(offer.worker_id, _WorkerInfo())
        info.addresses = offer.worker_addresses or info.addresses
        info.capacity = offer.machine()
        current.arrived.set()
        return True

    # ---- allocation ----------------------------------------------------------------

    def policy(self, name: str | None = None) -> SelectionPolicy:
        """A fresh policy by name (default: the configured one)."""
        name = name or self.section.policy
        if name == BalancedPolicy.name:
            return BalancedPolicy(in_use=self.book.count_by_worker)
        return get_policy(name)

    async def allocate(
        self,
        requirement: Requirements,
        count: int,
        price: PriceRange | None = None,
        policy: str | SelectionPolicy | None = None,
        window_s: float | None = None,
        *,
        replace_lost: bool = False,
        timeout_s: float | None = None,
        tag: str = "",
        exclude: Collection[str] = (),
    ) -> list[HeldLease]:
        """Lease ``count`` distinct workers meeting ``requirement``; may return fewer
        when the market has too few before ``timeout_s`` (default ``allocate_timeout_s``).
        Offers from workers in ``exclude`` (e.g. those already working on the job) are refused.

        With ``replace_lost``, a lease of this allocation that is later lost is
        replaced automatically (a REPLACED event reports the new one).
        """
        if self.link is None:
            raise UnavailableError("no gateway configured: this scheduler cannot advertise")
        if self._stopping:
            raise UnavailableError("scheduler market stopping")
        terms = _Terms(
            price=price or PriceRange(self.section.bid, self.section.max_price),
            policy=policy if policy is not None and not isinstance(policy, str) else self.policy(policy),
            replace_lost=replace_lost,
            tag=tag,
        )
        window_s = window_s or self.section.offer_window_s
        deadline = self._clock() + (timeout_s or self.section.allocate_timeout_s)
        won: list[HeldLease] = []
        while len(won) < count and self._clock() < deadline and not self._stopping:
            skip = frozenset(exclude) | {lease.worker_id for lease in won}
            won.extend(await self._round(requirement, count - len(won), terms, window_s, deadline, skip))
        self.stats["allocations"] += 1
        if len(won) < count:
            self.stats["allocations_short"] += 1
            log.info("allocation got %d of %d workers for %s", len(won), count, requirement)
        return won

    async def _round(
        self,
        requirement: Requirements,
        count: int,
        terms: _Terms,
        window_s: float,
        deadline: float,
        exclude: frozenset[str],
    ) -> list[HeldLease]:
        assert self.link is not None
        request_id = uuid.uuid4().hex
        now = self._clock()
        window_ends_at = min(now + window_s, deadline)
        allocation = Allocation(request_id, requirement, count, terms.price, window_ends_at, terms.policy)
        current = _Round(allocation, exclude)
        self._rounds[request_id] = current
        try:
            ad = AdvertisementView(
                request_id=request_id,
                scheduler_id=self.peer_id,
                requirements=requirement,
                bid=terms.price.bid,
                deadline=deadline,
                count=count,
                scheduler_addresses=tuple(self.addresses()),
            )
            await self.link.publish(WORKER_TOPIC, ad.to_proto().SerializeToString())
            self.stats["advertisements"] += 1
            while not allocation.complete(now := self._clock()):
                closes_at = self._closes_at(allocation)
                if now >= closes_at:
                    break
                current.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(current.arrived.wait(), closes_at - now)
            choice = allocation.choose(self._clock())
        finally:
            del self._rounds[request_id]
        for reason, dropped in allocation.dropped.items():
            self.stats[f"offers_dropped_{reason}"] += dropped
        for loser in choice.losers:
            self._spawn(self._release_offer(loser), f"release offer {loser.offer_id}")
        accepted = await asyncio.gather(*(self._accept(offer, allocation, terms) for offer in choice.winners))
        return [lease for lease in accepted if lease is not None]

    def _closes_at(self, allocation: Allocation) -> float:
        """The window's end, or earlier: in time to accept the first kept offer before it lapses.

        NOTE: this is what makes a window longer than the workers' offer ttl
        safe; without it a lone early offer would always lapse before the choice.
        """
        expiries = [offer.expires_at for offer in allocation.candidates()]
        if not expiries:
            return allocation.window_ends_at
        return min(allocation.window_ends_at, min(expiries) - self.section.accept_margin_s)

    async def _accept(self, offer: OfferView, allocation: Allocation, terms: _Terms) -> HeldLease | None:
        sent_at = self._clock()
        try:
            stub = await self._worker_stub(offer.worker_id)
            lease = await stub.AcceptOffer(
                worker_pb2.AcceptOfferRequest(offer_id=offer.offer_id, lease_ttl_s=self.section.lease_ttl_s),
                timeout=self.section.rpc_timeout_s,
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            self.stats["accepts_failed"] += 1
            log.info("accepting offer %s of %s failed: %s", offer.offer_id, offer.worker_id, _describe(err))
            await self._invalidate(offer.worker_id, err)
            return None
        expires_at = seconds_from_timestamp(lease.expires_at)
        held = HeldLease(
            lease_id=lease.lease_id,
            worker_id=offer.worker_id,
            request_id=allocation.request_id,
            requirement=allocation.requirement,
            resources=Resources.from_proto(lease.resources),
            price=lease.price,
            expires_at=expires_at,
            # The worker may have granted less than asked: renew on its clock, not ours.
            ttl_s=max(1e-3, min(self.section.lease_ttl_s, expires_at - sent_at)),
            job_id=terms.tag,
        )
        self.book.add(held)
        self._terms[held.lease_id] = terms
        self.stats["accepted"] += 1
        self._wake.set()
        if self._stopping:  # stop() may already have released what it knew of
            self._spawn(self.release(held.lease_id), f"release {held.lease_id}")
        return held

    async def _release_offer(self, offer: OfferView) -> None:
        try:
            stub = await self._worker_stub(offer.worker_id)
            await stub.ReleaseOffer(
                worker_pb2.ReleaseOfferRequest(offer_id=offer.offer_id), timeout=self.section.rpc_timeout_s
            )
            self.stats["offers_released"] += 1
        except (grpc.aio.AioRpcError, HyphaError) as err:
            # The worker's temporary lease lapses on its own; this only frees it sooner.
            log.debug("releasing offer %s failed: %s", offer.offer_id, _describe(err))

    # ---- releasing ---------------------------------------------------------------

    async def release(self, lease_id: str) -> bool:
        """Give a held lease back; False if it was not held (or the worker could not be told)."""
        held = self.book.release(lease_id)
        self._terms.pop(lease_id, None)
        if held is None:
            return False
        try:
            stub = await self._worker_stub(held.worker_id)
            await stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=self.section.rpc_timeout_s
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            # The lease lapses on the worker within its ttl anyway.
            log.info("releasing lease %s on %s failed: %s", lease_id, held.worker_id, _describe(err))
            return False
        self.stats["released"] += 1
        return True

    async def release_all(self) -> None:
        await asyncio.gather(*(self.release(lease.lease_id) for lease in self.book.leases()))

    # ---- renewal and loss ----------------------------------------------------------

    async def _renewal_loop(self) -> None:
        while True:
            now = self._clock()
            for lease in self.book.due_for_renewal(now):
                if lease.lease_id not in self._renewing:
                    self._renewing.add(lease.lease_id)
                    self._spawn(self._renew(lease), f"renew {lease.lease_id}")
            waiting = [
                lease.renew_at() for lease in self.book.leases() if lease.lease_id not in self._renewing
            ]
            timeout = None if not waiting else max(0.0, min(waiting) - now)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _renew(self, lease: HeldLease) -> None:
        """Renew until the worker agrees, refuses, or the lease is overdue."""
        retry_s = min(1.0, max(0.05, lease.ttl_s / 20))
        try:
            while lease.lease_id in self.book:
                left = lease.expires_at - self._clock()
                if left <= 0:
                    self._lose(lease, "not renewed before it expired")
                    return
                try:
                    stub = await self._worker_stub(lease.worker_id)
                    renewed = await stub.RenewLease(
                        worker_pb2.RenewLeaseRequest(
                            lease_id=lease.lease_id, lease_ttl_s=self.section.lease_ttl_s
                        ),
                        timeout=min(self.section.rpc_timeout_s, left),
                    )
                except (grpc.aio.AioRpcError, HyphaError) as err:
                    code = err.code() if isinstance(err, grpc.aio.AioRpcError) else err.status
                    if code in _GONE:
                        self._lose(lease, f"renewal refused: {_describe(err)}")
                        return
                    self.stats["renewals_failed"] += 1
                    await self._invalidate(lease.worker_id, err)
                    await asyncio.sleep(min(retry_s, max(0.0, lease.expires_at - self._clock())))
                    continue
                if lease.lease_id in self.book:
                    self.book.renewed(lease.lease_id, seconds_from_timestamp(renewed.expires_at))
                    self.stats["renewed"] += 1
                return
        finally:
            self._renewing.discard(lease.lease_id)
            self._wake.set()

    def _lose(self, lease: HeldLease, reason: str) -> None:
        held = self.book.mark_lost(lease.lease_id)
        terms = self._terms.pop(lease.lease_id, None)
        if held is None:
            return
        self.stats["lost"] += 1
        log.warning("lost lease %s on worker %s: %s", held.lease_id, held.worker_id, reason)
        self._emit(LeaseEvent(LeaseEventKind.LOST, held, reason))
        if terms is not None and terms.replace_lost and not self._stopping:
            self._spawn(self._replace(held, terms), f"replace {held.lease_id}")

    async def _replace(self, lost: HeldLease, terms: _Terms) -> None:
        while not self._stopping:
            try:
                got = await self.allocate(
                    lost.requirement, 1, terms.price, terms.policy, replace_lost=True, tag=terms.tag
                )
            except UnavailableError:
                return
            if got:
                self.stats["replaced"] += 1
                self._emit(LeaseEvent(LeaseEventKind.REPLACED, lost, "replacement held", got[0]))
                return
            await asyncio.sleep(self.section.replace_retry_s)

    async def _keep_pool(self) -> None:
        pool = self.section.pool
        requirement = Requirements(
            Resources(pool.cpu, pool.memory_gb, pool.storage_gb, pool.gpu, pool.gpu_memory_gb),
            ExecutorKind.parse(pool.executor),
        )
        price = PriceRange(
            self.section.bid if pool.bid is None else pool.bid,
            self.section.max_price if pool.max_price is None else pool.max_price,
        )
        policy = self.policy()
        held = 0
        while held < pool.count:
            got = await self.allocate(
                requirement, pool.count - held, price, policy, replace_lost=True, tag="pool"
            )
            held += len(got)
            if held < pool.count:
                await asyncio.sleep(self.section.replace_retry_s)
        log.info("pool of %d workers held", held)

    def _emit(self, event: LeaseEvent) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:
                log.exception("lease event listener failed")

    # ---- plumbing ----------------------------------------------------------------

    async def _worker_stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        channel = await self.connector.channel(worker_id, list(self.worker_addresses(worker_id)))
        return worker_pb2_grpc.WorkerStub(channel)

    async def _invalidate(self, worker_id: str, err: BaseException) -> None:
        if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE:
            await self.connector.invalidate(worker_id)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def held_lease_to_proto(lease: HeldLease, scheduler_id: str) -> common_pb2.Lease:
    return common_pb2.Lease(
        lease_id=lease.lease_id,
        scheduler_id=scheduler_id,
        worker_id=lease.worker_id,
        resources=lease.resources.to_proto(),
        price=lease.price,
        expires_at=timestamp_from_seconds(lease.expires_at),
        state=common_pb2.LEASE_STATE_ACTIVE,
        executor=lease.requirement.executor.to_proto(),
    )


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name} {err.details() or ''}".strip()
    if isinstance(err, HyphaError):
        return err.message
    return repr(err)
