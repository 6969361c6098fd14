"""The worker's arbiter: which advertisements get offers, and what is offered."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from hypha.errors import ConfigError, InvalidArgumentError
from hypha.market.arbiter import AdvertisementView, Arbiter, ArbiterConfig, DropReason, OfferStrategy
from hypha.market.leases import LeaseLedger, LeaseState
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.v1 import common_pb2

CAPACITY = Resources(cpu=8, memory_gb=32, gpu=2, gpu_memory_gb=48)
T0 = 5_000.0
_ids = itertools.count()


def ad(
    request: str,
    bid: float = 1.0,
    minimum: Resources = Resources(cpu=2, memory_gb=4),
    *,
    scheduler: str = "sched-a",
    executor: ExecutorKind = ExecutorKind.TASK,
    deadline: float = T0 + 5.0,
) -> AdvertisementView:
    return AdvertisementView(
        request_id=request,
        scheduler_id=scheduler,
        requirements=Requirements(minimum, executor),
        bid=bid,
        deadline=deadline,
    )


def make(
    strategy: OfferStrategy = OfferStrategy.FLEXIBLE,
    *,
    price: float = 10.0,
    floor: float = 0.5,
    executors: frozenset[ExecutorKind] = frozenset(ExecutorKind),
    batch_max: int = 100,
    buffer_max: int = 1_000,
) -> Arbiter:
    ledger = LeaseLedger(CAPACITY, new_id=lambda: f"lease-{next(_ids)}")
    config = ArbiterConfig(
        price=price,
        floor=floor,
        strategy=strategy,
        executors=executors,
        batch_max=batch_max,
        buffer_max=buffer_max,
    )
    return Arbiter(ledger, config)


def decide(arbiter: Arbiter, *ads: AdvertisementView, now: float = T0) -> list[str]:
    for a in ads:
        arbiter.add(a, now)
    return [o.request_id for o in arbiter.decide(now)]


def test_flexible_offers_exactly_the_minimum_at_the_bid() -> None:
    arbiter = make(OfferStrategy.FLEXIBLE)
    need = Resources(cpu=2, memory_gb=4)

    arbiter.add(ad("r1", bid=1.5, minimum=need), T0)
    [offer] = arbiter.decide(T0)

    assert offer.resources == need
    assert offer.price == 1.5
    assert offer.expires_at == T0 + 0.5
    assert offer.executor is ExecutorKind.TASK
    lease = arbiter.ledger.get(offer.lease_id)
    assert lease.state is LeaseState.TEMPORARY
    assert lease.holder == "sched-a"
    assert lease.request_id == "r1"
    assert offer.offer_id == lease.offer_id
    assert arbiter.ledger.free() == CAPACITY - need


@pytest.mark.parametrize(("bid", "expected_price"), [(1.5, 10.0), (12.0, 12.0)])
def test_whole_offers_the_whole_free_pool_at_the_higher_of_price_and_bid(
    bid: float, expected_price: float
) -> None:
    arbiter = make(OfferStrategy.WHOLE, price=10.0)

    arbiter.add(ad("r1", bid=bid), T0)
    [offer] = arbiter.decide(T0)

    assert offer.resources == CAPACITY
    assert offer.price == expected_price
    assert arbiter.ledger.free().is_zero()


def test_whole_gives_the_pool_to_the_best_request_and_drops_the_rest() -> None:
    arbiter = make(OfferStrategy.WHOLE)

    offered = decide(arbiter, ad("low", bid=1.0), ad("high", bid=3.0, scheduler="sched-b"))

    assert offered == ["high"]
    assert arbiter.dropped == {"resources": 1}


def test_worker_below_floor_does_not_offer() -> None:
    arbiter = make(floor=2.0)

    offered = decide(arbiter, ad("cheap", bid=1.99), ad("fair", bid=2.0))

    assert offered == ["fair"]
    assert arbiter.dropped == {"floor": 1}


def test_unserved_executor_kind_is_dropped() -> None:
    arbiter = make(executors=frozenset({ExecutorKind.DILOCO_TRAINER}))

    offered = decide(
        arbiter, ad("task", executor=ExecutorKind.TASK), ad("train", executor=ExecutorKind.DILOCO_TRAINER)
    )

    assert offered == ["train"]
    assert arbiter.dropped == {"executor": 1}


def test_requirement_larger_than_the_free_pool_is_dropped() -> None:
    arbiter = make()

    offered = decide(arbiter, ad("gpu3", minimum=Resources(gpu=3)), ad("gpu2", minimum=Resources(gpu=2)))

    assert offered == ["gpu2"]
    assert arbiter.dropped == {"resources": 1}


def test_advertisement_past_its_deadline_is_dropped() -> None:
    arbiter = make()

    offered = decide(arbiter, ad("late", deadline=T0), ad("ok", deadline=T0 + 0.01))

    assert offered == ["ok"]
    assert arbiter.dropped == {"expired": 1}


def test_duplicates_of_one_request_get_one_offer() -> None:
    arbiter = make()

    offered = decide(arbiter, ad("r1"), ad("r1"), ad("r1", scheduler="sched-b"))

    # The same request id from another scheduler is another request.
    assert sorted(offered) == ["r1", "r1"]
    assert arbiter.dropped == {"duplicate": 1}
    # A repeat in a later batch, while the first reservation is live, is a duplicate too.
    assert decide(arbiter, ad("r1"), now=T0 + 0.1) == []
    assert arbiter.dropped == {"duplicate": 2}


def test_malformed_advertisements_are_counted() -> None:
    arbiter = make()

    offered = decide(
        arbiter,
        ad("", bid=1.0),
        ad("neg-bid", bid=-1.0),
        ad("neg-need", minimum=Resources(cpu=-1)),
        ad("nan", bid=float("nan")),
        ad("nan-deadline", deadline=float("nan")),
        ad("ok"),
    )
    arbiter.note_malformed()

    assert offered == ["ok"]
    assert arbiter.dropped == {"malformed": 6}


def test_scarce_resources_go_to_the_highest_bid_per_capacity_unit() -> None:
    arbiter = make()  # 8 CPUs free
    six = Resources(cpu=6)
    four = Resources(cpu=4)

    offered = decide(
        arbiter,
        ad("rich-but-big", bid=6.0, minimum=six, scheduler="s1"),  # 1.0 per unit
        ad("small-generous", bid=6.0, minimum=four, scheduler="s2"),  # 1.5 per unit
        ad("small-stingy", bid=2.0, minimum=four, scheduler="s3"),  # 0.5 per unit
    )

    assert offered == ["small-generous", "small-stingy"]
    assert arbiter.dropped == {"resources": 1}


def test_reservations_never_double_book() -> None:
    arbiter = make()
    requests = [
        ad(f"r{i}", bid=1.0 + i, minimum=Resources(cpu=3, gpu=1), scheduler=f"s{i}") for i in range(5)
    ]

    for r in requests:
        arbiter.add(r, T0)
    offers = arbiter.decide(T0)

    # 8 CPUs and 2 GPUs: only two such requests fit, and their leases are disjoint.
    assert len(offers) == 2
    assert len({o.lease_id for o in offers}) == 2
    total = Resources.total([o.resources for o in offers])
    assert total.fits_in(CAPACITY)
    assert total + arbiter.ledger.free() == CAPACITY
    assert arbiter.dropped == {"resources": 3}


def test_reserved_offers_expire_and_free_the_pool_for_the_next_batch() -> None:
    arbiter = make(OfferStrategy.WHOLE)
    assert decide(arbiter, ad("r1")) == ["r1"]
    assert decide(arbiter, ad("r2", deadline=T0 + 10), now=T0 + 0.1) == []

    expired = arbiter.ledger.expire_due(T0 + 0.5)

    assert len(expired) == 1
    assert decide(arbiter, ad("r3", deadline=T0 + 10), now=T0 + 0.6) == ["r3"]


def test_ready_after_the_window_or_a_full_batch() -> None:
    arbiter = make(batch_max=3)
    assert not arbiter.ready(T0)

    arbiter.add(ad("r1"), T0)
    assert not arbiter.ready(T0 + 0.1)
    assert arbiter.decide_at() == T0 + 0.2
    assert arbiter.ready(T0 + 0.2)

    arbiter.decide(T0 + 0.2)
    assert arbiter.pending() == 0
    assert not arbiter.ready(T0 + 10)

    for i in range(3):
        arbiter.add(ad(f"b{i}"), T0 + 1)
    assert arbiter.ready(T0 + 1)


def test_a_full_buffer_drops_new_advertisements() -> None:
    arbiter = make(batch_max=2, buffer_max=2)

    assert arbiter.add(ad("r1"), T0)
    assert arbiter.add(ad("r2"), T0)
    assert not arbiter.add(ad("r3"), T0)
    assert arbiter.dropped == {"overflow": 1}


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="floor"):
        ArbiterConfig(price=1.0, floor=-1.0)
    with pytest.raises(ConfigError, match="offer_ttl_s"):
        ArbiterConfig(price=1.0, floor=0.0, offer_ttl_s=0)
    with pytest.raises(ConfigError, match="offer strategy"):
        OfferStrategy.parse("greedy")
    assert ArbiterConfig(price=1.0, floor=0.0, strategy="flexible").strategy is OfferStrategy.FLEXIBLE  # type: ignore[arg-type]


def test_advertisement_proto_round_trip_uses_the_stamped_sender() -> None:
    original = ad("r1", bid=2.0, minimum=Resources(cpu=1, gpu=1), scheduler="sched-a")

    msg = original.to_proto()
    msg.scheduler_id = "forged"
    back = AdvertisementView.from_proto(msg, scheduler_id="sched-a")

    assert back == original
    with pytest.raises(InvalidArgumentError):
        AdvertisementView.from_proto(common_pb2.Advertisement(request_id="r"), scheduler_id="s")


def test_offer_decision_to_proto() -> None:
    arbiter = make()
    arbiter.add(ad("r1"), T0)
    [decision] = arbiter.decide(T0)

    msg = decision.to_proto(worker_id="w1", capacity=CAPACITY, active_leases=1, samples_per_second=3.0)

    assert msg.offer_id == decision.offer_id
    assert msg.request_id == "r1"
    assert Resources.from_proto(msg.capacity) == CAPACITY
    assert msg.executor == common_pb2.EXECUTOR_KIND_TASK
    assert msg.expires_at.ToNanoseconds() == round(decision.expires_at * 1e9)


def test_an_advertisement_for_a_share_of_the_pool_is_answered_only_by_lottery_winners() -> None:
    draws = iter([0.30, 0.10])
    ledger = LeaseLedger(CAPACITY, new_id=lambda: f"lease-{next(_ids)}")
    arbiter = Arbiter(ledger, ArbiterConfig(price=10.0, floor=0.5), draw=lambda: next(draws))
    sampled = replace(ad("r-lost"), offer_probability=0.25)

    assert arbiter.add(sampled, T0) is False  # drew 0.30 >= 0.25: this worker stays silent
    assert arbiter.pending() == 0 and arbiter.decide_at() is None  # no window opened for it
    assert arbiter.dropped[DropReason.SAMPLED] == 1

    assert arbiter.add(replace(sampled, request_id="r-won"), T0) is True  # drew 0.10
    assert [d.request_id for d in arbiter.decide(T0 + 1.0)] == ["r-won"]


def test_an_advertisement_for_everyone_draws_no_lottery() -> None:
    def no_draw() -> float:
        raise AssertionError("drew a lottery for an advertisement to everyone")

    arbiter = Arbiter(LeaseLedger(CAPACITY), ArbiterConfig(price=10.0, floor=0.5), draw=no_draw)

    assert arbiter.add(ad("r1"), T0) is True


@pytest.mark.parametrize(
    ("wire", "seen"),
    [(0.0, 1.0), (0.25, 0.25), (1.0, 1.0), (7.0, 1.0), (-0.5, 1.0), (math.nan, 1.0), (math.inf, 1.0)],
)
def test_offer_probability_on_the_wire(wire: float, seen: float) -> None:
    # Unset (an older scheduler) or out of range means everyone: a bad value can only widen the audience.
    msg = ad("r1").to_proto()
    msg.offer_probability = wire

    assert AdvertisementView.from_proto(msg, scheduler_id="sched-a").offer_probability == seen


def test_offer_probability_round_trips() -> None:
    original = replace(ad("r1"), offer_probability=0.125)

    assert original.to_proto().offer_probability == 0.125
    assert AdvertisementView.from_proto(original.to_proto(), scheduler_id="sched-a") == original
    assert ad("r2").to_proto().offer_probability == 0.0  # everyone: the field stays unset
