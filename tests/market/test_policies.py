"""Each selection policy picks what it promises from a constructed pool."""

from __future__ import annotations

import pytest

from hypha.errors import InvalidArgumentError
from hypha.market.policies import (
    POLICY_NAMES,
    BalancedPolicy,
    OfferView,
    PricePerformancePolicy,
    RoundRobinPolicy,
    get_policy,
)
from hypha.market.resources import ExecutorKind, Resources
from hypha.v1 import common_pb2


def offer(
    worker: str,
    price: float,
    resources: Resources,
    *,
    capacity: Resources | None = None,
    active: int = 0,
    sps: float = 0.0,
    success: float = 0.0,
    offer_id: str | None = None,
) -> OfferView:
    return OfferView(
        offer_id=offer_id or f"{worker}-offer",
        worker_id=worker,
        price=price,
        resources=resources,
        capacity=capacity or resources,
        active_leases=active,
        samples_per_second=sps,
        success_rate=success,
    )


def ids(offers: list[OfferView]) -> list[str]:
    return [o.worker_id for o in offers]


GPU = Resources(cpu=4, memory_gb=16, gpu=1)  # 29.6 units
BIG_GPU = Resources(cpu=16, memory_gb=64, gpu=4)  # 122.4 units
CPU = Resources(cpu=8, memory_gb=16)  # 9.6 units


def test_registry_knows_every_policy_and_defaults_to_price_performance() -> None:
    assert set(POLICY_NAMES) == {
        "price-performance",
        "round-robin",
        "least-loaded",
        "best-fit",
        "balanced",
        "performance-aware",
    }
    for name in POLICY_NAMES:
        assert get_policy(name).name == name
    assert isinstance(get_policy(), PricePerformancePolicy)
    assert isinstance(get_policy(""), PricePerformancePolicy)


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(InvalidArgumentError, match=r"cheapest.*price-performance.*performance-aware"):
        get_policy("cheapest")


def test_registry_gives_each_caller_its_own_state() -> None:
    pool = [offer("w-a", 1.0, GPU), offer("w-b", 1.0, GPU), offer("w-c", 1.0, GPU)]
    first = get_policy("round-robin")
    assert ids(first.select(pool, 1)) == ["w-a"]
    assert ids(first.select(pool, 1)) == ["w-b"]  # the rotation moved on for this caller...
    # ...but not for a new one: a shared cursor would start it after w-b.
    assert ids(get_policy("round-robin").select(pool, 1)) == ["w-a"]


def test_price_performance_takes_most_capacity_per_token() -> None:
    pool = [
        offer("w-cheap-small", 1.0, CPU),  # 0.104 per unit
        offer("w-gpu", 2.0, GPU),  # 0.068 per unit
        offer("w-big", 6.0, BIG_GPU),  # 0.049 per unit
    ]

    assert ids(get_policy("price-performance").select(pool, 2)) == ["w-big", "w-gpu"]


def test_price_performance_breaks_ties_by_worker_id() -> None:
    pool = [offer("w-b", 1.0, GPU), offer("w-a", 1.0, GPU), offer("w-c", 1.0, GPU)]

    assert ids(get_policy().select(pool, 3)) == ["w-a", "w-b", "w-c"]


def test_at_most_one_offer_per_worker_and_it_is_the_best() -> None:
    pool = [
        offer("w-a", 5.0, GPU, offer_id="a-dear"),
        offer("w-a", 1.0, GPU, offer_id="a-cheap"),
        offer("w-b", 3.0, GPU),
    ]

    chosen = get_policy().select(pool, 3)

    assert [o.offer_id for o in chosen] == ["a-cheap", "w-b-offer"]


def test_offers_below_the_requirement_are_not_selected() -> None:
    pool = [offer("w-cpu", 0.1, CPU), offer("w-gpu", 5.0, GPU)]

    assert ids(get_policy().select(pool, 2, Resources(gpu=1))) == ["w-gpu"]


def test_count_limits_the_selection() -> None:
    pool = [offer(f"w-{i}", 1.0, GPU) for i in range(5)]

    assert len(get_policy().select(pool, 2)) == 2
    assert get_policy().select(pool, 0) == []


def test_round_robin_rotates_across_calls() -> None:
    policy = get_policy("round-robin")
    pool = [offer(w, 1.0, GPU) for w in ("w-c", "w-a", "w-b")]

    picks = [ids(policy.select(pool, 1)) for _ in range(4)]

    assert picks == [["w-a"], ["w-b"], ["w-c"], ["w-a"]]
    assert ids(policy.select(pool, 2)) == ["w-b", "w-c"]


def test_round_robin_continues_after_the_last_worker_when_the_pool_changes() -> None:
    policy = RoundRobinPolicy()
    policy.select([offer("w-a", 1, GPU), offer("w-b", 1, GPU)], 1)  # picks w-a

    picked = policy.select([offer("w-a", 1, GPU), offer("w-c", 1, GPU)], 1)

    assert ids(picked) == ["w-c"]


def test_least_loaded_prefers_fewest_active_leases_then_price() -> None:
    pool = [
        offer("w-busy-cheap", 0.1, GPU, active=3),
        offer("w-idle-dear", 9.0, GPU, active=0),
        offer("w-idle-cheap", 2.0, GPU, active=0),
        offer("w-one", 1.0, GPU, active=1),
    ]

    assert ids(get_policy("least-loaded").select(pool, 3)) == ["w-idle-cheap", "w-idle-dear", "w-one"]


def test_best_fit_takes_the_smallest_machine_that_fits() -> None:
    need = Resources(cpu=4, memory_gb=8, gpu=1)
    pool = [
        offer("w-huge", 1.0, BIG_GPU),  # cheapest per unit, most waste
        offer("w-snug", 3.0, GPU),  # waste: 8 GB memory = 0.8 units
        offer("w-nogpu", 0.5, CPU),  # does not fit
        offer("w-tight", 3.0, Resources(cpu=4, memory_gb=8, gpu=1, storage_gb=10)),  # waste 0.1
    ]

    assert ids(get_policy("best-fit").select(pool, 3, need)) == ["w-tight", "w-snug", "w-huge"]


def test_best_fit_measures_waste_on_the_whole_machine() -> None:
    need = Resources(cpu=2)
    # Both offer exactly 2 CPUs, but one sits on a much bigger machine.
    pool = [
        offer("w-on-big", 1.0, Resources(cpu=2), capacity=Resources(cpu=64)),
        offer("w-on-small", 1.0, Resources(cpu=2), capacity=Resources(cpu=4)),
    ]

    assert ids(get_policy("best-fit").select(pool, 1, need)) == ["w-on-small"]


def test_performance_aware_prefers_throughput_times_success() -> None:
    pool = [
        offer("w-fast-flaky", 1.0, GPU, sps=1000, success=0.1),  # 100
        offer("w-steady", 5.0, GPU, sps=400, success=1.0),  # 400
        offer("w-new", 0.1, GPU),  # no record: 0
        offer("w-good", 2.0, GPU, sps=250, success=0.8),  # 200
    ]

    chosen = ids(get_policy("performance-aware").select(pool, 4))

    assert chosen == ["w-steady", "w-good", "w-fast-flaky", "w-new"]


def test_balanced_spreads_over_workers_this_scheduler_does_not_use_yet() -> None:
    policy = get_policy("balanced")
    pool = [offer("w-a", 1.0, GPU), offer("w-b", 1.0, GPU), offer("w-c", 1.0, GPU)]

    first = ids(policy.select(pool, 1))
    second = ids(policy.select(pool, 1))
    third = ids(policy.select(pool, 1))

    assert sorted(first + second + third) == ["w-a", "w-b", "w-c"]


def test_balanced_uses_the_schedulers_lease_counts_when_given() -> None:
    in_use = {"w-a": 2, "w-b": 1}
    policy = BalancedPolicy(in_use=lambda: in_use)
    pool = [offer("w-a", 0.1, GPU), offer("w-b", 1.0, GPU), offer("w-c", 9.0, GPU)]

    assert ids(policy.select(pool, 3)) == ["w-c", "w-b", "w-a"]


def test_balanced_prefers_the_least_leased_machine_among_unused_ones() -> None:
    machine = Resources(cpu=16, memory_gb=64)
    pool = [
        offer("w-mostly-leased", 0.1, Resources(cpu=2, memory_gb=8), capacity=machine),
        offer("w-idle", 1.0, machine, capacity=machine),
    ]

    assert ids(get_policy("balanced").select(pool, 1)) == ["w-idle"]


def test_offer_view_from_proto_takes_worker_id_from_the_session() -> None:
    msg = common_pb2.Offer(
        offer_id="o1",
        request_id="r1",
        worker_id="forged",
        resources=GPU.to_proto(),
        capacity=BIG_GPU.to_proto(),
        price=2.0,
        executor=common_pb2.EXECUTOR_KIND_TASK,
        samples_per_second=12.5,
        success_rate=1.7,
        active_leases=2,
    )
    msg.expires_at.FromSeconds(1_000)

    view = OfferView.from_proto(msg, worker_id="w-real")

    assert view.worker_id == "w-real"
    assert view.resources == GPU
    assert view.capacity == BIG_GPU
    assert view.executor is ExecutorKind.TASK
    assert view.expires_at == 1_000.0
    assert view.success_rate == 1.0
    with pytest.raises(InvalidArgumentError):
        OfferView.from_proto(common_pb2.Offer(offer_id="o2", price=-1.0), worker_id="w")
