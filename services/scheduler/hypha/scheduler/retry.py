"""Task attempts: how one ended (``Outcome``) and whether another follows (``RetryPolicy``).

A task attempt ends with an ``Outcome``; ``RetryPolicy.decide`` says whether
another attempt follows and when. Decisions (``NOTE``):

- Attempts are numbered from 1; ``max_attempts`` counts all of them (3 means
  the first run plus at most two retries).
- A non-zero exit (or a missing completion marker) is retried while attempts
  remain; a timeout only with ``retry_on_timeout``; a lost worker (lease lost,
  worker died, scheduler restarted) only with ``retry_on_worker_loss``. A
  cancelled task is never retried.
- Backoff before attempt n+1 is ``min(cap, base * 2**(n-1))``, reduced by a
  random share of up to ``jitter`` (default 20%) so that tasks failing
  together do not come back together; never above the cap. Time and
  randomness are injected, so tests drive both.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum

from hypha.errors import InvalidArgumentError
from hypha.v1 import common_pb2, scheduler_pb2


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # non-zero exit, or no completion marker
    TIMED_OUT = "timed out"
    WORKER_LOST = "lost its worker"
    CANCELLED = "was cancelled"

    @classmethod
    def from_report(cls, state: int, exit_code: int = 0) -> Outcome:
        """The outcome a worker's ``JobStatusReport`` describes."""
        mapping = {
            int(scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED): cls.SUCCEEDED,
            int(scheduler_pb2.EXECUTION_STATE_REPORT_FAILED): cls.FAILED,
            int(scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED): cls.CANCELLED,
            int(scheduler_pb2.EXECUTION_STATE_REPORT_TIMED_OUT): cls.TIMED_OUT,
        }
        outcome = mapping.get(int(state))
        if outcome is None:
            raise InvalidArgumentError(f"execution state {state} is not a final outcome")
        if outcome is cls.SUCCEEDED and exit_code != 0:
            return cls.FAILED
        return outcome


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    #: When the next attempt may start (only when ``retry``).
    at: float = 0.0
    delay_s: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 60.0
    retry_on_timeout: bool = True
    retry_on_worker_loss: bool = True
    #: Largest share of the delay removed at random.
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgumentError("retry.max_attempts must be at least 1")
        if not (math.isfinite(self.backoff_base_s) and self.backoff_base_s >= 0):
            raise InvalidArgumentError("retry.backoff_base_s must be a non-negative number")
        if not (math.isfinite(self.backoff_cap_s) and self.backoff_cap_s >= self.backoff_base_s):
            raise InvalidArgumentError("retry.backoff_cap_s must be at least backoff_base_s")
        if not 0.0 <= self.jitter < 1.0:
            raise InvalidArgumentError("retry jitter must be in [0, 1)")

    @classmethod
    def from_proto(cls, msg: common_pb2.RetryPolicy) -> RetryPolicy:
        return cls(
            max_attempts=msg.max_attempts or 1,
            backoff_base_s=msg.backoff_base_s,
            backoff_cap_s=max(msg.backoff_cap_s, msg.backoff_base_s),
            retry_on_timeout=msg.retry_on_timeout,
            retry_on_worker_loss=msg.retry_on_worker_loss,
        )

    def to_proto(self) -> common_pb2.RetryPolicy:
        return common_pb2.RetryPolicy(
            max_attempts=self.max_attempts,
            backoff_base_s=self.backoff_base_s,
            backoff_cap_s=self.backoff_cap_s,
            retry_on_timeout=self.retry_on_timeout,
            retry_on_worker_loss=self.retry_on_worker_loss,
        )

    def backoff_s(self, attempt: int) -> float:
        """Delay before the attempt after ``attempt``, without jitter."""
        if attempt < 1:
            raise InvalidArgumentError("attempts are numbered from 1")
        # Exponent capped so huge attempt numbers cannot overflow.
        return min(self.backoff_cap_s, self.backoff_base_s * 2.0 ** min(attempt - 1, 64))

    def retries(self, outcome: Outcome) -> bool:
        """Whether this kind of ending is retried at all (attempts aside)."""
        if outcome is Outcome.FAILED:
            return True
        if outcome is Outcome.TIMED_OUT:
            return self.retry_on_timeout
        if outcome is Outcome.WORKER_LOST:
            return self.retry_on_worker_loss
        return False

    def decide(
        self, attempt: int, outcome: Outcome, now: float, rng: random.Random | None = None
    ) -> RetryDecision:
        """After attempt number ``attempt`` ended with ``outcome`` at ``now``: retry, and when?"""
        if outcome is Outcome.SUCCEEDED:
            return RetryDecision(False, reason=f"attempt {attempt} succeeded")
        if not self.retries(outcome):
            return RetryDecision(False, reason=f"attempt {attempt} {outcome.value}; not retried")
        if attempt >= self.max_attempts:
            return RetryDecision(
                False, reason=f"attempt {attempt} {outcome.value}; no retries left ({self.max_attempts} max)"
            )
        delay = self.backoff_s(attempt)
        if self.jitter and delay > 0:
            delay *= 1.0 - self.jitter * (rng or random).random()
        return RetryDecision(
            True,
            at=now + delay,
            delay_s=delay,
            reason=f"attempt {attempt} {outcome.value}; retry in {delay:.1f}s",
        )


#: How a task attempt ended: the outcome, the exit code, what the worker said.
AttemptEnd = tuple[Outcome, int, str]


def attempt_end(state: int, exit_code: int, message: str) -> AttemptEnd:
    """A worker's final report as an attempt's end.

    NOTE: a worker only cancels on its own when it goes away (shutdown, its
    lease ended): for the job that is a lost worker, not a client's cancel.
    """
    outcome = Outcome.from_report(state, exit_code)
    if outcome is Outcome.CANCELLED:
        outcome = Outcome.WORKER_LOST
    return outcome, exit_code, message
