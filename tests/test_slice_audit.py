"""The slice audit (``hypha.testing.cluster.slice_uses``) the chaos runs judge "each slice once per
epoch" by: a use re-reported to a restarted scheduler is one use, a slice used twice is two."""

from __future__ import annotations

from hypha.testing.cluster import slice_uses, slices_exactly_once

STAMP = "2026-11-28 22:52:07,663 scheduler"
START = f"{STAMP} INFO hypha.net.server: listening on 127.0.0.1:7200 as s (scheduler)"


def used(index: int, epoch: int, worker: str) -> str:
    audit = f"job j1: slice {index} used in epoch {epoch} by {worker}"
    return f"{STAMP} DEBUG hypha.scheduler.diloco.run: {audit}"


def test_a_use_the_crash_lost_and_the_trainer_reported_again_counts_once() -> None:
    log = "\n".join([START, used(0, 0, "t1"), used(1, 0, "t1"), START, used(1, 0, "t1"), used(0, 1, "t1")])

    assert slice_uses(log) == {("j1", 0): [0, 1], ("j1", 1): [0]}
    assert slices_exactly_once(log, 2)


def test_a_slice_used_twice_in_one_process_or_by_another_trainer_after_a_restart_counts_twice() -> None:
    twice = "\n".join([START, used(0, 0, "t1"), used(0, 0, "t1")])
    elsewhere = "\n".join([START, used(0, 0, "t1"), START, used(0, 0, "t2")])

    assert slice_uses(twice) == {("j1", 0): [0, 0]}
    assert slice_uses(elsewhere) == {("j1", 0): [0, 0]}
    assert not slices_exactly_once(twice, 1) and not slices_exactly_once(elsewhere, 1)
