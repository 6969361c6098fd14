"""DiLoCo rounds in simulation: the equal-batches baseline and a discrete-event run of a planner.

For tests and the ``rounds`` benchmark only: the scheduler itself runs
``hypha.scheduler.diloco.round_planner.RoundPlanner`` against real trainers. The
simulation drives the real planner code (batches are reported, every one
or every so often, and the directives obeyed) with simulated workers of
given speeds, and measures the time each worker idles at the sync points.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hypha.directives import DirectiveKind
from hypha.errors import InvalidArgumentError
from hypha.scheduler.diloco.round_planner import Directive, Planner, Progress


class EqualBatchPlanner:
    """Baseline: every worker runs the same number of batches per round,
    enough for the round's sample budget at the workers' batch sizes."""

    def __init__(self, samples_per_round: int, rounds: int) -> None:
        if samples_per_round < 1 or rounds < 1:
            raise InvalidArgumentError("samples_per_round and rounds must be at least 1")
        self.samples_per_round = samples_per_round
        self.rounds = rounds
        self._sizes: dict[str, int] = {}

    def add_worker(self, worker_id: str, batch_size: int) -> None:
        self._sizes[worker_id] = batch_size

    def remove_worker(self, worker_id: str) -> None:
        self._sizes.pop(worker_id, None)

    def rates(self) -> dict[str, float]:
        """Not measured: the baseline ignores speed."""
        return {}

    def batches_per_round(self) -> int:
        return max(1, math.ceil(self.samples_per_round / max(1, sum(self._sizes.values()))))

    def report(self, worker_id: str, progress: Progress, now: float) -> Directive:
        if progress.round >= self.rounds:
            return Directive(DirectiveKind.DONE, 0, progress.round)
        if worker_id not in self._sizes:
            self._sizes[worker_id] = max(1, progress.batch_size)
        left = self.batches_per_round() - progress.batches
        if left <= 0:
            return Directive(DirectiveKind.SYNC_NOW, 0, progress.round)
        return Directive(DirectiveKind.SYNC_AFTER, left, progress.round)


@dataclass(frozen=True)
class SimWorker:
    worker_id: str
    batch_size: int
    #: Mean seconds per batch.
    batch_seconds: float
    #: Relative standard deviation of a batch's duration.
    jitter: float = 0.0


@dataclass
class SimResult:
    rounds: int
    round_seconds: list[float] = field(default_factory=list)
    #: Seconds each worker spent waiting at sync points, over all rounds.
    idle_seconds: dict[str, float] = field(default_factory=dict)
    #: Seconds each worker spent in rounds (busy + idle).
    round_time: dict[str, float] = field(default_factory=dict)
    #: Samples each worker processed, per round.
    samples: list[dict[str, int]] = field(default_factory=list)
    #: Seconds each worker waited at the sync point, per round.
    idle: list[dict[str, float]] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        total = sum(self.round_time.values())
        return sum(self.idle_seconds.values()) / total if total > 0 else 0.0

    def mean_samples(self, worker_id: str) -> float:
        return sum(r.get(worker_id, 0) for r in self.samples) / max(1, len(self.samples))


def simulate(
    planner: Planner,
    workers: Sequence[SimWorker],
    rounds: int,
    *,
    seed: int = 0,
    sync_seconds: float = 0.0,
    pipelined: bool = False,
    report_interval: float = 0.0,
    max_events: int = 10_000_000,
) -> SimResult:
    """Run ``rounds`` rounds of simulated workers against ``planner``.

    Each worker runs a batch, reports, and obeys the answer: another batch,
    or wait at the sync point. ``pipelined`` workers behave as the built-in
    trainer does: they start the next batch as they report and act on the
    answer after it (a ``sync_after`` count still counts from the reported
    batch; the round's last batch is reported and answered before the sync).
    ``report_interval`` (pipelined workers only) spaces their reports as the
    trainer's ``report_interval_s`` does: a round's first batch and its last
    are always reported, any other only once that long has passed since the
    worker's previous report. When all wait, the round ends at the last
    arrival (everyone else idled until then) and the next starts
    ``sync_seconds`` later. Batch durations are drawn around each worker's
    mean with its jitter (seeded, so runs are reproducible).
    """
    rng = random.Random(seed)
    for w in workers:
        planner.add_worker(w.worker_id, w.batch_size)
    result = SimResult(rounds=rounds)
    result.idle_seconds = {w.worker_id: 0.0 for w in workers}
    result.round_time = {w.worker_id: 0.0 for w in workers}
    by_id = {w.worker_id: w for w in workers}
    now, events = 0.0, 0

    def duration(w: SimWorker) -> float:
        return max(0.1 * w.batch_seconds, w.batch_seconds * (1.0 + w.jitter * rng.gauss(0.0, 1.0)))

    for round_ in range(rounds):
        start = now
        batches = dict.fromkeys(by_id, 0)
        samples = dict.fromkeys(by_id, 0)
        countdown: dict[str, int | None] = dict.fromkeys(by_id)
        #: A pipelined worker's answer not acted on yet, with the batch count it answered.
        pending: dict[str, tuple[Directive, int] | None] = dict.fromkeys(by_id)
        reported_at: dict[str, float] = {}
        arrived: dict[str, float] = {}
        heap: list[tuple[float, str, float]] = []
        for w in workers:
            d = duration(w)
            heapq.heappush(heap, (now + d, w.worker_id, d))
        while heap:
            events += 1
            if events > max_events:
                raise RuntimeError("simulation did not converge: the planner never syncs")
            now, wid, took = heapq.heappop(heap)
            w = by_id[wid]
            batches[wid] += 1
            samples[wid] += w.batch_size

            figures = (round_, batches[wid], samples[wid], took, w.batch_size)
            if pipelined:
                left = countdown[wid]
                left = None if left is None else left - 1
                if (waiting := pending[wid]) is not None:
                    answer, reported = waiting
                    pending[wid] = None
                    if answer.syncs_now or answer.kind is DirectiveKind.DONE:
                        left = 0
                    elif answer.kind is DirectiveKind.SYNC_AFTER:
                        due = max(0, answer.batches - (batches[wid] - reported))
                        left = due if left is None else min(left, due)
                countdown[wid] = left
                if left is not None and left <= 0:
                    planner.report(wid, Progress(*figures), now)
                    arrived[wid] = now
                    continue
                if batches[wid] > 1 and now - reported_at[wid] < report_interval:
                    d = duration(w)
                    heapq.heappush(heap, (now + d, wid, d))
                    continue
                ahead = Progress(*figures, next_batch_started=True)
                pending[wid] = (planner.report(wid, ahead, now), batches[wid])
                reported_at[wid] = now
            else:
                answer = planner.report(wid, Progress(*figures), now)
                if answer.syncs_now or answer.kind is DirectiveKind.DONE:
                    arrived[wid] = now
                    continue
            d = duration(w)
            heapq.heappush(heap, (now + d, wid, d))
        end = max(arrived.values())
        result.idle.append({wid: end - at for wid, at in arrived.items()})
        for wid, at in arrived.items():
            result.idle_seconds[wid] += end - at
            result.round_time[wid] += end - start
        result.round_seconds.append(end - start)
        result.samples.append(samples)
        now = end + sync_seconds
    return result


def heterogeneous_workers(
    speeds: Iterable[float], *, batch_size: int = 8, base_batch_seconds: float = 0.1, jitter: float = 0.0
) -> list[SimWorker]:
    """Workers whose speed is relative to 1.0 (0.33: a third as fast), same batch size."""
    return [
        SimWorker(f"w{i}", batch_size, base_batch_seconds / speed, jitter) for i, speed in enumerate(speeds)
    ]


__all__ = ["EqualBatchPlanner", "SimResult", "SimWorker", "heterogeneous_workers", "simulate"]
