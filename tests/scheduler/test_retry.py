"""Task retries follow the policy's exponential backoff; a worker's report says how an attempt ended."""

from __future__ import annotations

import random

import pytest

from hypha.errors import InvalidArgumentError
from hypha.scheduler.retry import Outcome, RetryPolicy, attempt_end
from hypha.v1 import common_pb2, scheduler_pb2


class NoJitter(random.Random):
    def random(self) -> float:
        return 0.0


def test_a_failing_task_is_retried_on_the_backoff_schedule_until_attempts_run_out() -> None:
    # Prepare: a task whose every attempt fails at once, at the time the last decision allowed.
    policy, rng = RetryPolicy(max_attempts=5, backoff_base_s=2.0, backoff_cap_s=10.0), NoJitter()
    now, started = 0.0, []

    # Execute: follow the decisions as the task job does (PENDING until ``at``).
    while True:
        started.append(now)
        decision = policy.decide(len(started), Outcome.FAILED, now, rng)
        if not decision.retry:
            break
        now = decision.at

    # Assert: delays 2, 4, 8, then capped at 10; five attempts in all.
    assert started == [0.0, 2.0, 6.0, 14.0, 24.0]
    assert "no retries left" in decision.reason


def test_jitter_only_shortens_the_delay_and_stays_within_its_share() -> None:
    policy = RetryPolicy(max_attempts=10, backoff_base_s=1.0, backoff_cap_s=60.0, jitter=0.2)
    rng = random.Random(1)
    for attempt in range(1, 9):
        full = policy.backoff_s(attempt)
        delays = {policy.decide(attempt, Outcome.FAILED, 100.0, rng).delay_s for _ in range(50)}
        assert all(0.8 * full <= d <= full for d in delays)
        assert len(delays) > 1
    assert policy.backoff_s(100) == 60.0  # capped, and no overflow


@pytest.mark.parametrize(
    ("policy", "outcome", "retried"),
    [
        (RetryPolicy(), Outcome.SUCCEEDED, False),
        (RetryPolicy(), Outcome.CANCELLED, False),
        (RetryPolicy(), Outcome.FAILED, True),
        (RetryPolicy(retry_on_timeout=True), Outcome.TIMED_OUT, True),
        (RetryPolicy(retry_on_timeout=False), Outcome.TIMED_OUT, False),
        (RetryPolicy(retry_on_worker_loss=True), Outcome.WORKER_LOST, True),
        (RetryPolicy(retry_on_worker_loss=False), Outcome.WORKER_LOST, False),
        (RetryPolicy(max_attempts=1), Outcome.FAILED, False),
    ],
)
def test_which_endings_are_retried(policy: RetryPolicy, outcome: Outcome, retried: bool) -> None:
    decision = policy.decide(1, outcome, 10.0, NoJitter())
    assert decision.retry is retried
    if retried:
        assert decision.at == 10.0 + policy.backoff_base_s


def test_policy_converts_from_the_job_spec_and_validates() -> None:
    msg = common_pb2.RetryPolicy(max_attempts=4, backoff_base_s=1.5, backoff_cap_s=9, retry_on_timeout=True)
    policy = RetryPolicy.from_proto(msg)
    assert policy.to_proto() == msg
    with pytest.raises(InvalidArgumentError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(InvalidArgumentError):
        RetryPolicy(backoff_base_s=5, backoff_cap_s=1)


def test_worker_reports_map_to_outcomes() -> None:
    r = scheduler_pb2
    assert Outcome.from_report(r.EXECUTION_STATE_REPORT_SUCCEEDED) is Outcome.SUCCEEDED
    assert Outcome.from_report(r.EXECUTION_STATE_REPORT_SUCCEEDED, exit_code=3) is Outcome.FAILED
    assert Outcome.from_report(r.EXECUTION_STATE_REPORT_TIMED_OUT) is Outcome.TIMED_OUT
    with pytest.raises(InvalidArgumentError):
        Outcome.from_report(r.EXECUTION_STATE_REPORT_RUNNING)


def test_a_cancel_the_worker_made_itself_counts_as_a_lost_worker() -> None:
    cancelled = attempt_end(scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED, 0, "lease ended")
    nonzero = attempt_end(scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED, 2, "")

    assert cancelled == (Outcome.WORKER_LOST, 0, "lease ended")
    assert nonzero[0] is Outcome.FAILED
