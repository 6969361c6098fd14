"""The parameter server's decisions, free of I/O: rounds one after another, and the outer step.

``ParameterServerCore`` keeps the current ``rounds.Round``, the workers expected
in the next ones, and the outer optimizer (``outer.NesterovOuter``); when a round
is ready it aggregates its deltas and steps θ_global, and says what to publish
(``RoundUpdate``). Split from ``rounds`` (one round's state machine).

Decisions (NOTE):
- A delta holding NaN or infinity (which would poison θ_global for every
  worker) is found while the round is aggregated, not when it arrives: the
  check rides on the weighted sum instead of reading every delta once more
  (docs/performance.md). ``maybe_complete`` then refuses only the culprits,
  exactly as if they had never arrived (their workers are missing again and
  may send a good delta), and completes the round if it is still ready. A
  refusal is logged and kept in ``ParameterServerCore.refused``.

Everything here is synchronous and takes ``now`` as an argument; the executor
(``hypha.worker.executors.parameter_server``) owns the clock and the I/O.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from hypha.diloco.outer import NesterovOuter, NonFiniteDeltaError
from hypha.diloco.rounds import Delta, DeltaReceipt, Quorum, QuorumNotMetError, Round, RoundState
from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from hypha.tensors.payload import check_template

logger = logging.getLogger(__name__)


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
