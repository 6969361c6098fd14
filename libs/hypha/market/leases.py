"""The worker's lease ledger: who holds which part of its resource pool, until when.

The ledger knows nothing about what it leases (jobs, GPUs, processes): it only
guarantees that the resources of live leases plus the free pool always equal
the capacity, so nothing is ever promised twice. A lease starts *temporary*
(backing an offer for a fraction of a second), becomes *active* when the
scheduler accepts it, is renewed while the scheduler keeps paying attention,
and ends exactly once: *released* by its holder or *expired* by the pruner.

NOTE: time is wall-clock seconds passed in by the caller, as in Rust Hypha's
leases crate: an expiry instant must mean the same thing on the worker and on
the scheduler, which a process-local monotonic clock cannot give. Renewal means
"now plus the duration", never "old expiry plus the duration".
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from hypha.market.resources import ExecutorKind, Resources
from hypha.timestamps import to_timestamp
from hypha.v1 import common_pb2


class LeaseState(StrEnum):
    TEMPORARY = "temporary"  # reserved behind an offer; short-lived, not yet accepted
    ACTIVE = "active"  # accepted by its holder; renewed to stay alive
    RELEASED = "released"  # given back by its holder (terminal)
    EXPIRED = "expired"  # not renewed or accepted in time (terminal)

    def to_proto(self) -> common_pb2.LeaseState:
        return _STATE_TO_PROTO[self]


_STATE_TO_PROTO: dict[LeaseState, common_pb2.LeaseState] = {
    LeaseState.TEMPORARY: common_pb2.LEASE_STATE_TEMPORARY,
    LeaseState.ACTIVE: common_pb2.LEASE_STATE_ACTIVE,
    LeaseState.RELEASED: common_pb2.LEASE_STATE_RELEASED,
    LeaseState.EXPIRED: common_pb2.LEASE_STATE_EXPIRED,
}

#: The allowed moves. ACTIVE -> ACTIVE is a renewal. Terminal states have no
#: way out, which is what makes "resources return exactly once" hold.
TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.TEMPORARY: frozenset({LeaseState.ACTIVE, LeaseState.RELEASED, LeaseState.EXPIRED}),
    LeaseState.ACTIVE: frozenset({LeaseState.ACTIVE, LeaseState.RELEASED, LeaseState.EXPIRED}),
    LeaseState.RELEASED: frozenset(),
    LeaseState.EXPIRED: frozenset(),
}

LIVE_STATES = frozenset({LeaseState.TEMPORARY, LeaseState.ACTIVE})


def transition(current: LeaseState, target: LeaseState) -> LeaseState:
    """Return ``target`` if the table allows the move, else raise ``IllegalTransitionError``."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransitionError("lease", current.value, target.value)
    return target


@dataclass(frozen=True)
class Lease:
    """One snapshot of a lease. The ledger replaces it on every change, so a
    caller holding an old snapshot never sees it mutate underneath."""

    lease_id: str
    holder: str  #: peer id of the scheduler that holds (or was offered) it
    resources: Resources
    price: float
    expires_at: float  #: wall-clock seconds
    state: LeaseState = LeaseState.TEMPORARY
    executor: ExecutorKind | None = None
    offer_id: str = ""
    request_id: str = ""
    created_at: float = 0.0
    ended_at: float | None = None  #: when it was released or expired

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES

    def is_overdue(self, now: float) -> bool:
        return now >= self.expires_at

    def to_proto(self, worker_id: str = "") -> common_pb2.Lease:
        msg = common_pb2.Lease(
            lease_id=self.lease_id,
            scheduler_id=self.holder,
            worker_id=worker_id,
            resources=self.resources.to_proto(),
            price=self.price,
            expires_at=to_timestamp(self.expires_at),
            state=self.state.to_proto(),
        )
        if self.executor is not None:
            msg.executor = self.executor.to_proto()
        return msg


def _require_ttl(ttl_s: float) -> float:
    if not math.isfinite(ttl_s) or ttl_s <= 0.0:
        raise InvalidArgumentError(f"lease ttl must be a positive number of seconds, got {ttl_s!r}")
    return ttl_s


class LeaseLedger:
    """A worker's resource pool and the leases carved out of it.

    Synchronous and single-writer: the caller serialises access (one asyncio
    task, or a lock). Every change is one check-and-replace of the lease record,
    never a read in one call and a write in another.
    """

    def __init__(
        self,
        capacity: Resources,
        *,
        max_ttl_s: float | None = None,
        max_live: int = 10_000,
        history_size: int = 1_000,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        """``max_ttl_s`` caps what a holder may ask for on accept/renew;
        ``max_live`` bounds the number of live leases (each costs memory even when
        it holds nothing); ``history_size`` is how many ended leases are kept so
        that a late call gets a precise answer before it gets NOT_FOUND."""
        self.capacity = capacity.require_non_negative("capacity")
        self._max_ttl_s = max_ttl_s
        self._max_live = max_live
        self._history_size = history_size
        self._new_id = new_id or (lambda: uuid.uuid4().hex)
        self._live: dict[str, Lease] = {}
        self._ended: OrderedDict[str, Lease] = OrderedDict()
        self._used = Resources()

    # ---- queries -----------------------------------------------------------

    def free(self) -> Resources:
        """What can still be reserved. Overdue leases that nobody pruned yet still
        count as held: their jobs may still be running until ``expire_due``."""
        return self.capacity - self._used

    def used(self) -> Resources:
        return self._used

    def find(self, lease_id: str) -> Lease | None:
        return self._live.get(lease_id) or self._ended.get(lease_id)

    def get(self, lease_id: str) -> Lease:
        lease = self.find(lease_id)
        if lease is None:
            raise NotFoundError(f"unknown lease {lease_id!r}")
        return lease

    def live(self) -> list[Lease]:
        """Temporary and active leases."""
        return list(self._live.values())

    def active(self) -> list[Lease]:
        return [lease for lease in self._live.values() if lease.state is LeaseState.ACTIVE]

    def history(self) -> list[Lease]:
        """Recently ended leases, oldest first (bounded by ``history_size``)."""
        return list(self._ended.values())

    def next_expiry(self) -> float | None:
        """The earliest expiry among live leases, for a pruner that sleeps until then."""
        return min((lease.expires_at for lease in self._live.values()), default=None)

    # ---- changes -----------------------------------------------------------

    def reserve(
        self,
        holder: str,
        resources: Resources,
        ttl_s: float,
        now: float,
        *,
        price: float = 0.0,
        executor: ExecutorKind | None = None,
        offer_id: str = "",
        request_id: str = "",
        lease_id: str | None = None,
    ) -> Lease:
        """Take ``resources`` out of the free pool under a temporary lease."""
        _require_ttl(ttl_s)
        resources.require_non_negative("reservation")
        if not holder:
            raise InvalidArgumentError("a lease needs a holder")
        if not resources.fits_in(self.free()):
            raise ResourceExhaustedError(f"reservation {resources} does not fit the free pool {self.free()}")
        if len(self._live) >= self._max_live:
            raise ResourceExhaustedError(f"too many live leases ({self._max_live})")
        lease_id = lease_id or self._new_id()
        if lease_id in self._live or lease_id in self._ended:
            raise AlreadyExistsError(f"lease {lease_id!r} already exists")
        lease = Lease(
            lease_id=lease_id,
            holder=holder,
            resources=resources,
            price=price,
            expires_at=now + ttl_s,
            executor=executor,
            offer_id=offer_id or lease_id,
            request_id=request_id,
            created_at=now,
        )
        self._live[lease_id] = lease
        self._used = self._used + resources
        return lease

    def activate(self, lease_id: str, holder: str, ttl_s: float, now: float) -> Lease:
        """Turn the temporary lease behind an accepted offer into a renewable one.

        NOTE: activating a lease that is already active (a retried accept whose
        answer was lost) renews it instead of failing, so the retry gets the lease.
        """
        lease = self._held_by(lease_id, holder)
        ttl_s = self._cap(_require_ttl(ttl_s))
        if lease.state is LeaseState.ACTIVE:
            return self.renew(lease_id, holder, ttl_s, now)
        transition(lease.state, LeaseState.ACTIVE)
        if lease.is_overdue(now):
            raise FailedPreconditionError(f"offer {lease_id!r} expired before it was accepted")
        return self._put(replace(lease, state=LeaseState.ACTIVE, expires_at=now + ttl_s))

    def renew(self, lease_id: str, holder: str, ttl_s: float, now: float) -> Lease:
        """Extend an active lease to ``now + ttl_s``.

        An overdue lease is not revived even if the pruner has not run yet: its
        job is about to be cancelled, and a late renewal must not race with that.
        """
        lease = self._held_by(lease_id, holder)
        ttl_s = self._cap(_require_ttl(ttl_s))
        if lease.state is LeaseState.TEMPORARY:
            raise FailedPreconditionError(f"lease {lease_id!r} was never accepted; accept it first")
        transition(lease.state, LeaseState.ACTIVE)
        if lease.is_overdue(now):
            raise FailedPreconditionError(f"lease {lease_id!r} expired at {lease.expires_at}")
        return self._put(replace(lease, expires_at=now + ttl_s))

    def release(self, lease_id: str, holder: str, now: float) -> Lease:
        """Give a live lease back; its resources return to the pool now."""
        lease = self._held_by(lease_id, holder)
        transition(lease.state, LeaseState.RELEASED)
        return self._end(lease, LeaseState.RELEASED, now)

    def expire_due(self, now: float) -> list[Lease]:
        """End every live lease whose time is up and return them, so the caller
        can cancel whatever ran under them."""
        due = [lease for lease in self._live.values() if lease.is_overdue(now)]
        return [self._end(lease, LeaseState.EXPIRED, now) for lease in due]

    # ---- internals ---------------------------------------------------------

    def _held_by(self, lease_id: str, holder: str) -> Lease:
        lease = self.get(lease_id)
        if lease.holder != holder:
            raise PermissionDeniedError(f"lease {lease_id!r} is held by another peer")
        return lease

    def _cap(self, ttl_s: float) -> float:
        return ttl_s if self._max_ttl_s is None else min(ttl_s, self._max_ttl_s)

    def _put(self, lease: Lease) -> Lease:
        self._live[lease.lease_id] = lease
        return lease

    def _end(self, lease: Lease, state: LeaseState, now: float) -> Lease:
        # The one place resources go back to the pool. Only live leases reach it
        # (callers checked the transition), and the record leaves _live here, so
        # a second end of the same lease cannot return them twice.
        transition(lease.state, state)
        del self._live[lease.lease_id]
        self._used = self._used - lease.resources
        ended = replace(lease, state=state, ended_at=now)
        self._ended[lease.lease_id] = ended
        while len(self._ended) > self._history_size:
            self._ended.popitem(last=False)
        return ended
