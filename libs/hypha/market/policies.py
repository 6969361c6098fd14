"""Selection policies: which of the offers a scheduler collected it accepts.

A policy only ranks. The allocator has already dropped offers above the
scheduler's max; a policy then keeps offers that meet the requirement, takes at
most one offer per worker (a worker's best by the policy's own order) and
returns up to ``count`` of them, best first. Ties always end in worker id and
offer id so that a choice is reproducible.

Stateful policies (round-robin, balanced) keep their state in the object, so
each scheduler (or job) gets its own instance from ``get_policy``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hypha.errors import InvalidArgumentError
from hypha.market.pricing import DEFAULT_WEIGHTS, Weights, capacity_units, score
from hypha.market.resources import ExecutorKind, Resources
from hypha.timestamps import to_seconds
from hypha.v1 import common_pb2


@dataclass(frozen=True)
class OfferView:
    """An offer as a scheduler sees it, with what the worker told about itself."""

    offer_id: str
    worker_id: str
    price: float
    resources: Resources  #: what is offered
    capacity: Resources = field(default_factory=Resources)  #: the worker's whole machine (zero if not told)
    active_leases: int = 0
    samples_per_second: float = 0.0
    success_rate: float = 0.0
    expires_at: float = math.inf
    request_id: str = ""
    executor: ExecutorKind | None = None
    worker_addresses: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, msg: common_pb2.Offer, worker_id: str) -> OfferView:
        """``worker_id`` comes from the TLS session, never from the message."""
        if not msg.offer_id:
            raise InvalidArgumentError("offer without an offer id")
        if not math.isfinite(msg.price) or msg.price < 0.0:
            raise InvalidArgumentError(f"offer price {msg.price} is not a non-negative number")
        return cls(
            offer_id=msg.offer_id,
            worker_id=worker_id,
            price=msg.price,
            resources=Resources.from_proto(msg.resources),
            capacity=Resources.from_proto(msg.capacity),
            active_leases=msg.active_leases,
            samples_per_second=max(0.0, msg.samples_per_second)
            if math.isfinite(msg.samples_per_second)
            else 0.0,
            success_rate=min(1.0, max(0.0, msg.success_rate)) if math.isfinite(msg.success_rate) else 0.0,
            expires_at=to_seconds(msg.expires_at) if msg.HasField("expires_at") else math.inf,
            request_id=msg.request_id,
            executor=ExecutorKind.from_proto(msg.executor) if msg.executor else None,
            worker_addresses=tuple(msg.worker_addresses),
        )

    def score(self, weights: Weights = DEFAULT_WEIGHTS) -> float:
        return score(self.price, self.resources, weights)

    def machine(self) -> Resources:
        """The worker's capacity, or what it offered when it did not say."""
        return self.resources if self.capacity.is_zero() else self.capacity


class SelectionPolicy(Protocol):
    name: str

    def select(
        self, offers: Sequence[OfferView], count: int, requirement: Resources | None = None
    ) -> list[OfferView]:
        """Up to ``count`` offers from distinct workers, best first."""
        ...


class _RankingPolicy:
    """A policy that is one sort key: rank, keep each worker's best, take the top."""

    name: str = ""

    def __init__(self, weights: Weights = DEFAULT_WEIGHTS) -> None:
        self.weights = weights

    def key(self, offer: OfferView, requirement: Resources) -> tuple[Any, ...]:
        raise NotImplementedError

    def select(
        self, offers: Sequence[OfferView], count: int, requirement: Resources | None = None
    ) -> list[OfferView]:
        requirement = requirement or Resources()
        ranked = sorted(
            eligible(offers, requirement),
            key=lambda o: (*self.key(o, requirement), o.worker_id, o.offer_id),
        )
        chosen = one_per_worker(ranked)[: max(0, count)]
        self.chosen(chosen)
        return chosen

    def chosen(self, offers: list[OfferView]) -> None:
        """Hook for policies that remember what they picked."""


def eligible(offers: Iterable[OfferView], requirement: Resources) -> list[OfferView]:
    """Offers that give at least the required minimum."""
    return [o for o in offers if requirement.fits_in(o.resources)]


def one_per_worker(ranked: Iterable[OfferView]) -> list[OfferView]:
    """Keep the first (best-ranked) offer of each worker, preserving order."""
    seen: set[str] = set()
    result: list[OfferView] = []
    for offer in ranked:
        if offer.worker_id not in seen:
            seen.add(offer.worker_id)
            result.append(offer)
    return result


class PricePerformancePolicy(_RankingPolicy):
    """Most capacity per token: the lowest price per capacity unit."""

    name = "price-performance"

    def key(self, offer: OfferView, requirement: Resources) -> tuple[Any, ...]:
        return (offer.score(self.weights),)


class LeastLoadedPolicy(_RankingPolicy):
    """The worker with the fewest active leases, then the best price."""

    name = "least-loaded"

    def key(self, offer: OfferView, requirement: Resources) -> tuple[Any, ...]:
        return (offer.active_leases, offer.score(self.weights))


class BestFitPolicy(_RankingPolicy):
    """The smallest machine that fits: least capacity left over beside the job."""

    name = "best-fit"

    def key(self, offer: OfferView, requirement: Resources) -> tuple[Any, ...]:
        waste = capacity_units(offer.machine() - requirement, self.weights)
        return (waste, offer.score(self.weights))

    def select(
        self, offers: Sequence[OfferView], count: int, requirement: Resources | None = None
    ) -> list[OfferView]:
        requirement = requirement or Resources()
        return super().select([o for o in offers if requirement.fits_in(o.machine())], count, requirement)


class PerformanceAwarePolicy(_RankingPolicy):
    """The best recorded throughput times success rate, then the best price.

    Workers with no record rank after every worker with one.
    """

    name = "performance-aware"

    def key(self, offer: OfferView, requirement: Resources) -> tuple[Any, ...]:
        return (-(offer.samples_per_second * offer.success_rate), offer.score(self.weights))


class BalancedPolicy(_RankingPolicy):
    """Spread the load: workers this scheduler uses least first, then workers with
    the lowest leased fraction, then the best price.

    ``in_use`` reports how many leases this scheduler holds per worker (for
    example ``LeaseBook.count_by_worker``); without it the policy counts its own
    past picks. The leased fraction is estimated from the offer as one minus the
    offered share of the machine, which is exact for workers offering their
    whole free pool.
    """

    name = "balanced"

    def __init__(
        self, weights: Weights = DEFAULT_WEIGHTS, in_use: Callable[[], Mapping[str, int]] | None = None
    ) -> None:
        super().__init__(weights)
        self._in_use = in_use
        self._picks: Counter[str] = Counter()
        self._usage: Mapping[str, int] = {}

    def select(
        self, offers: Sequence[OfferView], count: int, requirement: Resources | None = None
    ) -> list[OfferView]:
        self._usage = dict(self._in_use()) if self._in_use is not None else dict(self._picks)
        return super().select(offers, count, requirement)

    def key(self, offer: OfferView, requirement: Resources) -> tuple[Any, ...]:
        return (self._usage.get(offer.worker_id, 0), self.leased_fraction(offer), offer.score(self.weights))

    def leased_fraction(self, offer: OfferView) -> float:
        total = capacity_units(offer.machine(), self.weights)
        if total <= 0.0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - capacity_units(offer.resources, self.weights) / total))

    def chosen(self, offers: list[OfferView]) -> None:
        self._picks.update(o.worker_id for o in offers)


class RoundRobinPolicy(_RankingPolicy):
    """Take workers in worker-id order, starting after the last one picked.

    Remembering the last worker (not a numeric index) keeps the rotation fair
    when workers come and go between calls.
    """

    name = "round-robin"

    def __init__(self, weights: Weights = DEFAULT_WEIGHTS) -> None:
        super().__init__(weights)
        self._last: str | None = None

    def select(
        self, offers: Sequence[OfferView], count: int, requirement: Resources | None = None
    ) -> list[OfferView]:
        requirement = requirement or Resources()
        # Each worker's best offer by price, then the workers in a ring by id.
        best = one_per_worker(
            sorted(
                eligible(offers, requirement), key=lambda o: (o.worker_id, o.score(self.weights), o.offer_id)
            )
        )
        if self._last is not None:
            start = next((i for i, o in enumerate(best) if o.worker_id > self._last), 0)
            best = best[start:] + best[:start]
        chosen = best[: max(0, count)]
        if chosen:
            self._last = chosen[-1].worker_id
        return chosen


_POLICIES: dict[str, Callable[[], SelectionPolicy]] = {
    PricePerformancePolicy.name: PricePerformancePolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    BestFitPolicy.name: BestFitPolicy,
    BalancedPolicy.name: BalancedPolicy,
    PerformanceAwarePolicy.name: PerformanceAwarePolicy,
}

DEFAULT_POLICY = PricePerformancePolicy.name
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def get_policy(name: str = DEFAULT_POLICY) -> SelectionPolicy:
    """A fresh policy by its config name; an empty name means the default."""
    factory = _POLICIES.get(name or DEFAULT_POLICY)
    if factory is None:
        raise InvalidArgumentError(f"unknown selection policy {name!r} (valid: {', '.join(POLICY_NAMES)})")
    return factory()
