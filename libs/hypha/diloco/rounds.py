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
- A delta holding NaN or infinity (which would poison θ_global for every
  worker) is found while the round is aggregated, not when it arrives: the
  check rides on the weighted sum instead of reading every delta once more
  (docs/performance.md). ``maybe_complete`` then refuses only the culprits,
  exactly as if they had never arrived (their workers are missing again and
  may send a good delta), and completes the round if it is still ready. A
  refusal is logged and kept in ``ParameterServerCore.refused``.

Everything here is synchronous and takes ``now`` as an argument (seconds on any
monotonic clock); the servicer owns the clock, the locking and the network.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from hypha.diloco.outer import NesterovOuter, NonFiniteDeltaError
from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from hypha.tensors.payload import check_template

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class RoundUpdate:
    """The outcome of a completed round, what the server publishes to every trainer."""

    round_number: int
    #: The new θ_global, a snapshot (trainers set their parameters to it).
    params: dict[str, torch.Tensor]
    contributors: tuple[str, ...]
    #: Expected workers whose deltas did not make it (their later deltas are dropped).
    missing: tuple[str, ...]
    samples: int
    #: The streaming fragment this round stepped (``params`` holds only its tensors); None: all.
    fragment: int | None = None

    @property
    def next_round(self) -> int:
        return self.round_number + 1


@dataclass(frozen=True)
class RefusedDelta:
    """A delta refused while its round was aggregated (it held NaN or infinity)."""

    round_number: int
    worker: str
    reason: str


@dataclass(frozen=True)
class GlobalState:
    """θ_global for a late or replacement worker, and the round it was current for."""

    round_number: int
    params: dict[str, torch.Tensor]
    outer_steps: int


class ParameterServerCore:
    """Rounds plus the outer optimizer: everything a parameter server decides, without I/O.

    ``expected`` is the set for upcoming rounds; each round keeps its own copy,
    so ``replace_worker`` changes the future without rewriting the past (and
    the current round too when the replaced worker has not delivered yet).

    With ``fragments`` (streaming DiLoCo, ``hypha.diloco.streaming``) round r
    collects and steps fragment ``r mod F`` only: its deltas hold exactly that
    fragment's tensors and the update holds the fragment's new θ_global.
    """

    def __init__(
        self,
        outer: NesterovOuter,
        expected: Iterable[str],
        round_timeout_s: float,
        quorum: Quorum,
        *,
        round_number: int = 0,
        give_up_after_s: float | None = None,
        reject_non_finite: bool = True,
        fragments: Sequence[Sequence[str]] | None = None,
    ) -> None:
        if not round_timeout_s > 0:
            raise InvalidArgumentError(f"round_timeout_s must be > 0, got {round_timeout_s}")
        if give_up_after_s is not None and give_up_after_s < 0:
            raise InvalidArgumentError(f"give_up_after_s must be >= 0, got {give_up_after_s}")
        self.outer = outer
        self.round_timeout_s = float(round_timeout_s)
        self.quorum = quorum
        self.give_up_after_s = give_up_after_s
        self.reject_non_finite = reject_non_finite
        #: The latest deltas refused while aggregating (bounded: a broken worker may keep sending).
        self.refused: deque[RefusedDelta] = deque(maxlen=64)
        self._expected = set(expected)
        self._template = {name: tuple(t.shape) for name, t in outer.parameters().items()}
        self.fragments: list[list[str]] | None = None
        if fragments is not None and len(fragments) > 1:
            seen = [name for group in fragments for name in group]
            if sorted(seen) != sorted(self._template) or len(seen) != len(set(seen)) or not all(fragments):
                raise InvalidArgumentError("fragments must cover every parameter exactly once")
            self.fragments = [list(group) for group in fragments]
        self._round = self._new_round(round_number)

    @property
    def round_number(self) -> int:
        """The round currently collecting (or the one that failed)."""
        return self._round.number

    @property
    def current_round(self) -> Round:
        return self._round

    @property
    def expected(self) -> frozenset[str]:
        """The workers expected in upcoming rounds."""
        return frozenset(self._expected)

    def fragment_of(self, round_number: int) -> int | None:
        """The streaming fragment round ``round_number`` syncs (None: the whole model)."""
        return None if self.fragments is None else round_number % len(self.fragments)

    def fragment_names(self, round_number: int) -> list[str] | None:
        """The parameter names round ``round_number``'s deltas and update hold (None: all)."""
        fragment = self.fragment_of(round_number)
        return None if fragment is None or self.fragments is None else list(self.fragments[fragment])

    def add_delta(
        self, worker: str, round_number: int, samples: int, delta: Delta, now: float
    ) -> DeltaReceipt:
        """Take a delta for ``round_number``; late ones come back as a dropped receipt.

        Raises FailedPreconditionError for a round that has not started,
        PermissionDeniedError / AlreadyExistsError as ``Round.admission`` does,
        and InvalidArgumentError for a delta whose names, shapes or dtypes do
        not fit θ_global's. NaN and infinity are found when the round is
        aggregated (see the module NOTE and ``maybe_complete``).
        """
        current = self._round
        if round_number < current.number:
            return DeltaReceipt(
                accepted=False,
                round_number=round_number,
                reason=f"late: round {round_number} is over; the current round is {current.number}",
            )
        if round_number > current.number:
            raise FailedPreconditionError(
                f"round {round_number} has not started; the current round is {current.number}"
            )
        if worker not in current.expected and worker in self._expected:
            return DeltaReceipt(
                accepted=False,
                round_number=round_number,
                reason=f"worker {worker} joins in round {current.number + 1}",
            )
        reason = current.admission(worker, samples)
        if reason is not None:
            return DeltaReceipt(accepted=False, round_number=round_number, reason=reason)
        self._check_delta(delta, round_number)
        receipt = current.add_delta(worker, samples, delta, now)
        if receipt.accepted and len(current.arrived) == 1:
            current.set_deadline(now + self.round_timeout_s)
        return receipt

    def maybe_complete(self, now: float) -> RoundUpdate | None:
        """Close, aggregate and publish the current round if it is ready; start the next one.

        Returns None while the round is still collecting, which includes a
        round that stopped being ready because deltas holding NaN or infinity
        were refused (see the module NOTE). Raises QuorumNotMetError once a
        stalled round has outlived ``give_up_after_s``.
        """
        while True:
            current = self._round
            if current.state is RoundState.FAILED:
                raise QuorumNotMetError(current.failure)
            if not current.ready(now):
                self._give_up_if_stalled(current, now)
                return None
            update = self._aggregate(current)
            if update is not None:
                return update

    def _give_up_if_stalled(self, current: Round, now: float) -> None:
        if (
            self.give_up_after_s is not None
            and current.stalled(now)
            and now >= current.deadline + self.give_up_after_s
        ):
            current.fail(
                f"round {current.number}: {len(current.arrived)} of {len(current.expected)} deltas, "
                f"quorum {current.quorum_needed}, still missing {sorted(current.missing)} "
                f"{self.give_up_after_s:g}s after the deadline"
            )
            raise QuorumNotMetError(current.failure)

    def _aggregate(self, current: Round) -> RoundUpdate | None:
        """Step the outer optimizer with ``current``'s deltas and publish; None if some were refused."""
        contributors = tuple(sorted(current.arrived))
        missing = tuple(sorted(current.missing))
        samples = current.samples
        contributions = current.contributions()
        try:
            params = self.outer.step_average(
                [(delta, n) for _, delta, n in contributions],
                self.fragment_names(current.number),
                reject_non_finite=self.reject_non_finite,
            )
        except NonFiniteDeltaError as exc:
            for position, name in sorted(exc.culprits.items()):
                worker = contributions[position][0]
                reason = f"delta tensor {name!r} holds NaN or infinity"
                current.refuse(worker)
                self.refused.append(RefusedDelta(current.number, worker, reason))
                logger.warning("delta from %s for round %d refused: %s", worker, current.number, reason)
            return None
        except Exception as exc:
            current.fail(f"round {current.number}: outer step failed: {exc}")
            raise
        current.close()
        current.publish()
        update = RoundUpdate(
            round_number=current.number,
            params={name: t.clone() for name, t in params.items()},
            contributors=contributors,
            missing=missing,
            samples=samples,
            fragment=self.fragment_of(current.number),
        )
        self._round = self._new_round(current.number + 1)
        return update

    def stalled(self, now: float) -> bool:
        return self._round.stalled(now)

    def global_state(self) -> GlobalState:
        """A snapshot of θ_global for a late or replacement worker (see ``round_for``)."""
        return GlobalState(
            round_number=self._round.number,
            params={name: t.clone() for name, t in self.outer.parameters().items()},
            outer_steps=self.outer.steps,
        )

    def round_for(self, worker: str) -> int:
        """The round a (joining) worker should train for and send its next delta to."""
        current = self._round
        if worker in current.expected and worker not in current.arrived:
            return current.number
        return current.number + 1

    def replace_worker(self, old: str, new: str) -> bool:
        """Put ``new`` in ``old``'s place for upcoming rounds; True if it also joins the current round.

        It joins the current round only when ``old`` has not delivered there
        yet, so a stalled round can be completed by the replacement.
        """
        if old not in self._expected:
            raise NotFoundError(f"worker {old} is not part of this job")
        if new in self._expected:
            raise AlreadyExistsError(f"worker {new} is already part of this job")
        self._expected.discard(old)
        self._expected.add(new)
        return self._round.replace(old, new)

    def set_workers(self, workers: Iterable[str], *, delivering: str = "") -> tuple[list[str], list[str]]:
        """The job's trainers are now ``workers`` (elastic scaling): (added, removed).

        Workers gone since the last set first hand their places to newcomers
        (``replace_worker``: a replacement may deliver in the current round);
        further newcomers join from the next round, except ``delivering``
        (the one whose delta is at hand), which joins the current one; further
        leavers are no longer waited for in the current round (``Round.drop``).
        """
        wanted = set(workers)
        if not wanted:
            raise InvalidArgumentError("a job needs at least one trainer")
        gone = sorted(self._expected - wanted)
        new = sorted(wanted - self._expected)
        for old, newcomer in zip(gone, new, strict=False):
            self.replace_worker(old, newcomer)
        added, removed = new[len(gone) :], gone[len(new) :]
        self._expected.update(added)
        if delivering in added:
            self._round.join(delivering)
        for worker in removed:
            self._expected.discard(worker)
            self._round.drop(worker)
        return added, removed

    def _new_round(self, number: int) -> Round:
        # No deadline until the first delta arrives (see the module NOTE).
        return Round(number, self._expected, math.inf, self.quorum)

    def _check_delta(self, delta: Delta, round_number: int) -> None:
        names = self.fragment_names(round_number)
        template = self._template if names is None else {n: self._template[n] for n in names}
        check_template(delta, template, what="delta")
        for name, tensor in delta.items():
            if not tensor.is_floating_point():
                raise InvalidArgumentError(f"delta tensor {name!r} is {tensor.dtype}, not floating point")
        # NaN and infinity are not scanned for here: the weighted sum finds them (module NOTE).
