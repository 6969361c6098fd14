"""The scheduler's held leases kept alive: renewed at 2/3 of their life, or found lost.

Held leases live in a ``LeaseBook``. A renewal loop renews each at 2/3 of its
life; a renewal the worker refuses (the lease is gone) or one that keeps
failing until the lease is overdue makes the lease *lost*: it leaves the book
and the market is told (it emits a ``LeaseEvent`` and, when the lease's
allocation asked for it, advertises for a replacement).

A *watched* lease (``watch``: a DiLoCo job's parameter server, whose loss
stalls every trainer of the job, and its trainers, whose loss holds up a
round until the server is told) is renewed every ``watch_interval_s`` and is
lost once its worker has not answered for ``watch_lost_s``, without waiting
for the lease to run out (up to ``lease_ttl_s`` after the last renewal).
Giving up on it early is safe: the worker's own copy of the lease still
expires at its TTL, and a part on it that comes back meanwhile talks to
nobody (its job's parts were re-pointed; its reports name a replaced attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import grpc

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease, LeaseBook
from hypha.market.policies import SelectionPolicy
from hypha.market.pricing import PriceRange
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.market_workers import MarketWorkers
from hypha.scheduler.worker_calls import describe
from hypha.timestamps import to_seconds, to_timestamp
from hypha.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

#: Renewal refusals that mean the worker no longer has the lease (retrying cannot help).
GONE = frozenset(
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
class LeaseTerms:
    """How an allocation buys, kept with each of its leases for a replacement."""

    price: PriceRange
    policy: SelectionPolicy
    replace_lost: bool
    tag: str


#: Told of each lost lease, with its allocation's terms (None for an adopted lease) and why.
OnLost = Callable[[HeldLease, LeaseTerms | None, str], None]
Spawn = Callable[[Coroutine[Any, Any, Any], str], None]


class LeaseKeeper:
    """The book of held leases, each with its terms, and the loop that renews them."""

    def __init__(
        self,
        book: LeaseBook,
        workers: MarketWorkers,
        section: SchedulerSection,
        stats: Counter[str],
        clock: Callable[[], float],
        spawn: Spawn,
        on_lost: OnLost,
    ) -> None:
        self.book = book
        self.workers = workers
        self.section = section
        self.stats = stats
        self._clock = clock
        self._spawn = spawn
        self._on_lost = on_lost
        self._terms: dict[str, LeaseTerms] = {}
        self._renewing: set[str] = set()
        #: Watched lease -> when its worker last answered (``watch``).
        self._watched: dict[str, float] = {}
        self._wake = asyncio.Event()

    def hold(self, held: HeldLease, terms: LeaseTerms) -> None:
        """Keep a lease just accepted, renewed from now on."""
        self.book.add(held)
        self._terms[held.lease_id] = terms
        self._wake.set()

    def take_back(self, held: HeldLease) -> None:
        """Keep a lease adopted from a previous process (no terms: it is not replaced when lost)."""
        if held.lease_id not in self.book:
            self.book.add(held)
        self._wake.set()

    def watch(self, lease_id: str) -> None:
        """Notice the loss of this held lease within ``watch_lost_s`` (the module's docstring)."""
        if lease_id in self.book and lease_id not in self._watched:
            self._watched[lease_id] = self._clock()
            self._wake.set()

    def drop(self, lease_id: str) -> HeldLease | None:
        """Stop keeping a lease (it is being released); None if it was not held."""
        held = self.book.release(lease_id)
        self._terms.pop(lease_id, None)
        self._watched.pop(lease_id, None)
        return held

    def _renew_at(self, lease: HeldLease) -> float:
        answered = self._watched.get(lease.lease_id)
        if answered is None:
            return lease.renew_at()
        return min(lease.renew_at(), answered + self.section.watch_interval_s)

    def _lost_at(self, lease: HeldLease) -> tuple[float, str]:
        """When the lease counts as lost if no renewal gets through, and why."""
        answered = self._watched.get(lease.lease_id)
        silent_until = math.inf if answered is None else answered + self.section.watch_lost_s
        if silent_until < lease.expires_at:
            return silent_until, f"its worker did not answer for {self.section.watch_lost_s:g} s"
        return lease.expires_at, "not renewed before it expired"

    async def run(self) -> None:
        """Renew every lease when it is due, forever (the market cancels it on stop)."""
        while True:
            now = self._clock()
            for lease in self.book.leases():
                if now >= self._renew_at(lease) and lease.lease_id not in self._renewing:
                    self._renewing.add(lease.lease_id)
                    self._spawn(self._renew(lease), f"renew {lease.lease_id}")
            waiting = [
                self._renew_at(lease) for lease in self.book.leases() if lease.lease_id not in self._renewing
            ]
            timeout = None if not waiting else max(0.0, min(waiting) - now)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _renew(self, lease: HeldLease) -> None:
        """Renew until the worker agrees, refuses, or the lease is overdue."""
        retry_s = min(1.0, max(0.05, lease.ttl_s / 20))
        if lease.lease_id in self._watched:
            retry_s = min(retry_s, self.section.watch_interval_s / 4)
        try:
            while lease.lease_id in self.book:
                lost_at, why = self._lost_at(lease)
                left = lost_at - self._clock()
                if left <= 0:
                    self._lose(lease, why)
                    return
                try:
                    # The whole attempt is bounded, finding the path included (a dial or the
                    # relay may wait on a gateway that is gone): the loss is declared on time.
                    async with asyncio.timeout(left):
                        stub = await self.workers.stub(lease.worker_id)
                        renewed = await stub.RenewLease(
                            worker_pb2.RenewLeaseRequest(
                                lease_id=lease.lease_id, lease_ttl_s=self.section.lease_ttl_s
                            ),
                            timeout=min(self.section.rpc_timeout_s, left),
                        )
                except TimeoutError:
                    self.stats["renewals_failed"] += 1
                    log.info(
                        "renewing lease %s on %s: no answer in %.1f s", lease.lease_id, lease.worker_id, left
                    )
                    continue
                except (grpc.aio.AioRpcError, HyphaError) as err:
                    code = err.code() if isinstance(err, grpc.aio.AioRpcError) else err.status
                    if code in GONE:
                        self._lose(lease, f"renewal refused: {describe(err)}")
                        return
                    self.stats["renewals_failed"] += 1
                    await self.workers.invalidate(lease.worker_id, err)
                    await asyncio.sleep(min(retry_s, max(0.0, lost_at - self._clock())))
                    continue
                if lease.lease_id in self.book:
                    lease = self.book.renewed(lease.lease_id, to_seconds(renewed.expires_at))
                    if lease.lease_id in self._watched:
                        self._watched[lease.lease_id] = self._clock()
                    self.stats["renewed"] += 1
                return
        finally:
            self._renewing.discard(lease.lease_id)
            self._wake.set()

    def _lose(self, lease: HeldLease, reason: str) -> None:
        self._watched.pop(lease.lease_id, None)
        held = self.book.mark_lost(lease.lease_id)
        terms = self._terms.pop(lease.lease_id, None)
        if held is None:
            return
        self.stats["lost"] += 1
        log.warning("lost lease %s on worker %s: %s", held.lease_id, held.worker_id, reason)
        self._on_lost(held, terms, reason)


def held_lease_to_proto(lease: HeldLease, scheduler_id: str) -> common_pb2.Lease:
    return common_pb2.Lease(
        lease_id=lease.lease_id,
        scheduler_id=scheduler_id,
        worker_id=lease.worker_id,
        resources=lease.resources.to_proto(),
        price=lease.price,
        expires_at=to_timestamp(lease.expires_at),
        state=common_pb2.LEASE_STATE_ACTIVE,
        executor=lease.requirement.executor.to_proto(),
    )
