"""Performance-aware DiLoCo rounds: how many batches each trainer runs before a sync.

Every trainer reports progress as it trains (``ReportProgress``: after a
round's first batch, then after a batch every so often, the built-in trainer
at most every ``report_interval_s``) and is answered with a ``Directive``:
keep going, run ``n`` more batches then sync, sync now, or stop. The goal is
that all trainers of a job reach the sync point at about the same moment, so
nobody idles while the slowest finishes, while together they process about
``samples_per_round`` samples per round.

How ``RoundPlanner`` decides (all pure; time is passed in):

- **Batch size per worker** follows its offered capacity (``batch_size_for``):
  GPU memory ÷ the job's per-sample estimate, capped to the job's
  [min, max]; CPU-only workers get a default.
- **Rates**: each worker's throughput (samples/s) is an exponentially
  weighted mean over its reports (the time between two reports of a round
  divided by the batches run in between, else the batch time the worker
  measured). So is how many batches a worker runs between two reports.
- **When to plan**: the round's remaining sample budget divided by the sum of
  the rates estimates how long the round still runs. Once that is within the
  look-ahead, a plan is made. The look-ahead is *relative to the round*: a
  fraction (``lookahead``, default 0.25) of the expected round duration
  (``samples_per_round`` ÷ total rate), and at least the longest time a
  worker goes between reports (a batch, or the batches it runs between two
  reports), so every worker reports once more before the sync point. The
  samples a worker has most likely done since its last report count too. (The
  reference system simulated a fixed 10 s ahead, which is either far too long
  or too short depending on the model.)
- **The plan** simulates forward on the measured rates: every worker that is
  mid-batch completes that batch (it cannot stop earlier; one that has not
  reported in this round yet is taken to have started when the round began,
  estimated from the round's first report; one that reports every few
  batches completes those before it hears of the plan), then batches
  complete at each worker's own pace; the sync time ``t*`` is the earliest
  completion time by which the budget is covered, and never before the
  in-flight batches end. Each worker's target is the number of its batches
  that complete by ``t*``, so fast workers run more; a worker idles at most
  one of its own batch times, and usually much less.
- Once given, a worker's target is kept for the round (it may already be
  acting on it); a worker that reports after the plan without a target
  (it joined late) gets the batches that fit before ``t*``.
- A report for an older round than the planner's current one means the
  others synced without that worker: it is told to sync now. A report for
  round ``rounds`` or beyond is answered ``DONE``.

Directive semantics for workers: ``batches`` counts batches *after* the one
just reported; ``SYNC_NOW`` means "send your delta now". A report says
whether the worker waits for the answer before its next batch or started
that batch as it reported (``next_batch_started``: the built-in trainer, so
the round trip overlaps training); the plan counts such a batch as in
flight, as it does every other worker's, so the scheduler's view of who is
mid-batch stays exact.

``hypha.testing.rounds_sim`` holds the baseline the benchmark compares
against (equal batch counts per worker) and a discrete-event simulation that
drives either planner with simulated heterogeneous workers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hypha.directives import DirectiveKind
from hypha.errors import InvalidArgumentError
from hypha.market.resources import Resources
from hypha.v1 import common_pb2, scheduler_pb2

#: Batch size a CPU-only worker gets (within the job's limits).
DEFAULT_CPU_BATCH_SIZE = 8
#: Weight of the newest observation in a worker's rate average.
DEFAULT_ALPHA = 0.3
#: Look-ahead as a fraction of the expected round duration.
DEFAULT_LOOKAHEAD = 0.25
_EPS = 1e-9


@dataclass(frozen=True)
class Directive:
    kind: DirectiveKind
    batches: int = 0
    round: int = 0

    @property
    def syncs_now(self) -> bool:
        return self.kind is DirectiveKind.SYNC_NOW or (
            self.kind is DirectiveKind.SYNC_AFTER and self.batches <= 0
        )

    def to_proto(self) -> scheduler_pb2.Directive:
        return scheduler_pb2.Directive(kind=self.kind.to_proto(), batches=self.batches, round=self.round)

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.Directive) -> Directive:
        kind = DirectiveKind.from_proto(msg.kind)
        if kind is None:
            raise InvalidArgumentError(f"directive kind {msg.kind} is unspecified or unknown")
        return cls(kind, msg.batches, msg.round)


@dataclass(frozen=True)
class Progress:
    """One progress report: cumulative figures for the worker's current round."""

    round: int
    batches: int
    samples: int
    batch_seconds: float = 0.0
    batch_size: int = 0
    loss: float = 0.0
    #: The worker's next batch began as it sent this report (it acts on the answer after it).
    next_batch_started: bool = False

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.ProgressReport) -> Progress:
        if not math.isfinite(msg.batch_seconds) or msg.batch_seconds < 0:
            raise InvalidArgumentError("progress.batch_seconds must be a finite, non-negative number")
        return cls(
            msg.round,
            msg.batches,
            msg.samples,
            msg.batch_seconds,
            msg.batch_size,
            msg.loss,
            msg.next_batch_started,
        )


def batch_size_for(
    capacity: Resources,
    *,
    gpu_memory_per_sample_gb: float,
    min_batch_size: int,
    max_batch_size: int,
    cpu_batch_size: int = DEFAULT_CPU_BATCH_SIZE,
) -> int:
    """A worker's batch size from what it offered.

    GPU workers: as many samples as fit in their GPU memory at the job's
    per-sample estimate (the largest allowed when there is no estimate);
    CPU-only workers: ``cpu_batch_size``. Always within [min, max]: the job's
    requirements are what guarantee ``min_batch_size`` fits.
    """
    if min_batch_size < 1 or max_batch_size < min_batch_size:
        raise InvalidArgumentError(f"batch limits [{min_batch_size}, {max_batch_size}] are not a range")
    if capacity.gpu_memory_gb > 0:
        if gpu_memory_per_sample_gb > 0:
            wanted = int(capacity.gpu_memory_gb / gpu_memory_per_sample_gb + _EPS)
        else:
            wanted = max_batch_size
    else:
        wanted = cpu_batch_size
    return max(min_batch_size, min(max_batch_size, wanted))


class Planner(Protocol):
    """What orchestration calls: one answer per progress report."""

    #: The samples a round should cover (the run may change it between rounds: ``link_fit``).
    samples_per_round: int

    def add_worker(self, worker_id: str, batch_size: int) -> None: ...
    def remove_worker(self, worker_id: str) -> None: ...
    def report(self, worker_id: str, progress: Progress, now: float) -> Directive: ...
    def rates(self) -> dict[str, float]:
        """Measured throughput (samples/s) of each worker that reported."""
        ...


#: Makes the planner of one DiLoCo job from its spec (the app wires ``round_planners``).
PlannerFactory = Callable[[common_pb2.DilocoJobSpec], Planner]


def round_planners(lookahead: float = DEFAULT_LOOKAHEAD) -> PlannerFactory:
    """A ``RoundPlanner`` per job, with the scheduler's configured look-ahead."""

    def make(spec: common_pb2.DilocoJobSpec) -> Planner:
        return RoundPlanner(int(spec.samples_per_round), int(spec.rounds), lookahead=lookahead)

    return make


@dataclass
class _Worker:
    batch_size: int
    rate: float | None = None  # samples/s, EWMA
    round: int = -1
    batches: int = 0
    samples: int = 0
    last_report: float | None = None
    target: int | None = None  # batch count (this round) after which to sync
    ahead: bool = False  # its last report said its next batch had started
    pipelined: bool = False  # any report of it did: it hears of a plan a batch late
    per_report: float | None = None  # batches between two of its reports within a round, EWMA

    def batch_seconds(self) -> float | None:
        if self.rate is None or self.rate <= 0 or self.batch_size <= 0:
            return None
        return self.batch_size / self.rate

    def heard_after(self) -> int:
        """Batches it finishes after a report before its next one: 1 when it reports every
        batch, more when it reports every so often (``TrainerOptions.report_interval_s``)."""
        return max(1, round(self.per_report or 1))

    def unreported(self, now: float) -> int:
        """Batches it has most likely finished since its last report and not yet reported (at
        most those before its next report: one that went quiet is not credited with more)."""
        seconds = self.batch_seconds()
        if seconds is None or self.last_report is None:
            return 0
        done = math.floor((now - self.last_report) / seconds + _EPS)
        return max(0, min(self.heard_after() - 1, done))


class RoundPlanner:
    """The performance-aware planner of one DiLoCo job (see the module docstring)."""

    def __init__(
        self,
        samples_per_round: int,
        rounds: int,
        *,
        lookahead: float = DEFAULT_LOOKAHEAD,
        alpha: float = DEFAULT_ALPHA,
    ) -> None:
        if samples_per_round < 1 or rounds < 1:
            raise InvalidArgumentError("samples_per_round and rounds must be at least 1")
        if not 0.0 < lookahead <= 1.0:
            raise InvalidArgumentError(f"lookahead must be in (0, 1], got {lookahead}")
        if not 0.0 < alpha <= 1.0:
            raise InvalidArgumentError(f"alpha must be in (0, 1], got {alpha}")
        self.samples_per_round = samples_per_round
        self.rounds = rounds
        self.lookahead = lookahead
        self.alpha = alpha
        self.round = 0
        #: Planned sync time of the current round, once planned.
        self.sync_at: float | None = None
        #: Estimated start of the current round (from its first report).
        self._round_started: float | None = None
        self._workers: dict[str, _Worker] = {}

    # ---- membership and queries --------------------------------------------------------

    def add_worker(self, worker_id: str, batch_size: int) -> None:
        if batch_size < 1:
            raise InvalidArgumentError(f"batch size of {worker_id} must be at least 1")
        worker = self._workers.get(worker_id)
        if worker is None:
            self._workers[worker_id] = _Worker(batch_size)
        else:
            worker.batch_size = batch_size

    def remove_worker(self, worker_id: str) -> None:
        """A lost worker: it no longer counts. Targets already given stay, so the
        round ends with fewer samples rather than later (the PS weights by samples)."""
        self._workers.pop(worker_id, None)

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(self._workers)

    def rates(self) -> dict[str, float]:
        """Measured throughput (samples/s) of each worker that reported."""
        return {w: s.rate for w, s in self._workers.items() if s.rate is not None}

    def batch_size(self, worker_id: str) -> int:
        return self._workers[worker_id].batch_size

    def target(self, worker_id: str) -> int | None:
        """The batch count after which ``worker_id`` syncs this round, once planned."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.target

    def round_samples(self) -> int:
        return sum(w.samples for w in self._workers.values() if w.round == self.round)

    # ---- the decision -----------------------------------------------------------------

    def report(self, worker_id: str, progress: Progress, now: float) -> Directive:
        if progress.round >= self.rounds:
            return Directive(DirectiveKind.DONE, 0, progress.round)
        if progress.round < self.round:
            return Directive(DirectiveKind.SYNC_NOW, 0, progress.round)
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = self._workers[worker_id] = _Worker(max(1, progress.batch_size))
        if progress.round > self.round:
            self._start_round(progress.round)
        self._observe(worker, progress, now)
        if self._round_started is None:
            # The first report of a round tells roughly when the round began.
            took = progress.batch_seconds or worker.batch_seconds() or 0.0
            self._round_started = now - progress.batches * took
        if worker.target is not None:
            return self._directive(worker)
        if self.sync_at is None and self._should_plan(now):
            self._plan(worker_id, now)
        if self.sync_at is not None and worker.target is None:
            # Joined after the plan: whatever fits before the sync point.
            seconds = worker.batch_seconds()
            extra = 0 if seconds is None else int(max(0.0, self.sync_at - now) / seconds + _EPS)
            if worker.ahead:
                extra = max(extra, 1)  # the batch it started as it reported ends whatever we say
            worker.target = worker.batches + extra
        if worker.target is not None:
            return self._directive(worker)
        return Directive(DirectiveKind.CONTINUE, 0, self.round)

    def _directive(self, worker: _Worker) -> Directive:
        assert worker.target is not None
        left = worker.target - worker.batches
        if left <= 0:
            return Directive(DirectiveKind.SYNC_NOW, 0, self.round)
        return Directive(DirectiveKind.SYNC_AFTER, left, self.round)

    def _start_round(self, round_: int) -> None:
        self.round = round_
        self.sync_at = None
        self._round_started = None
        for worker in self._workers.values():
            worker.target = None

    def _observe(self, worker: _Worker, progress: Progress, now: float) -> None:
        if progress.batch_size > 0:
            worker.batch_size = progress.batch_size
        seconds = progress.batch_seconds
        ran = progress.batches - worker.batches if worker.round == progress.round else 0
        if worker.last_report is not None and ran >= 1:
            # Consecutive reports of one round: ``ran`` batches took the time between them
            # (overheads included), and the worker reports about that often.
            seconds = max(seconds, (now - worker.last_report) / ran)
            worker.per_report = (
                ran if worker.per_report is None else self.alpha * ran + (1 - self.alpha) * worker.per_report
            )
        if seconds > 0 and worker.batch_size > 0 and progress.batches > 0:
            sample = worker.batch_size / seconds
            worker.rate = (
                sample if worker.rate is None else self.alpha * sample + (1 - self.alpha) * worker.rate
            )
        worker.round = progress.round
        worker.batches = progress.batches
        worker.samples = progress.samples
        worker.last_report = now
        worker.ahead = progress.next_batch_started
        worker.pipelined = worker.pipelined or worker.ahead

    def _should_plan(self, now: float) -> bool:
        remaining = self.samples_per_round - self.round_samples()
        if remaining <= 0:
            return True
        rates = [w.rate for w in self._workers.values()]
        if not rates or any(r is None or r <= 0 for r in rates):
            return False  # not everyone measured yet; the budget check above is the fallback
        total = sum(r for r in rates if r is not None)
        # What workers that report less often than every batch did since their last report.
        remaining -= sum(
            w.unreported(now) * w.batch_size for w in self._workers.values() if w.round == self.round
        )
        expected_round_s = self.samples_per_round / total
        # Every worker reports once more before the sync point, however seldom it reports.
        slowest_s = max((w.batch_seconds() or 0.0) * w.heard_after() for w in self._workers.values())
        horizon = max(self.lookahead * expected_round_s, slowest_s)
        return remaining / total <= horizon

    def _plan(self, reporter: str, now: float) -> None:
        """Fix the sync time and every worker's target (see the module docstring)."""
        remaining = self.samples_per_round - self.round_samples()
        last: dict[str, float] = {}  # when each worker's last forced batch completes (or now)
        forced: dict[str, int] = {}  # batches that will complete whatever we say
        base: dict[str, int] = {}  # batches done this round at its last report
        floor_t = now
        for wid, w in self._workers.items():
            seconds = w.batch_seconds()
            if seconds is None:
                continue  # unmeasured: planned when it reports
            in_round = w.round == self.round and w.last_report is not None
            base[wid] = w.batches if in_round else 0
            if wid == reporter:
                # This answer reaches it now: nothing is in flight if it waits for it,
                # the batch it started as it reported if not.
                forced[wid] = 1 if w.ahead else 0
                started: float | None = now
                heard = 1
            else:
                # Everyone else is mid-batch: since its last report, or since the round
                # began if it has not reported in this round yet (its first batch is
                # reported). It hears of this plan at its next report; the batches it
                # finishes until then are done whatever we say, and one that starts a batch
                # as it reports runs another before it can act on what it heard.
                started = w.last_report if in_round else self._round_started
                if started is None:
                    continue
                heard = w.heard_after() if in_round else 1
                forced[wid] = heard + (1 if w.pipelined else 0)
            done_at = max(now, started + heard * seconds) if forced[wid] and started is not None else now
            last[wid] = done_at + max(0, forced[wid] - heard) * seconds
            floor_t = max(floor_t, last[wid])
            remaining -= forced[wid] * w.batch_size
        sync_at = floor_t
        if remaining > 0 and last:
            heap = [(t + self._seconds(w), w) for w, t in last.items()]
            heapq.heapify(heap)
            for _ in range(1_000_000):
                if remaining <= 0 or not heap:
                    break
                t, wid = heapq.heappop(heap)
                remaining -= self._workers[wid].batch_size
                sync_at = max(sync_at, t)
                heapq.heappush(heap, (t + self._seconds(wid), wid))
        self.sync_at = sync_at
        for wid, w in self._workers.items():
            if wid not in last:
                continue  # gets its target when it reports
            extra = forced[wid] + int((sync_at - last[wid]) / self._seconds(wid) + _EPS)
            w.target = base[wid] + extra

    def _seconds(self, worker_id: str) -> float:
        seconds = self._workers[worker_id].batch_seconds()
        assert seconds is not None
        return seconds
