"""Competing schedulers and a pool of workers, interleaved at random.

Two or three schedulers (each an ``Allocation`` per request plus a
``LeaseBook``) and three to six workers (each an ``Arbiter`` over a
``LeaseLedger``) go through advertisements delivered in any order, offers
accepted, refused or lost in flight, renewals, releases, scheduler deaths and
time jumps. After every step no worker has promised a resource twice, and at
the end, once time has passed every deadline, every lease has ended exactly
once.

NOTE: the interleaving is a seeded random walk with weighted moves rather than
a hypothesis state machine: measured here, hypothesis' stateful programs of
this shape mostly stop before an offer is ever accepted, while the walk
reaches accept, renew, loss and expiry in every few runs. Hypothesis still
picks the seeds and reports a failing one.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import FailedPreconditionError, NotFoundError
from hypha.market.allocator import Allocation, HeldLease, LeaseBook
from hypha.market.arbiter import AdvertisementView, Arbiter, ArbiterConfig, OfferStrategy
from hypha.market.leases import Lease, LeaseLedger, LeaseState
from hypha.market.policies import POLICY_NAMES, OfferView, get_policy
from hypha.market.pricing import PriceRange
from hypha.market.resources import ExecutorKind, Requirements, Resources

T0 = 10_000.0
LEASE_TTL_S = 0.9
# NOTE: the scheduler's window must be shorter than the workers' offer ttl
# (0.5 s), or the offers it collected lapse before it can accept them.
WINDOW_S = 0.4
STEPS = 300

# Worker machines, and the (smaller, fractional) minimums requests ask for.
CPUS = [2.0, 4.0, 8.0]
MEMS = [1.0, 4.0, 16.0]
GPUS = [0.0, 1.0, 2.0, 4.0]
NEED_CPUS = [0.5, 1.0, 1.5, 3.0]
NEED_MEMS = [0.1, 0.3, 1.0, 2.0]
NEED_GPUS = [0.0, 0.0, 0.0, 1.0]
PRICES = [0.0, 0.5, 1.0, 2.0, 5.0]
# Time moves a little on every step: an advertisement lives for some tens of
# steps and a lease for about a hundred, so renewals and losses both happen.
TICKS_S = [0.0, 0.005, 0.01, 0.02]
PAUSE_S = 5.0  # longer than a lease: whoever was due to renew loses it


@dataclass
class WorkerSim:
    worker_id: str
    arbiter: Arbiter
    reserved: Resources = field(default_factory=Resources)  # everything ever reserved
    returned: Resources = field(default_factory=Resources)  # everything ever given back

    @property
    def ledger(self) -> LeaseLedger:
        return self.arbiter.ledger


@dataclass
class SchedulerSim:
    scheduler_id: str
    book: LeaseBook = field(default_factory=LeaseBook)
    alive: bool = True
    allocation: Allocation | None = None


class Market:
    """The world: schedulers, workers, messages in flight, and a shared clock."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = T0
        self.events: Counter[str] = Counter()
        self.ads_in_flight: list[tuple[int, AdvertisementView]] = []
        self.offers_in_flight: list[tuple[int, int, OfferView]] = []  # scheduler, worker, offer
        self.holder_of: dict[str, str] = {}  # lease id -> holder, recorded once at reservation
        self.worker_of: dict[str, int] = {}
        self.ended: set[str] = set()
        self.request_ids = itertools.count()
        self.workers = [self._worker(w) for w in range(rng.randint(3, 6))]
        self.schedulers = [SchedulerSim(f"sched-{s}") for s in range(rng.randint(2, 3))]

    def _worker(self, w: int) -> WorkerSim:
        rng = self.rng
        capacity = Resources(cpu=rng.choice(CPUS), memory_gb=rng.choice(MEMS), gpu=rng.choice(GPUS))
        executors = frozenset(k for k in ExecutorKind if rng.random() < 0.8) or frozenset({ExecutorKind.TASK})
        config = ArbiterConfig(
            price=rng.choice(PRICES),
            floor=rng.choice(PRICES[:3]),
            strategy=rng.choice(list(OfferStrategy)),
            executors=executors,
        )
        counter = itertools.count()
        ledger = LeaseLedger(capacity, history_size=100_000, new_id=lambda: f"w{w}-l{next(counter)}")
        return WorkerSim(f"worker-{w}", Arbiter(ledger, config))

    # ---- bookkeeping -----------------------------------------------------------

    def _ended(self, worker: WorkerSim, lease: Lease) -> None:
        assert lease.state in (LeaseState.RELEASED, LeaseState.EXPIRED)
        assert lease.lease_id not in self.ended, f"{lease.lease_id} ended twice"
        self.ended.add(lease.lease_id)
        worker.returned = worker.returned + lease.resources
        self.events[lease.state.value] += 1

    def _release_at_worker(self, w: int, lease_id: str, holder: str) -> None:
        worker = self.workers[w]
        try:
            self._ended(worker, worker.ledger.release(lease_id, holder, self.now))
        except FailedPreconditionError:
            # Already ended (pruned after it lapsed): nothing is given back twice.
            assert worker.ledger.get(lease_id).state is LeaseState.EXPIRED
            self.events["release-after-expiry"] += 1

    # ---- scheduler moves --------------------------------------------------------

    def advertise(self) -> None:
        idle = [s for s in self.schedulers if s.alive and s.allocation is None]
        if not idle:
            return
        rng = self.rng
        sched = rng.choice(idle)
        minimum = Resources(
            cpu=rng.choice(NEED_CPUS), memory_gb=rng.choice(NEED_MEMS), gpu=rng.choice(NEED_GPUS)
        )
        requirement = Requirements(minimum, rng.choice(list(ExecutorKind)))
        request_id = f"req-{next(self.request_ids)}"
        bid = rng.choice(PRICES)
        sched.allocation = Allocation(
            request_id,
            requirement,
            rng.randint(1, 3),
            PriceRange(bid=bid, max=bid + rng.choice([0.0, 1.0, 10.0])),
            window_ends_at=self.now + WINDOW_S,
            policy=get_policy(rng.choice(POLICY_NAMES)),
        )
        ad = AdvertisementView(request_id, sched.scheduler_id, requirement, bid, deadline=self.now + WINDOW_S)
        self.ads_in_flight.extend((w, ad) for w in range(len(self.workers)))
        if rng.random() < 0.1:  # a gossip duplicate
            self.ads_in_flight.append((rng.randrange(len(self.workers)), ad))

    def deliver_offer(self) -> None:
        if not self.offers_in_flight:
            return
        s, w, view = self.offers_in_flight.pop(self.rng.randrange(len(self.offers_in_flight)))
        sched = self.schedulers[s]
        if not sched.alive:
            return  # a dead scheduler never answers; the reservation lapses
        alloc = sched.allocation
        if alloc is None or alloc.request_id != view.request_id or not alloc.offer(view, self.now):
            self.events["offer-refused"] += 1
            self._release_at_worker(w, view.offer_id, sched.scheduler_id)

    def choose(self) -> None:
        ready = [
            s
            for s in self.schedulers
            if s.alive and s.allocation is not None and s.allocation.complete(self.now)
        ]
        if not ready:
            return
        sched = self.rng.choice(ready)
        alloc = sched.allocation
        assert alloc is not None
        choice = alloc.choose(self.now)
        sched.allocation = None
        for won in choice.winners:
            w = self.worker_of[won.offer_id]
            try:
                lease = self.workers[w].ledger.activate(
                    won.offer_id, sched.scheduler_id, LEASE_TTL_S, self.now
                )
            except FailedPreconditionError:
                self.events["accept-too-late"] += 1
                continue
            self.events["activated"] += 1
            sched.book.add(
                HeldLease(
                    lease.lease_id,
                    won.worker_id,
                    alloc.request_id,
                    alloc.requirement,
                    lease.resources,
                    lease.price,
                    lease.expires_at,
                    LEASE_TTL_S,
                )
            )
        for lost in choice.losers:
            self._release_at_worker(self.worker_of[lost.offer_id], lost.offer_id, sched.scheduler_id)

    def renew(self) -> None:
        for sched in self.schedulers:
            if not sched.alive:
                continue
            for held in sched.book.due_for_renewal(self.now):
                ledger = self.workers[self.worker_of[held.lease_id]].ledger
                try:
                    lease = ledger.renew(held.lease_id, sched.scheduler_id, LEASE_TTL_S, self.now)
                except (FailedPreconditionError, NotFoundError):
                    assert sched.book.mark_lost(held.lease_id) == held
                    assert sched.book.mark_lost(held.lease_id) is None
                    self.events["lost"] += 1
                    continue
                sched.book.renewed(held.lease_id, lease.expires_at)
                self.events["renewed"] += 1

    def release_held(self) -> None:
        holders = [s for s in self.schedulers if s.alive and len(s.book)]
        if not holders or self.rng.random() < 0.7:  # rare: most leases live through renewals
            return
        sched = self.rng.choice(holders)
        lease = self.rng.choice(sched.book.leases())
        sched.book.release(lease.lease_id)
        self._release_at_worker(self.worker_of[lease.lease_id], lease.lease_id, sched.scheduler_id)

    def scheduler_dies(self) -> None:
        alive = [s for s in self.schedulers if s.alive]
        # Rare, and one scheduler always survives so the market keeps trading.
        if len(alive) > 1 and self.rng.random() < 0.2:
            self.rng.choice(alive).alive = False
            self.events["died"] += 1

    # ---- worker moves ---------------------------------------------------------

    def deliver_ad(self) -> None:
        if self.ads_in_flight:
            w, ad = self.ads_in_flight.pop(self.rng.randrange(len(self.ads_in_flight)))
            self.workers[w].arbiter.add(ad, self.now)

    def decide(self) -> None:
        waiting = [w for w, x in enumerate(self.workers) if x.arbiter.pending()]
        if not waiting:
            return
        w = self.rng.choice(waiting)
        worker = self.workers[w]
        if not worker.arbiter.ready(self.now) and self.rng.random() < 0.5:
            return
        scheduler_index = {s.scheduler_id: i for i, s in enumerate(self.schedulers)}
        for decision in worker.arbiter.decide(self.now):
            assert decision.lease_id not in self.holder_of, "lease id reused"
            self.holder_of[decision.lease_id] = decision.scheduler_id
            self.worker_of[decision.lease_id] = w
            worker.reserved = worker.reserved + decision.resources
            self.events["reserved"] += 1
            view = OfferView(
                offer_id=decision.offer_id,
                worker_id=worker.worker_id,
                price=decision.price,
                resources=decision.resources,
                capacity=worker.ledger.capacity,
                active_leases=len(worker.ledger.active()),
                expires_at=decision.expires_at,
                request_id=decision.request_id,
                executor=decision.executor,
            )
            self.offers_in_flight.append((scheduler_index[decision.scheduler_id], w, view))

    def prune(self) -> None:
        worker = self.rng.choice(self.workers)
        for lease in worker.ledger.expire_due(self.now):
            assert lease.state is LeaseState.EXPIRED
            self._ended(worker, lease)

    def pause(self) -> None:
        if self.rng.random() < 0.1:
            self.now += PAUSE_S

    MOVES: tuple[tuple[Callable[[Market], None], int], ...] = (
        (advertise, 3),
        (deliver_ad, 10),
        (decide, 5),
        (deliver_offer, 6),
        (choose, 4),
        (renew, 6),
        (release_held, 1),
        (scheduler_dies, 1),
        (prune, 3),
        (pause, 1),
    )

    def step(self) -> None:
        moves, weights = zip(*self.MOVES, strict=True)
        self.rng.choices(moves, weights)[0](self)
        self.now += self.rng.choice(TICKS_S)

    # ---- invariants -------------------------------------------------------------

    def check(self) -> None:
        seen_ids: set[str] = set()
        for worker in self.workers:
            ledger = worker.ledger
            live = ledger.live()
            held = Resources.total([lease.resources for lease in live])
            assert ledger.free().is_non_negative(), f"{worker.worker_id} promised more than it has"
            assert ledger.free() + held == ledger.capacity
            assert worker.reserved - worker.returned == held
            for lease in live:
                assert lease.lease_id not in self.ended
                assert lease.holder == self.holder_of[lease.lease_id]
            ids = {lease.lease_id for lease in live + ledger.history()}
            assert not ids & seen_ids, "one lease id on two workers"
            seen_ids |= ids
        for sched in self.schedulers:
            if not sched.alive:
                continue
            for h in sched.book.leases():
                if self.now < h.expires_at:
                    lease = self.workers[self.worker_of[h.lease_id]].ledger.get(h.lease_id)
                    assert lease.state is LeaseState.ACTIVE
                    assert lease.holder == sched.scheduler_id
                    assert lease.expires_at == h.expires_at

    def finish(self) -> None:
        """Everyone stops; once time passes every deadline, every lease has ended once."""
        self.now += 1_000.0
        for worker in self.workers:
            for lease in worker.ledger.expire_due(self.now):
                self._ended(worker, lease)
            assert worker.ledger.live() == []
            assert worker.ledger.free() == worker.ledger.capacity
            assert worker.reserved == worker.returned
            for lease in worker.ledger.history():
                assert lease.state in (LeaseState.RELEASED, LeaseState.EXPIRED)
        assert self.ended == set(self.holder_of)


def run_market(seed: int, steps: int = STEPS) -> Counter[str]:
    market = Market(random.Random(seed))
    market.check()
    for _ in range(steps):
        market.step()
        market.check()
    market.finish()
    return market.events


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_no_resource_is_promised_twice_and_every_lease_ends_once(seed: int) -> None:
    run_market(seed)


def test_the_random_walk_reaches_every_market_event() -> None:
    # Guards the property test against going vacuous: over a few fixed seeds the
    # walk must accept, renew, lose, release and expire leases.
    events: Counter[str] = Counter()
    for seed in range(10):
        events += run_market(seed)

    for event in ("reserved", "activated", "renewed", "lost", "released", "expired", "offer-refused", "died"):
        assert events[event] > 0, f"no {event!r} in {dict(events)}"
