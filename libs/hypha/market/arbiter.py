"""The worker's arbiter: turns a burst of advertisements into offers.

Advertisements arrive on a pub/sub topic, many schedulers at once. The arbiter
buffers them for a short window, then decides in one pass: it drops what this
worker cannot or will not serve, ranks the rest by what they pay per unit of
capacity, and reserves each winner under a temporary lease in the ledger
before offering it, so two requests never get the same resources. Network I/O
(receiving ads, sending offers) belongs to the caller.

An advertisement may ask only a random share of the pool to answer
(``offer_probability``): a scheduler that knows a large pool needs a handful
of offers, not one from every free worker, which all arrive at the end of the
same batch window. The lottery is drawn when the advertisement arrives, so a
worker that loses it does no more work for that request.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from hypha.errors import ConfigError, InvalidArgumentError, ResourceExhaustedError
from hypha.market.leases import LeaseLedger
from hypha.market.pricing import DEFAULT_WEIGHTS, Weights, score
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.timestamps import to_seconds, to_timestamp
from hypha.v1 import common_pb2


class OfferStrategy(StrEnum):
    WHOLE = "whole"  # offer the whole free pool at max(price, bid)
    FLEXIBLE = "flexible"  # offer exactly the requested minimum at the bid

    @classmethod
    def parse(cls, name: str) -> OfferStrategy:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"unknown offer strategy {name!r} (valid: whole, flexible)") from None

    def to_proto(self) -> common_pb2.OfferStrategy:
        if self is OfferStrategy.WHOLE:
            return common_pb2.OFFER_STRATEGY_WHOLE
        return common_pb2.OFFER_STRATEGY_FLEXIBLE


class DropReason(StrEnum):
    """Why an advertisement got no offer (the keys of ``Arbiter.dropped``)."""

    EXECUTOR = "executor"  # this worker does not run that executor kind
    RESOURCES = "resources"  # the minimum does not fit what is free now
    FLOOR = "floor"  # the bid is below this worker's floor
    EXPIRED = "expired"  # the advertisement's deadline has passed
    DUPLICATE = "duplicate"  # same scheduler and request id seen already
    MALFORMED = "malformed"  # missing ids, negative or non-finite numbers
    OVERFLOW = "overflow"  # the buffer was full (the caller is not deciding)
    SAMPLED = "sampled"  # lost the advertisement's lottery (offer_probability)


@dataclass(frozen=True)
class ArbiterConfig:
    """How a worker sells its resources."""

    price: float  #: asking price for the whole machine (strategy ``whole``)
    floor: float  #: the lowest bid this worker answers
    strategy: OfferStrategy = OfferStrategy.WHOLE
    executors: frozenset[ExecutorKind] = frozenset(ExecutorKind)
    offer_ttl_s: float = 0.5  #: life of the temporary lease behind an offer
    batch_window_s: float = 0.2  #: how long advertisements are collected
    batch_max: int = 100  #: decide early once this many are waiting
    buffer_max: int = 1_000  #: hard bound on waiting advertisements
    weights: Weights = DEFAULT_WEIGHTS

    def __post_init__(self) -> None:
        for name in ("price", "floor"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0.0:
                raise ConfigError(f"arbiter: {name} must be a non-negative number, got {value!r}")
        for name in ("offer_ttl_s", "batch_window_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0.0:
                raise ConfigError(f"arbiter: {name} must be a positive number of seconds, got {value!r}")
        if self.batch_max < 1 or self.buffer_max < self.batch_max:
            raise ConfigError("arbiter: need 1 <= batch_max <= buffer_max")
        object.__setattr__(self, "strategy", OfferStrategy(self.strategy))
        object.__setattr__(self, "executors", frozenset(ExecutorKind(e) for e in self.executors))


@dataclass(frozen=True)
class AdvertisementView:
    """A scheduler's request as a worker sees it."""

    request_id: str
    scheduler_id: str  #: the authenticated sender, stamped by the gateway
    requirements: Requirements
    bid: float
    deadline: float  #: wall-clock seconds; no offer after it
    count: int = 1
    scheduler_addresses: tuple[str, ...] = ()
    #: The share of workers asked to answer; 1.0: everyone who can.
    offer_probability: float = 1.0

    @classmethod
    def from_proto(cls, msg: common_pb2.Advertisement, scheduler_id: str) -> AdvertisementView:
        """``scheduler_id`` is the gateway's sender stamp; the field in the message is ignored."""
        if not msg.HasField("requirements"):
            raise InvalidArgumentError("advertisement without requirements")
        return cls(
            request_id=msg.request_id,
            scheduler_id=scheduler_id,
            requirements=Requirements.from_proto(msg.requirements),
            bid=msg.bid,
            deadline=to_seconds(msg.deadline) if msg.HasField("deadline") else math.inf,
            count=max(1, msg.count),
            scheduler_addresses=tuple(msg.scheduler_addresses),
            offer_probability=probability_from_wire(msg.offer_probability),
        )

    def to_proto(self) -> common_pb2.Advertisement:
        msg = common_pb2.Advertisement(
            request_id=self.request_id,
            scheduler_id=self.scheduler_id,
            scheduler_addresses=list(self.scheduler_addresses),
            requirements=self.requirements.to_proto(),
            bid=self.bid,
            count=self.count,
            offer_probability=self.offer_probability if self.offer_probability < 1.0 else 0.0,
        )
        if math.isfinite(self.deadline):
            msg.deadline.CopyFrom(to_timestamp(self.deadline))
        return msg

    def is_malformed(self) -> bool:
        return (
            not self.request_id
            or not self.scheduler_id
            or not math.isfinite(self.bid)
            or self.bid < 0.0
            or self.count < 1
            or math.isnan(self.deadline)
            or not self.requirements.minimum.is_non_negative()
        )


def probability_from_wire(value: float) -> float:
    """The wire's ``offer_probability``: 0 (unset, an older scheduler) and anything
    outside (0, 1), NaN included, mean every worker answers; a sender cannot use it
    to silence the pool beyond what a small probability already does."""
    return value if 0.0 < value < 1.0 else 1.0


@dataclass(frozen=True)
class OfferDecision:
    """An offer to send: the resources are already held under ``lease_id``."""

    offer_id: str
    lease_id: str
    request_id: str
    scheduler_id: str
    resources: Resources
    price: float
    expires_at: float
    executor: ExecutorKind
    scheduler_addresses: tuple[str, ...] = ()

    def to_proto(
        self,
        *,
        worker_id: str = "",
        worker_addresses: tuple[str, ...] = (),
        capacity: Resources | None = None,
        active_leases: int = 0,
        samples_per_second: float = 0.0,
        success_rate: float = 0.0,
    ) -> common_pb2.Offer:
        return common_pb2.Offer(
            offer_id=self.offer_id,
            request_id=self.request_id,
            worker_id=worker_id,
            worker_addresses=list(worker_addresses),
            resources=self.resources.to_proto(),
            price=self.price,
            expires_at=to_timestamp(self.expires_at),
            executor=self.executor.to_proto(),
            samples_per_second=samples_per_second,
            success_rate=success_rate,
            active_leases=active_leases,
            capacity=(capacity or Resources()).to_proto(),
        )


@dataclass
class _Pending:
    ad: AdvertisementView
    seq: int


class Arbiter:
    """Decides which advertisements this worker answers, and with what.

    ``dropped`` counts advertisements that got no offer, by ``DropReason``.
    """

    def __init__(
        self, ledger: LeaseLedger, config: ArbiterConfig, *, draw: Callable[[], float] = random.random
    ) -> None:
        self.ledger = ledger
        self.config = config
        #: Uniform in [0, 1): the lottery of advertisements that ask only some workers to answer.
        self._draw = draw
        self.dropped: Counter[str] = Counter()
        self._buffer: list[_Pending] = []
        self._opened_at: float | None = None
        self._seq = 0

    def add(self, ad: AdvertisementView, now: float) -> bool:
        """Buffer an advertisement; False (and counted) when the buffer is full or this
        worker lost the advertisement's lottery."""
        if ad.offer_probability < 1.0 and self._draw() >= ad.offer_probability:
            self.dropped[DropReason.SAMPLED] += 1
            return False
        if len(self._buffer) >= self.config.buffer_max:
            self.dropped[DropReason.OVERFLOW] += 1
            return False
        if not self._buffer:
            self._opened_at = now
        self._buffer.append(_Pending(ad, self._seq))
        self._seq += 1
        return True

    def note_malformed(self) -> None:
        """Count an advertisement the caller could not even convert."""
        self.dropped[DropReason.MALFORMED] += 1

    def pending(self) -> int:
        return len(self._buffer)

    def ready(self, now: float) -> bool:
        if not self._buffer or self._opened_at is None:
            return False
        return (
            len(self._buffer) >= self.config.batch_max or now >= self._opened_at + self.config.batch_window_s
        )

    def decide_at(self) -> float | None:
        """When the current window closes (for a caller that sleeps until then)."""
        return None if self._opened_at is None else self._opened_at + self.config.batch_window_s

    def decide(self, now: float) -> list[OfferDecision]:
        """Take every buffered advertisement and return the offers to send."""
        batch, self._buffer, self._opened_at = self._buffer, [], None
        candidates = self._filter(batch, now)
        # Highest bid per unit of capacity first; earlier deadline, then arrival, break ties.
        candidates.sort(
            key=lambda p: (
                -score(p.ad.bid, p.ad.requirements.minimum, self.config.weights),
                p.ad.deadline,
                p.seq,
            )
        )
        offers: list[OfferDecision] = []
        for pending in candidates:
            offer = self._reserve(pending.ad, now)
            if offer is None:
                self.dropped[DropReason.RESOURCES] += 1
            else:
                offers.append(offer)
        return offers

    def _filter(self, batch: list[_Pending], now: float) -> list[_Pending]:
        # Requests this worker already holds something for are not offered twice.
        seen = {(lease.holder, lease.request_id) for lease in self.ledger.live() if lease.request_id}
        kept: list[_Pending] = []
        for pending in batch:
            reason = self._reject_reason(pending.ad, now, seen)
            if reason is not None:
                self.dropped[reason] += 1
                continue
            seen.add((pending.ad.scheduler_id, pending.ad.request_id))
            kept.append(pending)
        return kept

    def _reject_reason(
        self, ad: AdvertisementView, now: float, seen: set[tuple[str, str]]
    ) -> DropReason | None:
        if ad.is_malformed():
            return DropReason.MALFORMED
        if (ad.scheduler_id, ad.request_id) in seen:
            return DropReason.DUPLICATE
        if ad.requirements.executor not in self.config.executors:
            return DropReason.EXECUTOR
        if ad.deadline <= now:
            return DropReason.EXPIRED
        if ad.bid < self.config.floor:
            return DropReason.FLOOR
        if not ad.requirements.minimum.fits_in(self.ledger.free()):
            return DropReason.RESOURCES
        return None

    def _reserve(self, ad: AdvertisementView, now: float) -> OfferDecision | None:
        free = self.ledger.free()
        if not ad.requirements.minimum.fits_in(free):
            return None
        if self.config.strategy is OfferStrategy.WHOLE:
            if free.is_zero():
                return None
            resources, price = free, max(self.config.price, ad.bid)
        else:
            resources, price = ad.requirements.minimum, ad.bid
        try:
            lease = self.ledger.reserve(
                ad.scheduler_id,
                resources,
                self.config.offer_ttl_s,
                now,
                price=price,
                executor=ad.requirements.executor,
                request_id=ad.request_id,
            )
        except ResourceExhaustedError:
            return None
        return OfferDecision(
            offer_id=lease.offer_id,
            lease_id=lease.lease_id,
            request_id=ad.request_id,
            scheduler_id=ad.scheduler_id,
            resources=lease.resources,
            price=price,
            expires_at=lease.expires_at,
            executor=ad.requirements.executor,
            scheduler_addresses=ad.scheduler_addresses,
        )
