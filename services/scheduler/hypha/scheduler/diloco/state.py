"""What a running DiLoCo job is made of: its state in one dataclass, and the run's operations
its phases use, as one ``Protocol``.

The phases of a run (``trainers``, ``ps_recovery``, ``elastic``, ``resume``) are
modules of functions over a ``DilocoOps``: they read and change ``DilocoState``
and ask the run (``hypha.scheduler.diloco.run.DilocoRun``, which satisfies the
protocol) for what only it may do, because the job's registry knows the run as
the holder of its leases: lease, release, dispatch anew, take a lease back,
save. None of them imports the run, and none reaches another's private members.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from hypha.dht.records import ProviderRecord
from hypha.market.allocator import HeldLease
from hypha.scheduler.diloco.link_fit import LinkFit
from hypha.scheduler.diloco.ps_state import StateKeeper
from hypha.scheduler.diloco.round_planner import Planner, PlannerFactory
from hypha.scheduler.diloco.slice_tracker import SliceTracker
from hypha.scheduler.runs import RunRegistry
from hypha.v1 import common_pb2


@dataclass
class Trainer:
    """One trainer of a DiLoCo job: its lease, batch size and the figures it last reported."""

    worker_id: str
    lease: HeldLease
    batch_size: int
    #: 0 for the job's first trainers, else its join number: unique on each worker (``on_status``).
    attempt: int
    start_round: int
    #: Join order within the job (shrinking releases the highest first).
    joined: int = 0
    finished: bool = False
    samples: int = 0
    samples_per_second: float = 0.0
    loss: float = 0.0


@dataclass
class DilocoState:
    """Everything a DiLoCo run holds in memory besides its leases (saved by ``snapshot``)."""

    #: Trainers the job should have (``hypha scale``; ``elastic``).
    target_workers: int
    ps: HeldLease | None = None
    trainers: dict[str, Trainer] = field(default_factory=dict)
    tracker: SliceTracker | None = None
    planner: Planner | None = None
    #: Samples per round fitted to the link (``max_samples_per_round``), None: fixed.
    link_fit: LinkFit | None = None
    data_providers: list[common_pb2.PeerInfo] = field(default_factory=list)
    #: Rounds the parameter server completed.
    completed: int = 0
    #: When the current round started (dispatch, then each completion), on the registry's clock.
    round_started_at: float = 0.0
    #: Trainer loss per round, per worker.
    losses: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Replacements made so far (bounded by ``jobs.max_replacements``; restores count too).
    replacements_used: int = 0
    #: Replacements being leased and dispatched right now.
    replacements_under_way: int = 0
    last_store_at: float = 0.0
    #: Resolved with (succeeded, message) when the parameter server ends.
    ended: asyncio.Future[tuple[bool, str]] | None = None
    #: The current parameter server's attempt (each restore is a new one).
    ps_attempt: int = 0
    #: The first parameter server runs: from now on a lost one is restored, not fatal.
    ps_started: bool = False
    #: Serialises dispatches to the parameter server (restores and trainer-list updates).
    ps_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Trainers added so far (each one's ``joined``), and whether growth is under way.
    joins: int = 0
    growing: bool = False

    @property
    def over(self) -> bool:
        """The parameter server ended (or the job was given up): nothing is replaced any more."""
        return self.ended is not None and self.ended.done()

    def end(self, succeeded: bool, message: str) -> None:
        """End the job (the run's ``drive`` wakes up); only the first end counts."""
        if self.ended is not None and not self.ended.done():
            self.ended.set_result((succeeded, message))

    def worker_list(self) -> list[str]:
        """The job's workers as the store lists them: the parameter server first."""
        return ([self.ps.worker_id] if self.ps is not None else []) + sorted(self.trainers)

    def latest_loss(self) -> float | None:
        """Mean trainer loss of the latest round any trainer reported, else the live mean."""
        if self.losses:
            values = list(self.losses[max(self.losses)].values())
            return sum(values) / len(values)
        live = [t.loss for t in self.trainers.values() if t.loss > 0 and math.isfinite(t.loss)]
        return sum(live) / len(live) if live else None

    def parts_except(self, worker_id: str = "") -> set[str]:
        """Workers of the job's parts (but ``worker_id``): none is leased for another part."""
        taken = set(self.trainers) | ({self.ps.worker_id} if self.ps is not None else set())
        return taken - {worker_id}


class DilocoOps(Protocol):
    """What the phases of a DiLoCo run ask of the run itself (``DilocoRun`` implements it)."""

    job_id: str
    spec: common_pb2.JobSpec
    runs: RunRegistry
    state: DilocoState
    #: The parameter server's state after the newest committed round.
    keeper: StateKeeper
    planners: PlannerFactory
    participants: set[str]
    resuming: bool

    @property
    def diloco(self) -> common_pb2.DilocoJobSpec: ...

    async def lease(
        self,
        requirements: common_pb2.Requirements,
        price: common_pb2.PriceRange,
        count: int,
        *,
        exclude: Collection[str],
        what: str,
        patience_s: float | None = None,
    ) -> list[HeldLease]:
        """``count`` leases held by the run (``RunRegistry.lease_many``)."""
        ...

    async def release(self, lease: HeldLease, *, cancel: bool) -> None:
        """Give a lease of the run back (cancelling its execution first if ``cancel``)."""
        ...

    def holds(self, lease: HeldLease) -> bool:
        """The run still holds ``lease`` (it was neither lost nor released)."""
        ...

    def track(self, lease: HeldLease) -> None:
        """The run holds ``lease`` from now on (a lease taken back after a restart)."""
        ...

    async def dispatch_anew(self, worker_id: str, dispatch: Callable[[], Awaitable[None]]) -> None:
        """A new attempt of a part on ``worker_id``, past an execution still winding down there."""
        ...

    async def find_providers(self, dataset: str) -> list[ProviderRecord]:
        """The data nodes serving ``dataset`` (the job fails when there are none)."""
        ...

    async def save(self) -> None:
        """Save what resuming the job after a scheduler restart needs (``snapshot``)."""
        ...


__all__ = ["DilocoOps", "DilocoState", "Trainer"]
