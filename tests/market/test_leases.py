"""The lease ledger: the state machine, and that resources come back exactly once."""

from __future__ import annotations

import itertools

import pytest

from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from hypha.market.leases import TRANSITIONS, LeaseLedger, LeaseState, transition
from hypha.market.resources import ExecutorKind, Resources
from hypha.v1 import common_pb2

CAPACITY = Resources(cpu=8, memory_gb=32, gpu=2, gpu_memory_gb=48)
HALF = Resources(cpu=4, memory_gb=16, gpu=1, gpu_memory_gb=24)
T0 = 1_000.0


@pytest.fixture
def ledger() -> LeaseLedger:
    counter = itertools.count()
    return LeaseLedger(CAPACITY, new_id=lambda: f"lease-{next(counter)}")


# ---- the transition table --------------------------------------------------


@pytest.mark.parametrize("current", list(LeaseState))
@pytest.mark.parametrize("target", list(LeaseState))
def test_transition_follows_the_table(current: LeaseState, target: LeaseState) -> None:
    if target in TRANSITIONS[current]:
        assert transition(current, target) is target
    else:
        with pytest.raises(IllegalTransitionError, match=f"{current.value} -> {target.value}"):
            transition(current, target)


def test_ended_states_are_terminal() -> None:
    assert TRANSITIONS[LeaseState.RELEASED] == frozenset()
    assert TRANSITIONS[LeaseState.EXPIRED] == frozenset()
    assert LeaseState.TEMPORARY not in TRANSITIONS[LeaseState.ACTIVE]


# ---- reserve ------------------------------------------------------------------


def test_reserve_takes_resources_out_of_the_free_pool(ledger: LeaseLedger) -> None:
    lease = ledger.reserve("sched-a", HALF, ttl_s=0.5, now=T0, price=3.0, executor=ExecutorKind.TASK)

    assert lease.state is LeaseState.TEMPORARY
    assert lease.expires_at == T0 + 0.5
    assert lease.holder == "sched-a"
    assert ledger.free() == CAPACITY - HALF
    assert ledger.get(lease.lease_id) == lease


def test_reserve_beyond_the_free_pool_is_refused(ledger: LeaseLedger) -> None:
    ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.reserve("sched-b", HALF, 0.5, T0)

    with pytest.raises(ResourceExhaustedError):
        ledger.reserve("sched-c", Resources(cpu=0.5), 0.5, T0)
    assert ledger.free().is_zero()


def test_reserve_rejects_bad_input(ledger: LeaseLedger) -> None:
    with pytest.raises(InvalidArgumentError):
        ledger.reserve("sched-a", HALF, ttl_s=0, now=T0)
    with pytest.raises(InvalidArgumentError):
        ledger.reserve("sched-a", Resources(cpu=-1), ttl_s=1, now=T0)
    with pytest.raises(InvalidArgumentError):
        ledger.reserve("", HALF, ttl_s=1, now=T0)
    ledger.reserve("sched-a", Resources(cpu=1), 1, T0, lease_id="x")
    with pytest.raises(AlreadyExistsError):
        ledger.reserve("sched-a", Resources(cpu=1), 1, T0, lease_id="x")
    assert ledger.free() == CAPACITY - Resources(cpu=1)


def test_live_lease_count_is_bounded() -> None:
    ledger = LeaseLedger(CAPACITY, max_live=2)
    ledger.reserve("s", Resources(), 1, T0)
    ledger.reserve("s", Resources(), 1, T0)

    with pytest.raises(ResourceExhaustedError):
        ledger.reserve("s", Resources(), 1, T0)


# ---- activate ----------------------------------------------------------------


def test_holder_activates_a_temporary_lease_for_the_requested_ttl(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)

    lease = ledger.activate(temp.lease_id, "sched-a", ttl_s=10.0, now=T0 + 0.2)

    assert lease.state is LeaseState.ACTIVE
    assert lease.expires_at == T0 + 10.2
    assert ledger.active() == [lease]
    assert ledger.free() == CAPACITY - HALF


def test_only_the_holder_may_activate(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)

    with pytest.raises(PermissionDeniedError):
        ledger.activate(temp.lease_id, "sched-b", 10.0, T0)
    assert ledger.get(temp.lease_id).state is LeaseState.TEMPORARY


def test_activating_an_unknown_lease_is_not_found(ledger: LeaseLedger) -> None:
    with pytest.raises(NotFoundError):
        ledger.activate("nope", "sched-a", 10.0, T0)


def test_an_overdue_temporary_lease_cannot_be_activated(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)

    with pytest.raises(FailedPreconditionError, match="expired before it was accepted"):
        ledger.activate(temp.lease_id, "sched-a", 10.0, T0 + 0.5)
    # Not yet pruned: the resources stay held until expire_due returns it.
    assert ledger.get(temp.lease_id).state is LeaseState.TEMPORARY
    assert [lease.lease_id for lease in ledger.expire_due(T0 + 0.5)] == [temp.lease_id]


def test_a_pruned_temporary_lease_cannot_be_activated(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.expire_due(T0 + 1)

    with pytest.raises(IllegalTransitionError, match="expired -> active"):
        ledger.activate(temp.lease_id, "sched-a", 10.0, T0 + 1)


def test_activating_an_active_lease_again_renews_it(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.activate(temp.lease_id, "sched-a", 10.0, T0)

    again = ledger.activate(temp.lease_id, "sched-a", 10.0, T0 + 3)

    assert again.state is LeaseState.ACTIVE
    assert again.expires_at == T0 + 13
    assert ledger.free() == CAPACITY - HALF


def test_ttl_is_capped_by_the_worker() -> None:
    ledger = LeaseLedger(CAPACITY, max_ttl_s=30.0)
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)

    lease = ledger.activate(temp.lease_id, "sched-a", ttl_s=3600.0, now=T0)

    assert lease.expires_at == T0 + 30.0


# ---- renew ------------------------------------------------------------------


def test_renew_means_now_plus_ttl(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.activate(temp.lease_id, "sched-a", 10.0, T0)

    lease = ledger.renew(temp.lease_id, "sched-a", 10.0, T0 + 7)

    assert lease.expires_at == T0 + 17


def test_renewing_a_temporary_lease_needs_an_accept_first(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)

    with pytest.raises(FailedPreconditionError, match="accept it first"):
        ledger.renew(temp.lease_id, "sched-a", 10.0, T0)


def test_an_overdue_lease_is_not_revived_by_a_late_renewal(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.activate(temp.lease_id, "sched-a", 10.0, T0)

    with pytest.raises(FailedPreconditionError, match="expired"):
        ledger.renew(temp.lease_id, "sched-a", 10.0, T0 + 10)
    expired = ledger.expire_due(T0 + 10)
    assert [lease.state for lease in expired] == [LeaseState.EXPIRED]


def test_only_the_holder_may_renew_or_release(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.activate(temp.lease_id, "sched-a", 10.0, T0)

    with pytest.raises(PermissionDeniedError):
        ledger.renew(temp.lease_id, "sched-b", 10.0, T0 + 1)
    with pytest.raises(PermissionDeniedError):
        ledger.release(temp.lease_id, "sched-b", T0 + 1)
    assert ledger.get(temp.lease_id).state is LeaseState.ACTIVE


def test_renewing_a_released_lease_is_illegal(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.activate(temp.lease_id, "sched-a", 10.0, T0)
    ledger.release(temp.lease_id, "sched-a", T0 + 1)

    with pytest.raises(IllegalTransitionError, match="released -> active"):
        ledger.renew(temp.lease_id, "sched-a", 10.0, T0 + 2)


# ---- release and expiry: exactly once ------------------------------------------


@pytest.mark.parametrize("accept", [False, True])
def test_release_returns_resources_once(ledger: LeaseLedger, accept: bool) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    if accept:
        ledger.activate(temp.lease_id, "sched-a", 10.0, T0)

    released = ledger.release(temp.lease_id, "sched-a", T0 + 0.1)

    assert released.state is LeaseState.RELEASED
    assert released.ended_at == T0 + 0.1
    assert ledger.free() == CAPACITY
    with pytest.raises(IllegalTransitionError, match="released -> released"):
        ledger.release(temp.lease_id, "sched-a", T0 + 0.2)
    assert ledger.free() == CAPACITY
    assert ledger.expire_due(T0 + 100) == []
    assert ledger.free() == CAPACITY


def test_expire_due_ends_only_overdue_leases_and_returns_them(ledger: LeaseLedger) -> None:
    short = ledger.reserve("sched-a", Resources(cpu=1), 0.5, T0)
    long = ledger.reserve("sched-b", Resources(cpu=2), 0.5, T0)
    ledger.activate(long.lease_id, "sched-b", 10.0, T0)

    assert ledger.expire_due(T0 + 0.4) == []
    first = ledger.expire_due(T0 + 0.5)

    assert [(lease.lease_id, lease.state) for lease in first] == [(short.lease_id, LeaseState.EXPIRED)]
    assert ledger.free() == CAPACITY - Resources(cpu=2)
    assert ledger.next_expiry() == T0 + 10.0

    second = ledger.expire_due(T0 + 20)

    assert [lease.lease_id for lease in second] == [long.lease_id]
    assert ledger.free() == CAPACITY
    assert ledger.expire_due(T0 + 30) == []
    assert ledger.free() == CAPACITY
    assert ledger.next_expiry() is None


def test_an_expired_lease_cannot_be_released_afterwards(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0)
    ledger.expire_due(T0 + 1)

    with pytest.raises(IllegalTransitionError, match="expired -> released"):
        ledger.release(temp.lease_id, "sched-a", T0 + 1)
    assert ledger.free() == CAPACITY


def test_ended_leases_are_forgotten_beyond_the_history_bound() -> None:
    ledger = LeaseLedger(CAPACITY, history_size=3)
    ids = [ledger.reserve("s", Resources(cpu=1), 1, T0).lease_id for _ in range(5)]
    for lease_id in ids:
        ledger.release(lease_id, "s", T0)

    assert [lease.lease_id for lease in ledger.history()] == ids[2:]
    with pytest.raises(NotFoundError):
        ledger.get(ids[0])
    with pytest.raises(IllegalTransitionError):
        ledger.release(ids[4], "s", T0)


def test_lease_to_proto_carries_state_and_expiry(ledger: LeaseLedger) -> None:
    temp = ledger.reserve("sched-a", HALF, 0.5, T0, price=2.5, executor=ExecutorKind.DILOCO_TRAINER)
    lease = ledger.activate(temp.lease_id, "sched-a", 10.0, T0)

    msg = lease.to_proto(worker_id="worker-1")

    assert msg.state == common_pb2.LEASE_STATE_ACTIVE
    assert msg.scheduler_id == "sched-a"
    assert msg.worker_id == "worker-1"
    assert msg.executor == common_pb2.EXECUTOR_KIND_DILOCO_TRAINER
    assert msg.expires_at.seconds == int(T0 + 10)
    assert Resources.from_proto(msg.resources) == HALF
