"""The slice tracker: every slice trained on exactly once per epoch, whatever workers do."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import (
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    OutOfRangeError,
)
from hypha.scheduler.diloco.slice_tracker import SliceSnapshot, SliceState, SliceTracker

A, S, U = SliceState.AVAILABLE, SliceState.ASSIGNED, SliceState.USED


def _finish_epoch(tracker: SliceTracker, worker: str) -> list[int]:
    """Let one worker work through the rest of the epoch; returns what it used."""
    start, done = tracker.epoch, []
    while tracker.epoch == start:
        index = tracker.next_slice(worker)
        assert index is not None
        tracker.mark_used(worker, index)
        done.append(index)
    return done


def test_slices_move_available_assigned_used_and_the_epoch_rolls_over() -> None:
    # Prepare
    tracker = SliceTracker(3)

    # Execute / Assert
    first = tracker.next_slice("w1")
    assert first == 0 and tracker.state(0) is S and tracker.holder(0) == "w1"
    tracker.mark_used("w1", 0)
    assert tracker.state(0) is U and tracker.counts() == {A: 2, S: 0, U: 1}
    assert sorted(_finish_epoch(tracker, "w1")) == [1, 2]
    assert tracker.epoch == 1
    assert tracker.counts() == {A: 3, S: 0, U: 0}


def test_only_the_holder_may_mark_a_slice_used() -> None:
    tracker = SliceTracker(4)
    index = tracker.next_slice("w1")
    assert index is not None
    with pytest.raises(FailedPreconditionError, match="assigned to w1"):
        tracker.mark_used("w2", index)
    with pytest.raises(IllegalTransitionError, match="available -> used"):
        tracker.mark_used("w1", 3)
    tracker.mark_used("w1", index)
    with pytest.raises(IllegalTransitionError, match="used -> used"):
        tracker.mark_used("w1", index)


def test_lost_worker_slices_return_and_its_late_report_is_refused() -> None:
    # Prepare
    tracker = SliceTracker(5)
    held = [tracker.next_slice("w1"), tracker.next_slice("w1")]

    # Execute
    returned = tracker.worker_lost("w1")

    # Assert
    assert returned == held == [0, 1]
    assert tracker.counts() == {A: 5, S: 0, U: 0}
    assert "w1" not in tracker.workers
    with pytest.raises(IllegalTransitionError):
        tracker.mark_used("w1", 0)
    assert tracker.worker_lost("w1") == []


def test_workers_get_their_own_slices_back_next_epoch() -> None:
    # Prepare: two workers alternate through epoch 0.
    tracker = SliceTracker(6, prefetch=1)
    mine: dict[str, set[int]] = {"a": set(), "b": set()}
    while tracker.epoch == 0:
        for worker in ("a", "b"):
            index = tracker.next_slice(worker)
            if index is not None:
                tracker.mark_used(worker, index)
                mine[worker].add(index)

    # Execute: epoch 1, in the opposite order of asking.
    again: dict[str, set[int]] = {"a": set(), "b": set()}
    for _ in range(3):
        for worker in ("b", "a"):
            index = tracker.next_slice(worker)
            assert index is not None
            tracker.mark_used(worker, index)
            again[worker].add(index)

    # Assert
    assert again == mine
    assert tracker.affinity("a") == frozenset(mine["a"])


def test_newcomer_leaves_live_workers_cached_slices_alone_while_it_can() -> None:
    # Prepare: "a" used 0..3 in epoch 0.
    tracker = SliceTracker(4, prefetch=1)
    _finish_epoch(tracker, "a")
    tracker.worker_lost("a")
    tracker.next_slice("a")  # back again: 0, its own
    tracker.mark_used("a", 0)

    # Execute: "b" joins; every AVAILABLE slice is a's, so b takes one anyway.
    taken = tracker.next_slice("b")

    # Assert
    assert taken == 1
    tracker.worker_lost("a")
    # With "a" gone its slices are free to anyone, lowest first.
    assert tracker.next_slice("c") == 2


def test_new_worker_prefers_slices_no_live_worker_owns() -> None:
    # Prepare: in epoch 0 "a" uses 0 and 1, "gone" uses 2, 3 and 4, then leaves.
    tracker = SliceTracker(5, prefetch=1)
    for worker, count in (("a", 2), ("gone", 3)):
        for _ in range(count):
            tracker.mark_used(worker, _take(tracker, worker))
    tracker.worker_lost("gone")

    # Execute / Assert: the newcomer takes gone's cached slices, not a's.
    assert tracker.next_slice("new") == 2
    assert tracker.next_slice("a") == 0


def _take(tracker: SliceTracker, worker: str) -> int:
    index = tracker.next_slice(worker)
    assert index is not None
    return index


def test_prefetch_limits_slices_held_at_once() -> None:
    tracker = SliceTracker(10, prefetch=2)
    tracker.next_slice("w")
    tracker.next_slice("w")
    with pytest.raises(FailedPreconditionError, match="prefetch"):
        tracker.next_slice("w")
    tracker.mark_used("w", 0)
    assert tracker.next_slice("w") == 2


def test_released_slice_goes_to_the_next_asker() -> None:
    tracker = SliceTracker(3)
    tracker.next_slice("w1")
    tracker.release("w1", 0)
    assert tracker.state(0) is A
    assert tracker.next_slice("w2") == 0
    with pytest.raises(FailedPreconditionError):
        tracker.release("w1", 0)


def test_nothing_available_means_wait_unless_stealing() -> None:
    # Prepare: "slow" holds the last two slices of the epoch.
    plain, stealing = SliceTracker(3), SliceTracker(3, steal=True)
    for tracker in (plain, stealing):
        tracker.next_slice("fast")
        tracker.mark_used("fast", 0)
        tracker.next_slice("slow")
        tracker.next_slice("slow")

    # Execute / Assert
    assert plain.next_slice("fast") is None
    assert stealing.next_slice("fast") == 2  # the queued one, not the one in progress
    assert stealing.assigned("slow") == (1,)
    assert stealing.take_revoked("slow") == [2]
    assert stealing.take_revoked("slow") == []
    with pytest.raises(FailedPreconditionError):
        stealing.mark_used("slow", 2)
    # A victim down to the slice it is training on is not robbed.
    assert stealing.next_slice("other") is None


def test_only_an_idle_worker_steals() -> None:
    # Prepare: "fast" still holds slice 1 while "slow" holds 2 and 3.
    tracker = SliceTracker(4, steal=True)
    tracker.mark_used("fast", _take(tracker, "fast"))
    _take(tracker, "fast")
    _take(tracker, "slow")
    _take(tracker, "slow")

    # Execute / Assert
    assert tracker.next_slice("fast") is None
    tracker.mark_used("fast", 1)
    assert tracker.next_slice("fast") == 3


def test_slices_of_a_worker_lost_earlier_are_free_next_epoch() -> None:
    # Prepare: "gone" uses slice 1 and leaves before the epoch ends.
    tracker = SliceTracker(3, prefetch=1)
    tracker.mark_used("a", _take(tracker, "a"))
    tracker.mark_used("gone", _take(tracker, "gone"))
    tracker.worker_lost("gone")
    tracker.mark_used("a", _take(tracker, "a"))
    assert tracker.epoch == 1

    # Execute / Assert: a newcomer gets gone's slice, not one of a's.
    assert tracker.next_slice("new") == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        SliceTracker(0)
    with pytest.raises(InvalidArgumentError):
        SliceTracker(3, prefetch=0)
    tracker = SliceTracker(3)
    for index in (-1, 3):
        with pytest.raises(OutOfRangeError):
            tracker.mark_used("w", index)
        with pytest.raises(OutOfRangeError):
            tracker.state(index)


def _through_json(snap: SliceSnapshot) -> SliceSnapshot:
    """``snap`` as the store gives it back: JSON, row keys as strings."""
    header, rows = json.loads(json.dumps([snap.header, {str(i): r for i, r in snap.rows.items()}]))
    return SliceSnapshot(header, {int(i): r for i, r in rows.items()})


def test_snapshot_restores_an_equivalent_tracker() -> None:
    # Prepare
    tracker = SliceTracker(6, prefetch=2, steal=True)
    _finish_epoch(tracker, "a")
    tracker.next_slice("a")
    tracker.next_slice("b")
    tracker.mark_used("b", tracker.assigned("b")[0])
    tracker.next_slice("b")

    # Execute
    snap = tracker.snapshot()
    restored = SliceTracker.from_snapshot(_through_json(snap))

    # Assert
    assert restored.snapshot() == snap
    assert [restored.next_slice(w) for w in ("a", "c")] == [tracker.next_slice(w) for w in ("a", "c")]


def test_changes_hold_only_what_moved_and_a_lost_save_is_taken_again() -> None:
    # Prepare: a tracker whose first (full) changes were saved.
    tracker = SliceTracker(1000)
    assert tracker.take_changes().full
    first = tracker.next_slice("w")
    assert first is not None

    # Execute / Assert: a hand-out changes the header only; a USED report one row.
    handed = tracker.take_changes()
    assert not handed.full and handed.rows == {} and handed.header["held"] == {"w": [first]}
    tracker.mark_used("w", first)
    used = tracker.take_changes()
    assert used.rows == {first: ("w", 0)}
    tracker.changes_lost(used)  # its save failed: the next changes carry it again
    assert tracker.take_changes().rows == {first: ("w", 0)}
    assert tracker.take_changes().rows == {}


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda h, r: h["held"].update(x=[0]), id="held-twice"),
        pytest.param(lambda h, r: h["held"].update(x=[1, 2, 3]), id="over-prefetch"),
        pytest.param(lambda h, r: r.update({0: ["w", 0]}), id="used-but-held"),
        pytest.param(lambda h, r: r.update({6: ["w", -1]}), id="row-out-of-range"),
        pytest.param(
            lambda h, r: (h.update(held={}), r.update({i: ["w", 0] for i in range(6)})), id="done-epoch"
        ),
        pytest.param(lambda h, r: h.update(held="nonsense"), id="garbage"),
    ],
)
def test_inconsistent_snapshot_is_refused(edit: object) -> None:
    tracker = SliceTracker(6)
    tracker.next_slice("w")
    snap = _through_json(tracker.snapshot())
    rows = dict(snap.rows)
    edit(snap.header, rows)  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError):
        SliceTracker.from_snapshot(SliceSnapshot(snap.header, rows))


# ---- property: random joins, losses and speeds --------------------------------


@dataclass
class _Model:
    """What the test itself knows, independent of the tracker's internals."""

    held: dict[str, list[int]] = field(default_factory=dict)  # live workers, oldest first
    owner: dict[int, str] = field(default_factory=dict)  # last worker to use each slice
    used: dict[int, list[int]] = field(default_factory=dict)  # epoch -> slices used in it


OPS = st.lists(
    st.tuples(
        st.sampled_from(["next", "next", "use", "use", "lose", "release", "restore"]), st.integers(0, 3)
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    slice_count=st.integers(1, 8),
    prefetch=st.integers(1, 3),
    steal=st.booleans(),
    ops=OPS,
)
def test_every_slice_is_used_exactly_once_per_epoch(
    slice_count: int, prefetch: int, steal: bool, ops: list[tuple[str, int]]
) -> None:
    tracker = SliceTracker(slice_count, prefetch=prefetch, steal=steal)
    saved_rows: dict[int, tuple[str | None, int]] = {}  # what the restores have saved so far
    model = _Model()

    def use(worker: str) -> None:
        nonlocal tracker
        index = model.held[worker].pop(0)  # workers train in the order they were given slices
        epoch = tracker.epoch
        tracker.mark_used(worker, index)
        model.used.setdefault(epoch, []).append(index)
        model.owner[index] = worker
        assert model.used[epoch].count(index) == 1, "a slice was used twice in one epoch"
        if tracker.epoch != epoch:
            assert tracker.epoch == epoch + 1
            assert sorted(model.used[epoch]) == list(range(slice_count)), "epoch ended early"
            assert tracker.counts() == {A: slice_count, S: 0, U: 0}

    def ask(worker: str) -> int | None:
        holding = model.held.setdefault(worker, [])
        if len(holding) >= prefetch:
            with pytest.raises(FailedPreconditionError):
                tracker.next_slice(worker)
            return None
        available = {i for i in range(slice_count) if tracker.state(i) is A}
        own = {i for i in available if model.owner.get(i) == worker}
        free = {i for i in available if model.owner.get(i) not in model.held}
        victims = {w: h for w, h in model.held.items() if w != worker and len(h) >= 2}
        index = tracker.next_slice(worker)
        # Affinity first, then slices no live worker has cached, then anything.
        if own:
            assert index == min(own)
        elif free:
            assert index == min(free)
        elif available:
            assert index == min(available)
        elif steal and not holding and victims:
            most = max(len(h) for h in victims.values())
            victim = min(w for w, h in victims.items() if len(h) == most)
            assert index == victims[victim][-1]
            victims[victim].pop()
        else:
            assert index is None
        if index is not None:
            holding.append(index)
        return index

    for op, n in ops:
        worker = f"w{n}"
        if op == "next":
            ask(worker)
        elif op == "use":
            if model.held.get(worker):
                use(worker)
            else:
                with pytest.raises(FailedPreconditionError):
                    tracker.mark_used(worker, n % slice_count)
        elif op == "lose":
            assert tracker.worker_lost(worker) == sorted(model.held.pop(worker, []))
        elif op == "release" and model.held.get(worker):
            tracker.release(worker, model.held[worker].pop())
        elif op == "restore":
            # Rebuilt from what its changes saved, as a restarted scheduler does.
            changes = tracker.take_changes()
            saved_rows = {} if changes.full else saved_rows
            saved_rows.update(changes.rows)
            tracker = SliceTracker.from_snapshot(_through_json(SliceSnapshot(changes.header, saved_rows)))
        # Invariants after every step.
        assert tracker.workers == frozenset(model.held)
        for w, h in model.held.items():
            assert list(tracker.assigned(w)) == h
            assert len(h) <= prefetch
        assigned = {i for i in range(slice_count) if tracker.state(i) is S}
        assert assigned == {i for h in model.held.values() for i in h}
        assert {i for i in range(slice_count) if tracker.state(i) is U} == set(
            model.used.get(tracker.epoch, [])
        )
        assert sum(tracker.counts().values()) == slice_count

    # Drain: the live workers (or a fresh one if none is left) finish this
    # epoch and one more, taking turns in a rotating order so that owned
    # slices matter; nothing may stay stranded in ASSIGNED.
    workers = sorted(model.held) or ["drainer"]
    start = tracker.epoch
    for turn in range(2 * slice_count * (prefetch + 2) + 10):
        if tracker.epoch == start + 2:
            break
        worker = workers[turn % len(workers)]
        epoch = tracker.epoch
        while model.held.get(worker) and tracker.epoch == epoch:
            use(worker)
        if tracker.epoch == epoch:
            ask(worker)
    assert tracker.epoch == start + 2, "the live workers could not finish the epoch"
