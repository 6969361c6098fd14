"""The scheduler's side of the market: collect offers for one request, choose,
and keep the leases it won alive.

An ``Allocation`` is one advertisement's life: offers come in until there are
enough or the window closes, then the selection policy picks winners. Every
offer the allocation kept ends up in exactly one of winners or losers, so the
caller accepts the first and releases the second (workers free their
reservations at once instead of waiting for the temporary lease to lapse);
every offer ``offer()`` refused is the caller's to release right away.

A ``LeaseBook`` holds the leases the scheduler won, says when each is due for
renewal, and turns a lost lease into the requirement to advertise again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum

from hypha.errors import AlreadyExistsError, IllegalTransitionError, InvalidArgumentError, NotFoundError
from hypha.market.policies import OfferView, SelectionPolicy, get_policy
from hypha.market.pricing import DEFAULT_WEIGHTS, PriceRange, Weights, score
from hypha.market.resources import Requirements, Resources


def renew_at(lease_expires_at: float, ttl_s: float) -> float:
    """When to renew a lease of ``ttl_s``: at two thirds of its life, so one lost
    renewal still leaves a third of the lease to retry in."""
    return lease_expires_at - ttl_s / 3.0


class AllocationState(StrEnum):
    COLLECTING = "collecting"  # offers are accepted
    CHOSEN = "chosen"  # winners and losers have been handed out (terminal)


TRANSITIONS: dict[AllocationState, frozenset[AllocationState]] = {
    AllocationState.COLLECTING: frozenset({AllocationState.CHOSEN}),
    AllocationState.CHOSEN: frozenset(),
}


class OfferDropReason(StrEnum):
    """Why ``Allocation.offer`` refused an offer (keys of ``Allocation.dropped``)."""

    PRICE = "price"  # above the scheduler's private max
    LATE = "late"  # after the window closed or the choice was made
    EXPIRED = "expired"  # the worker's reservation has already lapsed
    REQUEST = "request"  # answers a different request
    EXECUTOR = "executor"  # for another executor kind
    RESOURCES = "resources"  # less than the required minimum
    DUPLICATE = "duplicate"  # the same worker offered something better


@dataclass(frozen=True)
class Choice:
    winners: list[OfferView]
    losers: list[OfferView]
    missing: int  #: how many more workers the request still needs


class Allocation:
    """Collects and chooses the offers for one advertisement."""

    def __init__(
        self,
        request_id: str,
        requirement: Requirements,
        count: int,
        price: PriceRange,
        window_ends_at: float,
        policy: SelectionPolicy | None = None,
        weights: Weights = DEFAULT_WEIGHTS,
        earlier: frozenset[str] = frozenset(),
    ) -> None:
        if count < 1:
            raise InvalidArgumentError(f"an allocation needs at least one worker, got {count}")
        self.request_id = request_id
        #: Request ids of earlier rounds for the same need: an offer that answers one of
        #: them late is as good as one for this round (same scheduler, same requirement).
        self.earlier = earlier
        self.requirement = requirement
        self.count = count
        self.price = price
        self.window_ends_at = window_ends_at
        self.policy = policy or get_policy()
        self.weights = weights
        self.state = AllocationState.COLLECTING
        self.dropped: Counter[str] = Counter()
        #: Distinct workers that offered something this request could use, even if too late:
        #: when that is fewer than ``count`` the market itself was short, not the timing.
        self.answered: set[str] = set()
        self._best: dict[str, OfferView] = {}  # worker id -> its best offer so far
        self._superseded: list[OfferView] = []

    def _transition(self, target: AllocationState) -> None:
        if target not in TRANSITIONS[self.state]:
            raise IllegalTransitionError("allocation", self.state.value, target.value)
        self.state = target

    def candidates(self) -> list[OfferView]:
        return list(self._best.values())

    def offer(self, view: OfferView, now: float) -> bool:
        """Consider one offer. False means refused (counted in ``dropped``): the
        caller should release it. True means the allocation owns it until
        ``choose`` hands it back as a winner or a loser."""
        reason = self._refuse_reason(view, now)
        if reason in (None, OfferDropReason.LATE, OfferDropReason.EXPIRED):
            self.answered.add(view.worker_id)
        if reason is not None:
            self.dropped[reason] += 1
            return False
        current = self._best.get(view.worker_id)
        if current is not None:
            if current.offer_id == view.offer_id:
                return True  # a redelivery of the offer already kept: still ours, not to release
            self.dropped[OfferDropReason.DUPLICATE] += 1
            if not self._better(view, current):
                return False
            self._superseded.append(current)
        self._best[view.worker_id] = view
        return True

    def _refuse_reason(self, view: OfferView, now: float) -> OfferDropReason | None:
        if self.state is not AllocationState.COLLECTING or now > self.window_ends_at:
            return OfferDropReason.LATE
        if view.request_id and view.request_id != self.request_id and view.request_id not in self.earlier:
            return OfferDropReason.REQUEST
        if view.executor is not None and view.executor is not self.requirement.executor:
            return OfferDropReason.EXECUTOR
        if view.expires_at <= now:
            return OfferDropReason.EXPIRED
        if view.price > self.price.max:
            return OfferDropReason.PRICE
        if not self.requirement.minimum.fits_in(view.resources):
            return OfferDropReason.RESOURCES
        return None

    def _better(self, a: OfferView, b: OfferView) -> bool:
        return score(a.price, a.resources, self.weights) < score(b.price, b.resources, self.weights)

    def complete(self, now: float) -> bool:
        """Enough distinct workers offered, or the window is over."""
        return len(self._best) >= self.count or now >= self.window_ends_at

    def choose(self, now: float | None = None) -> Choice:
        """Pick the winners with the policy; everything else kept is a loser.

        With ``now``, offers whose reservation has already lapsed cannot win.
        """
        self._transition(AllocationState.CHOSEN)
        offers = list(self._best.values())
        live = [o for o in offers if now is None or o.expires_at > now]
        winners = self.policy.select(live, self.count, self.requirement.minimum)
        won = {o.offer_id for o in winners}
        losers = [o for o in offers if o.offer_id not in won] + self._superseded
        self._best.clear()
        self._superseded = []
        return Choice(winners=winners, losers=losers, missing=max(0, self.count - len(winners)))


@dataclass(frozen=True)
class HeldLease:
    """A lease the scheduler won, with what it needs to renew or replace it."""

    lease_id: str
    worker_id: str
    request_id: str
    requirement: Requirements
    resources: Resources
    price: float
    expires_at: float
    ttl_s: float
    job_id: str = ""

    def renew_at(self) -> float:
        return renew_at(self.expires_at, self.ttl_s)


class LeaseBook:
    """The leases one scheduler holds. Synchronous; the caller serialises access."""

    def __init__(self) -> None:
        self._leases: dict[str, HeldLease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def add(self, lease: HeldLease) -> None:
        if lease.lease_id in self._leases:
            raise AlreadyExistsError(f"lease {lease.lease_id!r} is already held")
        self._leases[lease.lease_id] = lease

    def get(self, lease_id: str) -> HeldLease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFoundError(f"no held lease {lease_id!r}")
        return lease

    def leases(self) -> list[HeldLease]:
        return list(self._leases.values())

    def renewed(self, lease_id: str, expires_at: float) -> HeldLease:
        """Record the new expiry the worker granted."""
        lease = replace(self.get(lease_id), expires_at=expires_at)
        self._leases[lease_id] = lease
        return lease

    def due_for_renewal(self, now: float) -> list[HeldLease]:
        """Leases past two thirds of their life, soonest expiry first."""
        due = [lease for lease in self._leases.values() if now >= lease.renew_at()]
        return sorted(due, key=lambda lease: (lease.expires_at, lease.lease_id))

    def overdue(self, now: float) -> list[HeldLease]:
        """Leases whose expiry has passed: the worker has (or will have) dropped them."""
        return [lease for lease in self._leases.values() if now >= lease.expires_at]

    def next_renewal(self) -> float | None:
        return min((lease.renew_at() for lease in self._leases.values()), default=None)

    def mark_lost(self, lease_id: str) -> HeldLease | None:
        """Forget a lease the worker no longer honours and return it, so the caller
        advertises its requirement again. None if it was already gone, so one
        loss reported twice is replaced once."""
        return self._leases.pop(lease_id, None)

    def release(self, lease_id: str) -> HeldLease | None:
        """Forget a lease the scheduler gave back on purpose (nothing to replace)."""
        return self._leases.pop(lease_id, None)

    def count_by_worker(self) -> dict[str, int]:
        """Held leases per worker, for the balanced policy's ``in_use``."""
        return dict(Counter(lease.worker_id for lease in self._leases.values()))
