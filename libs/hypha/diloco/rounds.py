"""The parameter server's rounds: who must send a delta, when a round may close, what is late.

One ``Round`` per synchronisation point::

    collecting --close()--> aggregating --publish()--> published
        |                        |
        +------fail()------------+-------------------> failed

A round collects at most one delta from each expected worker. It is *ready*
when every expected worker has sent one, or when its deadline has passed and a
quorum has. Anything for a round that has moved past ``collecting`` is late
and dropped with a reason (never an error: a slow worker is normal, it pulls
the new θ_global and carries on).

Decisions (NOTE):
- The deadline counts from the *first* delta of the round, not from the round's
  start: how long a round lasts varies (model download, data, batch sizes),
  while the scheduler aligns arrivals, so ``round_timeout_s`` is the grace
  given to stragglers once the first worker is done. Before any delta arrives
  the round has no deadline.
- A deadline that passes without quorum *extends* the round: it keeps
  collecting and completes as soon as quorum is met (``stalled`` reports the
  situation, so the scheduler can replace lost workers, who then join this very
  round). With ``give_up_after_s`` set, the round fails that long after its
  deadline and ``maybe_complete`` raises ``QuorumNotMetError``: the job has
  lost too many workers to go on.
- Deltas are aggregated in worker-id order, not arrival order, so the float
  sums, and therefore θ_global, do not depend on network timing.
- A delta holding NaN or infinity is refused while its round is aggregated,
  not when it arrives (``server_core``).

``server_core.ParameterServerCore`` runs the rounds one after another with the
outer optimizer. Everything here is synchronous and takes ``now`` as an
argument (seconds on any monotonic clock); the servicer owns the clock, the
locking and the network.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch

from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    PermissionDeniedError,
)

Delta = Mapping[str, torch.Tensor]
#: A fraction of the expected workers (float in (0, 1]) or a worker count (int >= 1).
Quorum = float | int


class RoundState(StrEnum):
    COLLECTING = "collecting"  # accepting deltas from expected workers
    AGGREGATING = "aggregating"  # closed; the outer step is running
    PUBLISHED = "published"  # the new θ_global is out; terminal for this round
    FAILED = "failed"  # abandoned (no quorum in time, or the step failed); terminal


_TRANSITIONS: dict[RoundState, frozenset[RoundState]] = {
    RoundState.COLLECTING: frozenset({RoundState.AGGREGATING, RoundState.FAILED}),
    RoundState.AGGREGATING: frozenset({RoundState.PUBLISHED, RoundState.FAILED}),
    RoundState.PUBLISHED: frozenset(),
    RoundState.FAILED: frozenset(),
}


class QuorumNotMetError(FailedPreconditionError):
    """A round's deadline and grace passed without enough deltas; the job cannot continue."""


@dataclass(frozen=True)
class DeltaReceipt:
    """What happened to one delta; ``reason`` says why a delta was dropped (empty when accepted)."""

    accepted: bool
    round_number: int
    reason: str = ""


def quorum_count(quorum: Quorum, expected: int) -> int:
    """How many deltas satisfy ``quorum`` among ``expected`` workers (at least 1, at most all)."""
    if isinstance(quorum, bool) or not isinstance(quorum, int | float):
        raise InvalidArgumentError(f"quorum must be a fraction or a worker count, got {quorum!r}")
    if isinstance(quorum, float):
        if not 0 < quorum <= 1:
            raise InvalidArgumentError(f"a quorum fraction must be in (0, 1], got {quorum}")
        # The epsilon keeps 0.75 * 4 from rounding up to 4 through float error.
        return max(1, min(expected, math.ceil(quorum * expected - 1e-9)))
    if quorum < 1:
        raise InvalidArgumentError(f"a quorum count must be >= 1, got {quorum}")
    return min(quorum, expected)


class Round:
    """One synchronisation round: the expected workers, their deltas, the deadline and the state."""

    def __init__(self, number: int, expected: Iterable[str], deadline: float, quorum: Quorum) -> None:
        workers = set(expected)
        if not workers:
            raise InvalidArgumentError("a round needs at least one expected worker")
        if number < 0:
            raise InvalidArgumentError(f"round numbers start at 0, got {number}")
        self.number = number
        self.deadline = deadline
        self.quorum = quorum
        self.quorum_needed = quorum_count(quorum, len(workers))
        self.state = RoundState.COLLECTING
        self.failure = ""
        self._expected = workers
        self._replaced: set[str] = set()
        self._deltas: dict[str, tuple[Delta, int]] = {}

    # ---- read side -----------------------------------------------------------------------

    @property
    def expected(self) -> frozenset[str]:
        return frozenset(self._expected)

    @property
    def arrived(self) -> frozenset[str]:
        return frozenset(self._deltas)

    @property
    def missing(self) -> frozenset[str]:
        return frozenset(self._expected - self._deltas.keys())

    @property
    def samples(self) -> int:
        return sum(samples for _, samples in self._deltas.values())

    @property
    def quorum_met(self) -> bool:
        return len(self._deltas) >= self.quorum_needed

    def ready(self, now: float) -> bool:
        """True when the round may close: everyone arrived, or the deadline passed with quorum."""
        if self.state is not RoundState.COLLECTING:
            return False
        if not self.missing:
            return True
        return now >= self.deadline and self.quorum_met

    def stalled(self, now: float) -> bool:
        """True while the deadline has passed without quorum (the round is waiting on lost workers)."""
        return self.state is RoundState.COLLECTING and now >= self.deadline and not self.quorum_met

    # ---- write side ----------------------------------------------------------------------

    def transition(self, target: RoundState) -> None:
        if target not in _TRANSITIONS[self.state]:
            raise IllegalTransitionError("round", self.state, target)
        self.state = target

    def admission(self, worker: str, samples: int) -> str | None:
        """Why a delta from ``worker`` would be dropped (a reason), None if it would be accepted.

        Raises for deltas that are wrong rather than late: an unknown worker
        (PermissionDeniedError), a second delta (AlreadyExistsError), a
        non-positive sample count (InvalidArgumentError).
        """
        if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
            raise InvalidArgumentError(f"a delta must cover a positive number of samples, got {samples!r}")
        if self.state is not RoundState.COLLECTING:
            return f"late: round {self.number} is already {self.state}"
        if worker in self._replaced and worker not in self._expected:
            return f"worker {worker} was replaced in round {self.number}"
        if worker not in self._expected:
            raise PermissionDeniedError(f"worker {worker} is not part of round {self.number}")
        if worker in self._deltas:
            raise AlreadyExistsError(f"worker {worker} already sent its delta for round {self.number}")
        return None

    def add_delta(self, worker: str, samples: int, delta: Delta, now: float) -> DeltaReceipt:
        """Record ``worker``'s delta, or drop it with a reason when it is late (see ``admission``).

        ``now`` is accepted for symmetry with the other time-dependent calls; a
        delta that arrives after the deadline but before the round closes is
        still taken, since it only adds information.
        """
        del now
        reason = self.admission(worker, samples)
        if reason is not None:
            return DeltaReceipt(accepted=False, round_number=self.number, reason=reason)
        self._deltas[worker] = (delta, samples)
        return DeltaReceipt(accepted=True, round_number=self.number)

    def set_deadline(self, deadline: float) -> None:
        if self.state is not RoundState.COLLECTING:
            raise FailedPreconditionError(f"round {self.number} is {self.state}; its deadline is final")
        self.deadline = deadline

    def replace(self, old: str, new: str) -> bool:
        """Let ``new`` deliver in ``old``'s place if ``old`` has not delivered yet; True if it did."""
        if self.state is not RoundState.COLLECTING or old not in self._expected or old in self._deltas:
            return False
        if new in self._expected:
            raise AlreadyExistsError(f"worker {new} is already part of round {self.number}")
        self._expected.discard(old)
        self._expected.add(new)
        self._replaced.add(old)
        return True

    def drop(self, worker: str) -> bool:
        """``worker`` left the job (elastic shrink): the round stops waiting for it; True if it did.

        A delta it already delivered stays (it is real work, weighted by its samples)."""
        if self.state is not RoundState.COLLECTING or worker not in self._expected or worker in self._deltas:
            return False
        if len(self._expected) == 1:
            return False  # a round needs someone to wait for; the next round has the new set
        self._expected.discard(worker)
        self.quorum_needed = quorum_count(self.quorum, len(self._expected))
        return True

    def join(self, worker: str) -> bool:
        """``worker`` joins the job now (elastic growth) and delivers in this round; True if it may."""
        if self.state is not RoundState.COLLECTING or worker in self._expected:
            return False
        self._expected.add(worker)
        self.quorum_needed = quorum_count(self.quorum, len(self._expected))
        return True

    def refuse(self, worker: str) -> None:
        """Forget ``worker``'s delta (found bad while aggregating): it is missing again."""
        if self.state is not RoundState.COLLECTING:
            raise FailedPreconditionError(f"round {self.number} is {self.state}; its deltas are final")
        del self._deltas[worker]

    def contributions(self) -> list[tuple[str, Delta, int]]:
        """The workers with their deltas and samples, in worker-id order (see module NOTE)."""
        return [(worker, *self._deltas[worker]) for worker in sorted(self._deltas)]

    def close(self) -> list[tuple[Delta, int]]:
        """Stop collecting; the deltas with their samples, in worker-id order (see module NOTE)."""
        self.transition(RoundState.AGGREGATING)
        return [(delta, samples) for _, delta, samples in self.contributions()]

    def publish(self) -> None:
        self.transition(RoundState.PUBLISHED)
        self._deltas.clear()  # the arithmetic is done; free the memory of every delta

    def fail(self, reason: str) -> None:
        self.transition(RoundState.FAILED)
        self.failure = reason
        self._deltas.clear()
