"""The scheduler's allocation of one request, and the book of leases it holds."""

from __future__ import annotations

import pytest

from hypha.errors import AlreadyExistsError, IllegalTransitionError, InvalidArgumentError, NotFoundError
from hypha.market.allocator import Allocation, HeldLease, LeaseBook, renew_at
from hypha.market.policies import OfferView, get_policy
from hypha.market.pricing import PriceRange
from hypha.market.resources import ExecutorKind, Requirements, Resources

T0 = 2_000.0
NEED = Requirements(Resources(cpu=2, gpu=1), ExecutorKind.DILOCO_TRAINER)
GPU = Resources(cpu=4, memory_gb=16, gpu=1)


def offer(
    worker: str,
    price: float = 1.0,
    resources: Resources = GPU,
    *,
    offer_id: str | None = None,
    expires_at: float = T0 + 0.5,
    request_id: str = "req-1",
    executor: ExecutorKind | None = ExecutorKind.DILOCO_TRAINER,
) -> OfferView:
    return OfferView(
        offer_id=offer_id or f"{worker}-o",
        worker_id=worker,
        price=price,
        resources=resources,
        expires_at=expires_at,
        request_id=request_id,
        executor=executor,
    )


def allocation(count: int = 2, max_price: float = 5.0, policy: str = "price-performance") -> Allocation:
    return Allocation(
        "req-1",
        NEED,
        count,
        PriceRange(bid=1.0, max=max_price),
        window_ends_at=T0 + 5,
        policy=get_policy(policy),
    )


def test_offers_above_max_are_ignored() -> None:
    alloc = allocation(max_price=2.0)

    assert not alloc.offer(offer("w-dear", price=2.01), T0)
    assert alloc.offer(offer("w-ok", price=2.0), T0)

    assert [o.worker_id for o in alloc.candidates()] == ["w-ok"]
    assert alloc.dropped == {"price": 1}
    choice = alloc.choose()
    assert [o.worker_id for o in choice.winners] == ["w-ok"]
    assert choice.missing == 1


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (offer("w", request_id="req-2"), "request"),
        (offer("w", executor=ExecutorKind.TASK), "executor"),
        (offer("w", resources=Resources(cpu=8)), "resources"),
        (offer("w", expires_at=T0), "expired"),
    ],
)
def test_offers_that_cannot_serve_the_request_are_refused(bad: OfferView, reason: str) -> None:
    alloc = allocation()

    assert not alloc.offer(bad, T0)
    assert alloc.dropped == {reason: 1}
    assert alloc.candidates() == []


def test_offers_after_the_window_are_late() -> None:
    alloc = allocation()

    assert not alloc.offer(offer("w-late", expires_at=T0 + 10), T0 + 5.01)
    assert alloc.dropped == {"late": 1}


def test_offers_after_the_choice_are_late() -> None:
    alloc = allocation(count=1)
    alloc.offer(offer("w-a"), T0)
    alloc.choose()

    assert not alloc.offer(offer("w-b"), T0 + 0.1)
    assert alloc.dropped == {"late": 1}


def test_a_worker_offering_twice_keeps_only_its_best_and_the_other_loses() -> None:
    alloc = allocation(count=2)

    assert alloc.offer(offer("w-a", price=3.0, offer_id="a1"), T0)
    assert alloc.offer(offer("w-a", price=1.0, offer_id="a2"), T0)  # better: replaces a1
    assert not alloc.offer(offer("w-a", price=2.0, offer_id="a3"), T0)  # worse: refused
    assert alloc.offer(offer("w-a", price=1.0, offer_id="a2"), T0)  # redelivered: still kept, not released
    assert alloc.offer(offer("w-b", price=1.5), T0)

    choice = alloc.choose()

    assert sorted(o.offer_id for o in choice.winners) == ["a2", "w-b-o"]
    assert [o.offer_id for o in choice.losers] == ["a1"]
    assert alloc.dropped == {"duplicate": 2}


def test_complete_when_enough_workers_or_the_window_ends() -> None:
    alloc = allocation(count=2)
    alloc.offer(offer("w-a"), T0)
    alloc.offer(offer("w-a", offer_id="again", price=0.5), T0)

    assert not alloc.complete(T0 + 1)  # two offers, but one worker
    assert alloc.complete(T0 + 5)
    assert alloc.offer(offer("w-b", expires_at=T0 + 2), T0 + 1)
    assert alloc.complete(T0 + 1)


def test_choose_splits_every_kept_offer_into_winners_or_losers() -> None:
    alloc = allocation(count=2)
    offers = [offer(f"w-{i}", price=1.0 + i) for i in range(5)]
    for o in offers:
        assert alloc.offer(o, T0)

    choice = alloc.choose()

    assert [o.worker_id for o in choice.winners] == ["w-0", "w-1"]
    assert {o.offer_id for o in choice.winners} | {o.offer_id for o in choice.losers} == {
        o.offer_id for o in offers
    }
    assert not {o.offer_id for o in choice.winners} & {o.offer_id for o in choice.losers}
    assert choice.missing == 0


def test_offers_that_lapsed_before_the_choice_cannot_win() -> None:
    alloc = allocation(count=2)
    alloc.offer(offer("w-short", price=0.1, expires_at=T0 + 0.3), T0)
    alloc.offer(offer("w-long", price=3.0, expires_at=T0 + 2), T0)

    choice = alloc.choose(now=T0 + 0.3)

    assert [o.worker_id for o in choice.winners] == ["w-long"]
    assert [o.worker_id for o in choice.losers] == ["w-short"]
    assert choice.missing == 1


def test_choosing_twice_is_an_illegal_transition() -> None:
    alloc = allocation()
    alloc.choose()

    with pytest.raises(IllegalTransitionError, match="chosen -> chosen"):
        alloc.choose()


def test_the_policy_decides_among_candidates() -> None:
    alloc = allocation(count=1, policy="least-loaded")
    busy = OfferView("busy", "w-busy", 0.1, GPU, active_leases=4, request_id="req-1")
    idle = OfferView("idle", "w-idle", 4.0, GPU, active_leases=0, request_id="req-1")
    alloc.offer(busy, T0)
    alloc.offer(idle, T0)

    assert [o.offer_id for o in alloc.choose().winners] == ["idle"]


def test_an_allocation_needs_a_positive_count() -> None:
    with pytest.raises(InvalidArgumentError):
        Allocation("r", NEED, 0, PriceRange(1, 2), T0)


def test_renew_at_two_thirds_of_the_lease() -> None:
    assert renew_at(T0 + 9.0, ttl_s=9.0) == pytest.approx(T0 + 6.0)


def held(lease_id: str, worker: str = "w-a", expires_at: float = T0 + 9.0) -> HeldLease:
    return HeldLease(lease_id, worker, "req-1", NEED, GPU, 1.0, expires_at=expires_at, ttl_s=9.0)


def test_lease_book_reports_leases_due_for_renewal() -> None:
    book = LeaseBook()
    book.add(held("l1", expires_at=T0 + 9.0))  # renew at T0+6
    book.add(held("l2", expires_at=T0 + 12.0))  # renew at T0+9

    assert book.due_for_renewal(T0 + 5.9) == []
    assert [h.lease_id for h in book.due_for_renewal(T0 + 6.0)] == ["l1"]
    assert [h.lease_id for h in book.due_for_renewal(T0 + 9.5)] == ["l1", "l2"]
    assert book.next_renewal() == pytest.approx(T0 + 6.0)

    book.renewed("l1", T0 + 15.0)

    assert [h.lease_id for h in book.due_for_renewal(T0 + 9.5)] == ["l2"]
    assert [h.lease_id for h in book.overdue(T0 + 12.0)] == ["l2"]


def test_a_lost_lease_is_returned_once_for_readvertising() -> None:
    book = LeaseBook()
    book.add(held("l1"))

    lost = book.mark_lost("l1")

    assert lost is not None
    assert lost.requirement == NEED
    assert book.mark_lost("l1") is None
    assert "l1" not in book
    with pytest.raises(NotFoundError):
        book.get("l1")


def test_lease_book_rejects_duplicates_and_counts_by_worker() -> None:
    book = LeaseBook()
    book.add(held("l1", "w-a"))
    book.add(held("l2", "w-a"))
    book.add(held("l3", "w-b"))

    with pytest.raises(AlreadyExistsError):
        book.add(held("l1"))
    assert book.count_by_worker() == {"w-a": 2, "w-b": 1}
    assert book.release("l2") is not None
    assert len(book) == 2


def test_a_late_offer_for_an_earlier_round_of_the_same_need_counts() -> None:
    alloc = Allocation(
        "req-2",
        NEED,
        2,
        PriceRange(bid=1.0, max=5.0),
        window_ends_at=T0 + 5,
        earlier=frozenset({"req-1"}),
    )

    assert alloc.offer(offer("w-late", request_id="req-1"), T0)  # answered the first round, late
    assert alloc.offer(offer("w-now", request_id="req-2"), T0)
    assert not alloc.offer(offer("w-other", request_id="req-9"), T0)

    assert alloc.dropped == {"request": 1}
    assert sorted(o.worker_id for o in alloc.choose(T0).winners) == ["w-late", "w-now"]


def test_answered_counts_workers_that_could_serve_even_late_but_not_refusals() -> None:
    alloc = allocation(count=3, max_price=2.0)

    assert alloc.offer(offer("w-ok"), T0)
    assert not alloc.offer(offer("w-dear", price=3.0), T0)  # could not serve: priced out
    assert not alloc.offer(offer("w-lapsed", expires_at=T0), T0)  # its reservation lapsed in transit
    assert not alloc.offer(offer("w-late"), T0 + 6)  # after the window

    assert alloc.answered == {"w-ok", "w-lapsed", "w-late"}
