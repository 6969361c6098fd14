"""The reconnect pacing (``net/backoff.py``) and the role table (``net/policy.py``), tested directly."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hypha.net import policy
from hypha.net.backoff import Backoff
from hypha.net.link import NodeLink
from hypha.pki.identity import Role
from hypha.testing.pki import Pki


def test_the_link_backs_off_from_100_ms_doubling_to_5_s_as_the_readme_says(pki: Pki) -> None:
    # README "Gateway failover": jittered exponential backoff, 100 ms doubling to 5 s.
    link = NodeLink(pki.tls("worker"), ["127.0.0.1:1"])
    assert (link._backoff.base_s, link._backoff.cap_s) == (0.1, 5.0)


@given(seed=st.integers(0, 2**32 - 1))
def test_each_delay_lies_in_the_upper_half_of_its_doubling_step_up_to_the_cap(seed: int) -> None:
    backoff = Backoff(0.1, 5.0, rng=random.Random(seed))
    for attempt in range(12):
        step = min(5.0, 0.1 * 2**attempt)
        assert step / 2 <= backoff.next_delay() <= step


def test_delays_are_jittered_not_in_lockstep() -> None:
    # Many nodes losing the same gateway must not reconnect in one wave.
    firsts = {Backoff(0.1, 5.0, rng=random.Random(seed)).next_delay() for seed in range(50)}
    assert len(firsts) == 50


def test_reset_starts_again_from_the_base_delay() -> None:
    backoff = Backoff(0.1, 5.0, rng=random.Random(1))
    for _ in range(10):
        backoff.next_delay()
    assert backoff.next_delay() > 2.5  # at the cap by now
    backoff.reset()
    assert backoff.next_delay() <= 0.1


@pytest.mark.parametrize(
    ("method", "allowed"),
    [
        # A method rule: only schedulers hold leases.
        ("/hypha.v1.Worker/RenewLease", {Role.SCHEDULER}),
        # A service rule covers every method of the service.
        ("/hypha.v1.SchedulerControl/Anything", {Role.WORKER}),
        ("/grpc.health.v1.Health/Check", set(Role)),
        # Only gateways federate; every node may attach.
        ("/hypha.v1.Gateway/Federate", {Role.GATEWAY}),
    ],
)
def test_a_method_rule_or_else_its_service_rule_decides(method: str, allowed: set[Role]) -> None:
    assert policy.allowed_roles(method) == allowed
    for role in Role:
        assert policy.is_allowed(method, role) == (role in allowed)


@pytest.mark.parametrize(
    "method",
    ["/hypha.v1.Worker/NewMethodNobodyRuledOn", "/hypha.v1.Unknown/Call", "", "no-slashes"],
)
def test_unknown_methods_are_denied_to_every_role(method: str) -> None:
    assert policy.allowed_roles(method) == frozenset()
    assert not any(policy.is_allowed(method, role) for role in Role)


def test_every_rpc_of_our_services_has_a_rule() -> None:
    # Default deny makes a forgotten rule an outage: each served method must be ruled on.
    from hypha.v1 import data_pb2, gateway_pb2, scheduler_pb2, worker_pb2

    for module in (data_pb2, gateway_pb2, scheduler_pb2, worker_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                name = f"/{service.full_name}/{method.name}"
                assert policy.allowed_roles(name), f"no role may call {name}"
