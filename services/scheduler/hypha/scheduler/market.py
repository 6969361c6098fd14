"""The scheduler's side of the market on the network: allocate, hold and give back leases.

``allocate`` runs allocation rounds (``hypha.scheduler.offer_rounds``: advertise,
collect, choose, with offer sampling) until it holds enough workers: the
winners are accepted with ``Worker.AcceptOffer``, the losers released with
``Worker.ReleaseOffer``. A round that ends short (too few offers, an accept
that failed because the offer lapsed) is followed by another advertisement for
the rest, until ``allocate_timeout_s``.

Held leases are renewed by ``hypha.scheduler.lease_keeper``; a lost one sends a
``LeaseEvent`` to the listeners, and when its allocation asked for it a
replacement is advertised for until one is found. The workers heard from and
the channels to them are ``hypha.scheduler.market_workers``. ``stop`` releases
every held lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Iterable
from dataclasses import replace
from typing import Any

import grpc

from hypha.errors import HyphaError, UnavailableError
from hypha.market.allocator import Allocation, HeldLease, LeaseBook
from hypha.market.arbiter import AdvertisementView
from hypha.market.policies import BalancedPolicy, OfferView, SelectionPolicy, get_policy
from hypha.market.pricing import PriceRange
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.net.backoff import Backoff
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.lease_keeper import GONE, LeaseEvent, LeaseEventKind, LeaseKeeper, LeaseTerms
from hypha.scheduler.market_workers import KnownWorker, MarketWorkers
from hypha.scheduler.offer_rounds import WIDEN, OfferRounds, sampled_share
from hypha.scheduler.worker_calls import describe
from hypha.service import BackgroundTasks, Service, cancel_and_wait
from hypha.timestamps import to_seconds
from hypha.v1 import worker_pb2

log = logging.getLogger(__name__)


class SchedulerMarket(Service):
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
        self._workers = MarketWorkers(connector)
        self._rounds = OfferRounds(section, self.stats, clock)
        self._keeper = LeaseKeeper(
            self.book, self._workers, section, self.stats, clock, self._spawn, self._lost
        )
        self._background = BackgroundTasks(log)
        self._loops: list[asyncio.Task[None]] = []
        self._started = False
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("scheduler market already started")
        self._started = True
        self._loops.append(asyncio.create_task(self._keeper.run(), name="scheduler-market renewals"))
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
        await cancel_and_wait(*self._loops)
        await self._background.cancel()
        await self.release_all()

    # ---- queries ---------------------------------------------------------------

    def leases(self) -> list[HeldLease]:
        return self.book.leases()

    def worker_addresses(self, worker_id: str) -> tuple[str, ...]:
        return self._workers.addresses(worker_id)

    def worker_capacity(self, worker_id: str) -> Resources:
        return self._workers.capacity(worker_id)

    def known_workers(self) -> list[KnownWorker]:
        """Every worker that offered on one of this scheduler's advertisements, by id."""
        return self._workers.known()

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

    def submit_offer(self, offer: OfferView, name: str = "") -> bool:
        """Consider one offer (``name``: the worker's certificate name); False tells the worker
        to free it (nobody will accept it). Any offer makes the worker known, even a late one."""
        self.stats["offers"] += 1
        self._workers.heard(offer, name, self._clock())
        if not self._rounds.submit(offer):
            return False
        self._workers.learn(offer.worker_id, offer.worker_addresses, offer.machine())
        self._prewarm(offer.worker_id)
        return True

    def _prewarm(self, worker_id: str) -> None:
        """Open the channel to a worker whose offer was kept, while the round still collects.

        Whether it wins (accept) or loses (release), the scheduler will call it; dialling
        now takes its two TLS handshakes off the accept's path.
        """
        if self._workers.dialled(worker_id):
            return
        self._spawn(self._workers.warm(worker_id), f"channel to {worker_id}")

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
        terms = LeaseTerms(
            price=price or PriceRange(self.section.bid, self.section.max_price),
            policy=policy if policy is not None and not isinstance(policy, str) else self.policy(policy),
            replace_lost=replace_lost,
            tag=tag,
        )
        window_s = window_s or self.section.offer_window_s
        deadline = self._clock() + (timeout_s or self.section.allocate_timeout_s)
        won: list[HeldLease] = []
        widen = 1.0
        earlier: frozenset[str] = frozenset()
        while len(won) < count and self._clock() < deadline and not self._stopping:
            skip = frozenset(exclude) | {lease.worker_id for lease in won}
            need = count - len(won)
            probability = min(1.0, widen * self.offer_probability(need, skip))
            request_id = uuid.uuid4().hex
            got, answered = await self._round(
                requirement, need, terms, window_s, deadline, skip, probability, request_id, earlier
            )
            won.extend(got)
            earlier |= {request_id}
            # Too few answered, the previous round's late offers included: ask more workers.
            if answered < need and len(earlier) > 1:
                widen *= WIDEN
        self.stats["allocations"] += 1
        if len(won) < count:
            self.stats["allocations_short"] += 1
            log.info("allocation got %d of %d workers for %s", len(won), count, requirement)
        return won

    async def _round(
        self,
        requirement: Requirements,
        count: int,
        terms: LeaseTerms,
        window_s: float,
        deadline: float,
        exclude: frozenset[str],
        probability: float,
        request_id: str,
        earlier: frozenset[str],
    ) -> tuple[list[HeldLease], int]:
        """The leases won, and how many workers answered (late ones included)."""
        assert self.link is not None
        ad = AdvertisementView(
            request_id=request_id,
            scheduler_id=self.peer_id,
            requirements=requirement,
            bid=terms.price.bid,
            deadline=deadline,
            count=count,
            scheduler_addresses=tuple(self.addresses()),
            offer_probability=probability,
        )
        allocation, choice = await self._rounds.collect(
            self.link, ad, terms.price, terms.policy, window_s, exclude, earlier
        )
        # Accept first: the losers' releases (each maybe a new channel) would only compete
        # with the accepts for the loop, and their reservations lapse on their own anyway.
        accepted = await asyncio.gather(*(self._accept(offer, allocation, terms) for offer in choice.winners))
        for loser in choice.losers:
            self._spawn(self._release_offer(loser), f"release offer {loser.offer_id}")
        return [lease for lease in accepted if lease is not None], len(allocation.answered)

    def offer_probability(self, count: int, exclude: Collection[str] = ()) -> float:
        """The share of the pool an advertisement for ``count`` workers asks to answer.

        The pool is the workers this scheduler has heard from, less those it
        excludes or already holds a lease on (they are the likeliest to be
        busy): an underestimate only asks more workers than needed. A worker it
        has never heard from still answers with the same probability.
        """
        held = self.book.count_by_worker()
        known = self._workers.known_ids()
        pool = sum(1 for worker in known if worker not in exclude and worker not in held)
        return sampled_share(self.section.offer_sampling, count, pool)

    async def _accept(self, offer: OfferView, allocation: Allocation, terms: LeaseTerms) -> HeldLease | None:
        sent_at = self._clock()
        try:
            stub = await self._workers.stub(offer.worker_id)
            lease = await stub.AcceptOffer(
                worker_pb2.AcceptOfferRequest(offer_id=offer.offer_id, lease_ttl_s=self.section.lease_ttl_s),
                timeout=self.section.rpc_timeout_s,
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            self.stats["accepts_failed"] += 1
            log.info("accepting offer %s of %s failed: %s", offer.offer_id, offer.worker_id, describe(err))
            await self._workers.invalidate(offer.worker_id, err)
            return None
        expires_at = to_seconds(lease.expires_at)
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
        self._keeper.hold(held, terms)
        self.stats["accepted"] += 1
        if self._stopping:  # stop() may already have released what it knew of
            self._spawn(self.release(held.lease_id), f"release {held.lease_id}")
        return held

    async def _release_offer(self, offer: OfferView) -> None:
        try:
            stub = await self._workers.stub(offer.worker_id)
            await stub.ReleaseOffer(
                worker_pb2.ReleaseOfferRequest(offer_id=offer.offer_id), timeout=self.section.rpc_timeout_s
            )
            self.stats["offers_released"] += 1
        except (grpc.aio.AioRpcError, HyphaError) as err:
            # The worker's temporary lease lapses on its own; this only frees it sooner.
            log.debug("releasing offer %s failed: %s", offer.offer_id, describe(err))

    # ---- releasing ---------------------------------------------------------------

    def leave(self, lease_ids: Iterable[str]) -> None:
        """Stop keeping these leases without releasing them (``RunRegistry._leave_running``): no
        renewal, and ``stop`` does not release them; they run out on their workers."""
        for lease_id in lease_ids:
            self._keeper.drop(lease_id)

    def watch(self, lease_id: str) -> None:
        """Notice this lease's loss within ``watch_lost_s`` (``lease_keeper``)."""
        self._keeper.watch(lease_id)

    async def release(self, lease_id: str) -> bool:
        """Give a held lease back; False if it was not held (or the worker could not be told)."""
        held = self._keeper.drop(lease_id)
        if held is None:
            return False
        try:
            stub = await self._workers.stub(held.worker_id)
            await stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=self.section.rpc_timeout_s
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            # The lease lapses on the worker within its ttl anyway.
            log.info("releasing lease %s on %s failed: %s", lease_id, held.worker_id, describe(err))
            return False
        self.stats["released"] += 1
        return True

    async def adopt(
        self, lease: HeldLease, addresses: Collection[str] = (), capacity: Resources | None = None
    ) -> HeldLease | None:
        """Take back a lease a previous process of this scheduler held (same identity, so the
        worker honours it): renewed now and held from then on; None when the worker no longer
        has it (it expired while nobody renewed it) or cannot be reached.

        NOTE: a worker that cannot be reached yet (this process's gateway link or the relay
        still coming up) is tried again, with backoff, for ``adopt_patience_s`` while the lease
        may still be live there: giving up at once would lease the part again elsewhere while
        it still runs there. An answer that the lease is gone (``GONE``) ends it at once.
        """
        self._workers.learn(lease.worker_id, addresses, capacity)
        deadline = self._clock() + self.section.adopt_patience_s
        pause = Backoff(0.2, 2.0)
        ask = worker_pb2.RenewLeaseRequest(lease_id=lease.lease_id, lease_ttl_s=self.section.lease_ttl_s)
        while True:
            try:
                stub = await self._workers.stub(lease.worker_id)
                renewed = await stub.RenewLease(ask, timeout=self.section.rpc_timeout_s)
                break
            except (grpc.aio.AioRpcError, HyphaError) as err:
                code = err.code() if isinstance(err, grpc.aio.AioRpcError) else err.status
                await self._workers.invalidate(lease.worker_id, err)
                if code in GONE or self._clock() >= deadline:
                    why = describe(err)
                    log.info("lease %s on %s not taken back: %s", lease.lease_id, lease.worker_id, why)
                    return None
                self.stats["adopt_retries"] += 1
                await asyncio.sleep(min(pause.next_delay(), max(0.0, deadline - self._clock())))
        held = replace(lease, expires_at=to_seconds(renewed.expires_at), ttl_s=self.section.lease_ttl_s)
        self._keeper.take_back(held)
        self.stats["adopted"] += 1
        return held

    async def release_all(self) -> None:
        await asyncio.gather(*(self.release(lease.lease_id) for lease in self.book.leases()))

    # ---- loss and replacement ------------------------------------------------------

    def _lost(self, held: HeldLease, terms: LeaseTerms | None, reason: str) -> None:
        """The keeper found ``held`` lost: tell the listeners, replace it if its allocation asked."""
        self._emit(LeaseEvent(LeaseEventKind.LOST, held, reason))
        if terms is not None and terms.replace_lost and not self._stopping:
            self._spawn(self._replace(held, terms), f"replace {held.lease_id}")

    async def _replace(self, lost: HeldLease, terms: LeaseTerms) -> None:
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

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._background.spawn(coro, name)
