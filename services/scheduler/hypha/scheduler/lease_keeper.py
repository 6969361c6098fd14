"""The scheduler's held leases kept alive: renewed at 2/3 of their life, or found lost.

Held leases live in a ``LeaseBook``. A renewal loop renews each at 2/3 of its
life; a renewal the worker refuses (the lease is gone) or one that keeps
failing until the lease is overdue makes the lease *lost*: it leaves the book
and the market is told (it emits a ``LeaseEvent`` and, when the lease's
allocation asked for it, advertises for a replacement).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

    def drop(self, lease_id: str) -> HeldLease | None:
        """Stop keeping a lease (it is being released); None if it was not held."""
        held = self.book.release(lease_id)
        self._terms.pop(lease_id, None)
        return held

    async def run(self) -> None:
        """Renew every lease when it is due, forever (the market cancels it on stop)."""
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
                    stub = await self.workers.stub(lease.worker_id)
                    renewed = await stub.RenewLease(
                        worker_pb2.RenewLeaseRequest(
                            lease_id=lease.lease_id, lease_ttl_s=self.section.lease_ttl_s
                        ),
                        timeout=min(self.section.rpc_timeout_s, left),
                    )
                except (grpc.aio.AioRpcError, HyphaError) as err:
                    code = err.code() if isinstance(err, grpc.aio.AioRpcError) else err.status
                    if code in GONE:
                        self._lose(lease, f"renewal refused: {describe(err)}")
                        return
                    self.stats["renewals_failed"] += 1
                    await self.workers.invalidate(lease.worker_id, err)
                    await asyncio.sleep(min(retry_s, max(0.0, lease.expires_at - self._clock())))
                    continue
                if lease.lease_id in self.book:
                    self.book.renewed(lease.lease_id, to_seconds(renewed.expires_at))
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
