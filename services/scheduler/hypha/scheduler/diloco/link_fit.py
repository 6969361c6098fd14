"""Samples per round fitted to the link: a round's exchange hidden behind its compute.

A round costs its compute (proportional to its samples) plus the wait for its
exchange (Δ up, the update down: set by the bytes and the link, not by the
samples). On a fast link few samples a round keep DiLoCo close to data
parallel's sample efficiency; on a slow one the wait would dominate, and more
samples a round amortize it. With ``max_samples_per_round`` above the job's
``samples_per_round``, the scheduler picks each round's samples between the
two from what the trainers measured (``sync_idle_seconds`` and the samples and
samples per second of each round's metrics): the smallest round whose wait is
at most ``idle_share`` of its compute.

How ``LinkFit`` decides (pure; the run feeds it each trainer's round metrics):

- a round, once the next one's first metrics come, gives its samples (all
  trainers'), its compute (the longest trainer's samples ÷ samples per
  second) and its wait (the longest ``sync_idle_seconds``);
- the wait does not grow with the samples, so the round that would have
  waited ``idle_share`` of its compute has ``samples * (wait ÷ compute) ÷
  idle_share`` samples; that figure is smoothed over rounds (``alpha``) and
  kept within [``samples_per_round``, ``max_samples_per_round``];
- a change under ``hysteresis`` of the current value is not made, so a noisy
  link does not move every round's plan.

Decisions (NOTE):
- The job's ``rounds`` stays the number of syncs: a job on a slow link trains
  on more samples in all (at most ``max ÷ samples_per_round`` times). A user
  who wants a fixed sample budget sets ``rounds`` for the slow case.
- A new size applies to the plans made from then on: the round in progress
  too, if its sync point is not planned yet.
- The chosen size and the smoothed figure are part of the run's saved state
  (``saved``, ``restore``): a restarted scheduler goes on from the size the link
  asked for instead of starting again at ``samples_per_round``. The round that
  was open is not: its reports come again, or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from hypha.errors import InvalidArgumentError
from hypha.scheduler.diloco.round_planner import Planner
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)

#: The wait a fitted round aims for, as a share of its compute.
DEFAULT_IDLE_SHARE = 0.05
#: Weight of the newest round in the smoothed wait share.
DEFAULT_ALPHA = 0.5
#: Relative change below which the samples per round stay as they are.
DEFAULT_HYSTERESIS = 0.1


@dataclass
class _Round:
    """What a round's trainers reported: samples in all, the longest compute and wait."""

    number: int
    samples: float = 0.0
    compute_s: float = 0.0
    idle_s: float = 0.0


@dataclass
class LinkFit:
    """The samples per round of one job, between its floor and ceiling (module doc)."""

    floor: int
    ceiling: int
    idle_share: float = DEFAULT_IDLE_SHARE
    alpha: float = DEFAULT_ALPHA
    hysteresis: float = DEFAULT_HYSTERESIS
    #: The samples per round now chosen.
    samples: int = 0
    #: The smoothed samples per round the measured rounds asked for (None before one is folded).
    wanted: float | None = None
    _open: _Round | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < self.floor:
            raise InvalidArgumentError(
                f"samples per round [{self.floor}, {self.ceiling}] is not a range of positive counts"
            )
        if not 0.0 < self.idle_share < 1.0 or not 0.0 < self.alpha <= 1.0:
            raise InvalidArgumentError("idle_share must be in (0, 1) and alpha in (0, 1]")
        self.samples = self.samples or self.floor

    def observe(self, round_: int, idle_s: float, samples: float, samples_per_second: float) -> int | None:
        """One trainer's round metrics; the new samples per round when they change (else None)."""
        if samples <= 0 or samples_per_second <= 0 or idle_s < 0:
            return None
        done = None
        if self._open is not None and round_ > self._open.number:
            done, self._open = self._open, None
        if self._open is None:
            self._open = _Round(round_)
        elif round_ < self._open.number:
            return None  # a late report of a round already folded
        current = self._open
        current.samples += samples
        current.compute_s = max(current.compute_s, samples / samples_per_second)
        current.idle_s = max(current.idle_s, idle_s)
        return None if done is None else self._refit(done)

    def saved(self) -> dict[str, float]:
        """What a restarted scheduler needs to go on (JSON-able; ``restore``)."""
        return {"samples": self.samples} | ({} if self.wanted is None else {"wanted": self.wanted})

    def restore(self, saved: Mapping[str, float]) -> int:
        """Go on from a saved fit (``saved``), kept within this job's range; the samples per round."""
        self.samples = max(self.floor, min(self.ceiling, int(saved.get("samples", self.samples))))
        wanted = saved.get("wanted")
        self.wanted = None if wanted is None else float(wanted)
        return self.samples

    def _refit(self, done: _Round) -> int | None:
        if done.compute_s <= 0:
            return None
        asked = done.samples * (done.idle_s / done.compute_s) / self.idle_share
        self.wanted = asked if self.wanted is None else self.alpha * asked + (1 - self.alpha) * self.wanted
        chosen = max(self.floor, min(self.ceiling, round(self.wanted)))
        if abs(chosen - self.samples) <= self.hysteresis * self.samples:
            return None
        self.samples = chosen
        return chosen


def link_fit_for(spec: common_pb2.DilocoJobSpec) -> LinkFit | None:
    """The job's fit, None when its rounds all have ``samples_per_round``."""
    floor, ceiling = int(spec.samples_per_round), int(spec.max_samples_per_round)
    return LinkFit(floor, ceiling) if ceiling > floor else None


def resumed(spec: common_pb2.DilocoJobSpec, saved: Mapping[str, object], planner: Planner) -> LinkFit | None:
    """The job's fit after a scheduler restart, from its saved run state (``LinkFit.saved`` under
    ``"link_fit"``); the planner is set to the samples per round it goes on from."""
    fit = link_fit_for(spec)
    kept = saved.get("link_fit")
    if fit is not None and isinstance(kept, Mapping):
        planner.samples_per_round = fit.restore(kept)
    return fit


def refit(
    fit: LinkFit | None, planner: Planner | None, round_: int, values: Mapping[str, float], job_id: str
) -> int | None:
    """A trainer's round metrics to the job's fit; a new size goes to its planner (and is returned)."""
    if fit is None or planner is None or "sync_idle_seconds" not in values:
        return None
    chosen = fit.observe(
        round_, values["sync_idle_seconds"], values.get("samples", 0.0), values.get("samples_per_second", 0.0)
    )
    if chosen is not None:
        log.info("job %s: %d samples a round from now on (fitted to the link)", job_id, chosen)
        planner.samples_per_round = chosen
    return chosen


__all__ = ["DEFAULT_IDLE_SHARE", "LinkFit", "link_fit_for", "refit", "resumed"]
