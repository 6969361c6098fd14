"""Performance-aware rounds: fast workers do more, everyone reaches the sync point together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.directives import DirectiveKind
from hypha.errors import InvalidArgumentError
from hypha.market.resources import Resources
from hypha.scheduler.diloco.round_planner import (
    Directive,
    Planner,
    Progress,
    RoundPlanner,
    batch_size_for,
    round_planners,
)
from hypha.testing.rounds_sim import EqualBatchPlanner, SimWorker, heterogeneous_workers, simulate
from hypha.v1 import common_pb2

K = DirectiveKind


def test_batch_size_follows_gpu_memory_within_the_job_limits() -> None:
    limits = {"min_batch_size": 2, "max_batch_size": 64}
    assert batch_size_for(Resources(gpu=1, gpu_memory_gb=24), gpu_memory_per_sample_gb=0.5, **limits) == 48
    assert batch_size_for(Resources(gpu=1, gpu_memory_gb=80), gpu_memory_per_sample_gb=0.5, **limits) == 64
    assert batch_size_for(Resources(gpu=1, gpu_memory_gb=0.5), gpu_memory_per_sample_gb=0.5, **limits) == 2
    assert batch_size_for(Resources(gpu=1, gpu_memory_gb=16), gpu_memory_per_sample_gb=0, **limits) == 64
    assert batch_size_for(Resources(cpu=8), gpu_memory_per_sample_gb=0.5, **limits) == 8
    assert batch_size_for(Resources(cpu=8), gpu_memory_per_sample_gb=0.5, cpu_batch_size=1, **limits) == 2
    with pytest.raises(InvalidArgumentError):
        batch_size_for(Resources(), gpu_memory_per_sample_gb=0, min_batch_size=4, max_batch_size=2)


def test_a_third_speed_worker_gets_a_third_of_the_samples_and_idle_time_stays_small() -> None:
    # Prepare: three workers at full speed, one at a third, 10% jitter on every batch.
    workers = heterogeneous_workers([1.0, 1.0, 1.0, 1 / 3], batch_size=8, base_batch_seconds=0.1, jitter=0.1)

    # Execute: the same simulated run with our planner and with equal batch counts.
    ours = simulate(RoundPlanner(2048, 8), workers, 8, seed=7)
    equal = simulate(EqualBatchPlanner(2048, 8), workers, 8, seed=7)

    # Assert
    fast = [ours.mean_samples(w.worker_id) for w in workers[:3]]
    slow = ours.mean_samples("w3")
    ratios = [f / slow for f in fast]
    print(
        f"\nidle fraction at sync points: performance-aware {ours.idle_fraction:.4f}, "
        f"equal batches {equal.idle_fraction:.4f}; "
        f"fast/slow samples per round {[round(r, 2) for r in ratios]}; "
        f"wall time {sum(ours.round_seconds):.1f}s vs {sum(equal.round_seconds):.1f}s"
    )
    assert all(2.5 <= r <= 3.5 for r in ratios), ratios
    assert ours.idle_fraction < 0.05
    assert equal.idle_fraction > 0.4
    assert sum(ours.round_seconds) < 0.6 * sum(equal.round_seconds)
    for per_round in ours.samples:
        assert sum(per_round.values()) >= 2048


@settings(max_examples=40, deadline=None)
@given(
    speeds=st.lists(st.floats(0.2, 4.0), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 32), min_size=6, max_size=6),
    budget=st.integers(1, 4000),
    pipelined=st.booleans(),
)
def test_once_rates_are_known_nobody_idles_longer_than_one_of_its_own_batches(
    speeds: list[float], sizes: list[int], budget: int, pipelined: bool
) -> None:
    # Workers that wait for each answer, and workers that run the next batch meanwhile.
    workers = [SimWorker(f"w{i}", sizes[i], 0.05 / s) for i, s in enumerate(speeds)]
    result = simulate(RoundPlanner(budget, 3), workers, 3, pipelined=pipelined)
    slowest = max(w.batch_seconds for w in workers)
    for index, idle in enumerate(result.idle):
        for w in workers:
            # The first round may sync before a slow worker has ever reported (a tiny budget);
            # a pipelined one has started its second batch by then, and runs it.
            bound = w.batch_seconds if index > 0 else slowest * (2 if pipelined else 1)
            assert idle[w.worker_id] <= bound + 1e-9, (index, w)
    for per_round in result.samples:
        assert sum(per_round.values()) >= budget


def test_pipelined_workers_keep_the_sync_points_of_workers_that_wait() -> None:
    # Prepare: trainers that report as their next batch starts (the built-in trainer).
    workers = heterogeneous_workers([1.0, 1.0, 1.0, 1 / 3], batch_size=8, base_batch_seconds=0.1, jitter=0.1)

    # Execute
    waiting = simulate(RoundPlanner(2048, 8), workers, 8, seed=7)
    pipelined = simulate(RoundPlanner(2048, 8), workers, 8, seed=7, pipelined=True)

    # Assert: as little idling, and rounds no longer than a batch of the slowest worker more.
    assert pipelined.idle_fraction < 0.05
    slowest = max(w.batch_seconds for w in workers)
    for ours, theirs in zip(pipelined.round_seconds, waiting.round_seconds, strict=True):
        assert ours <= theirs + 1.5 * slowest
    for per_round in pipelined.samples:
        assert sum(per_round.values()) >= 2048


def test_workers_that_report_every_so_often_still_sync_together() -> None:
    # Prepare: trainers reporting about once a second (``report_interval_s``): ten batches of a
    # fast worker, three of the slow one, per report, instead of one.
    workers = heterogeneous_workers([1.0, 1.0, 1.0, 1 / 3], batch_size=8, base_batch_seconds=0.1, jitter=0.1)

    # Execute
    every_batch = simulate(RoundPlanner(2048, 8), workers, 8, seed=7, pipelined=True)
    sparse = simulate(RoundPlanner(2048, 8), workers, 8, seed=7, pipelined=True, report_interval=1.0)

    # Assert: the planner counts the batches each worker runs between its reports (the one
    # that planned as if every worker reported each batch idled 5 % here, up to 1.1 s at a
    # sync point): as little idling as with a report per batch, nobody waiting longer than a
    # batch of the slowest worker, rounds as short, and the budget met without overshooting.
    slowest = max(w.batch_seconds for w in workers)
    assert sparse.idle_fraction < 0.02
    assert max(max(idle.values()) for idle in sparse.idle) <= slowest
    for ours, theirs in zip(sparse.round_seconds, every_batch.round_seconds, strict=True):
        assert ours <= theirs + 0.5 * slowest
    for per_round in sparse.samples:
        assert 2048 <= sum(per_round.values()) <= 2048 + 2 * 8


def test_a_reporter_whose_next_batch_started_is_planned_as_mid_batch() -> None:
    def plan(ahead: bool) -> tuple[Directive, int | None, float | None]:
        planner = RoundPlanner(20, 1)
        planner.add_worker("a", 10)
        # Its first report already covers the round's budget.
        answer = planner.report("a", Progress(0, 2, 20, 1.0, 10, next_batch_started=ahead), 2.0)
        return answer, planner.target("a"), planner.sync_at

    # A worker that waits for the answer stops where it is; one whose third batch already
    # runs is counted as running it: the sync is planned for when that batch ends.
    assert plan(ahead=False) == (Directive(K.SYNC_NOW, 0, 0), 2, 2.0)
    assert plan(ahead=True) == (Directive(K.SYNC_AFTER, 1, 0), 3, 3.0)
    # A late joiner that is mid-batch gets at least that batch.
    planner = RoundPlanner(30, 1, lookahead=1.0)
    planner.add_worker("a", 10)
    planner.report("a", Progress(0, 3, 30, 1.0, 10), 3.0)
    late = planner.report("c", Progress(0, 1, 5, 4.0, 5, next_batch_started=True), 3.0)
    assert late == Directive(K.SYNC_AFTER, 1, 0)


def test_the_plan_depends_on_the_round_not_on_absolute_time() -> None:
    # The same job on a model 1000x slower must get exactly the same directives.
    def run(scale: float) -> list[Directive]:
        planner = RoundPlanner(400, 2, lookahead=0.23)
        workers = {"fast": (10, 0.113 * scale), "slow": (7, 0.337 * scale)}
        done = dict.fromkeys(workers, 0)
        clock = {w: 0.0 for w in workers}
        answers = []
        for _ in range(60):
            wid = min(clock, key=lambda w: clock[w])
            size, seconds = workers[wid]
            clock[wid] += seconds
            done[wid] += 1
            answer = planner.report(wid, Progress(0, done[wid], done[wid] * size, seconds, size), clock[wid])
            answers.append(answer)
            if answer.syncs_now:
                clock[wid] = float("inf")
            if all(c == float("inf") for c in clock.values()):
                break
        return answers

    # A power of two scales every float exactly, so any difference would be the planner's.
    assert run(1.0) == run(1024.0)


def test_targets_count_down_and_stay_fixed_once_given() -> None:
    planner = RoundPlanner(100, 5, lookahead=0.7)
    planner.add_worker("a", 10)
    planner.add_worker("b", 10)
    assert planner.report("a", Progress(0, 1, 10, 1.0, 10), 1.0).kind is K.CONTINUE
    assert planner.report("b", Progress(0, 1, 10, 1.0, 10), 1.0).kind is K.CONTINUE
    planner.report("a", Progress(0, 2, 20, 1.0, 10), 2.0)
    first = planner.report("b", Progress(0, 2, 20, 1.0, 10), 2.0)
    assert first.kind is K.SYNC_AFTER and planner.sync_at is not None
    target = planner.target("b")
    assert target is not None and first.batches == target - 2
    # A slower batch afterwards does not move the promise already made.
    again = planner.report("b", Progress(0, 3, 30, 5.0, 10), 7.0)
    assert again == Directive(K.SYNC_AFTER, target - 3, 0)
    last = planner.report("b", Progress(0, target, target * 10, 1.0, 10), 20.0)
    assert last == Directive(K.SYNC_NOW, 0, 0)


def test_new_rounds_stragglers_late_joiners_and_the_end() -> None:
    planner = RoundPlanner(40, 2)
    planner.add_worker("a", 10)
    planner.report("a", Progress(0, 1, 10, 1.0, 10), 1.0)
    assert planner.report("a", Progress(1, 1, 10, 1.0, 10), 5.0).round == 1
    assert planner.round == 1 and planner.target("a") is None
    assert planner.report("b", Progress(0, 3, 30, 1.0, 10), 5.0) == Directive(K.SYNC_NOW, 0, 0)
    assert planner.report("a", Progress(2, 0, 0, 0.0, 10), 9.0).kind is K.DONE
    # A worker that shows up after the plan gets what fits before the sync point.
    planner = RoundPlanner(30, 1, lookahead=1.0)
    planner.add_worker("a", 10)
    planner.report("a", Progress(0, 1, 10, 1.0, 10), 1.0)
    assert planner.report("a", Progress(0, 2, 20, 1.0, 10), 2.0) == Directive(K.SYNC_AFTER, 1, 0)
    late = planner.report("c", Progress(0, 1, 5, 0.5, 5), 2.0)
    assert late == Directive(K.SYNC_AFTER, 2, 0)
    planner.remove_worker("c")
    assert planner.workers == {"a"}


def test_equal_batch_baseline_gives_everyone_the_same_count() -> None:
    planner = EqualBatchPlanner(100, 1)
    planner.add_worker("a", 10)
    planner.add_worker("b", 10)
    assert planner.batches_per_round() == 5
    assert planner.report("a", Progress(0, 1, 10, 1.0, 10), 1.0) == Directive(K.SYNC_AFTER, 4, 0)
    assert planner.report("b", Progress(0, 5, 50, 3.0, 10), 15.0) == Directive(K.SYNC_NOW, 0, 0)
    assert planner.report("b", Progress(1, 0, 0, 0.0, 10), 15.0).kind is K.DONE


def test_directives_and_reports_convert_at_the_edge() -> None:
    d = Directive(K.SYNC_AFTER, 3, 2)
    assert Directive.from_proto(d.to_proto()) == d
    with pytest.raises(InvalidArgumentError):
        RoundPlanner(0, 1)
    with pytest.raises(InvalidArgumentError):
        RoundPlanner(10, 1, lookahead=0.0)


def test_the_planner_factory_makes_one_round_planner_per_job_with_the_configured_lookahead() -> None:
    make = round_planners(lookahead=0.5)
    spec = common_pb2.DilocoJobSpec(samples_per_round=64, rounds=3)

    first, second = make(spec), make(spec)

    assert isinstance(first, RoundPlanner) and first is not second
    assert (first.samples_per_round, first.rounds, first.lookahead) == (64, 3, 0.5)
    planners: list[Planner] = [first, EqualBatchPlanner(64, 3)]  # both satisfy the Protocol
    assert all(p.rates() == {} for p in planners)
