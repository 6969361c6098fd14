"""The compose chaos run's time-to-recover figures, from round histories made up here."""

from __future__ import annotations

from hypha.testing.compose_chaos import Fault, Followed, JobPlan, heal_target_values, recoveries, settled


def _history(*rounds: tuple[float, int]) -> list[tuple[float, int, str]]:
    return [(at, round_, "running") for at, round_ in rounds]


def test_recovery_is_timed_from_the_fault_and_heal_from_the_heal() -> None:
    # Job a waits out a brief partition of its trainer (cut at 10 s, back at 12.5 s), job b
    # loses its server to a kill at 30 s.
    histories = {
        "a": _history((4.0, 1), (8.0, 2), (14.0, 3), (18.0, 4)),
        "b": _history((25.0, 1), (29.0, 2), (37.5, 3)),
    }
    partition = Fault("partition", "trainer", "c1", at=10.0, rounds_at={"a": 2}, healed_at=12.5)
    kill = Fault("kill", "parameter-server", "c2", at=30.0, rounds_at={"b": 2}, restarted_at=36.0)
    by_kind, node_loss, heals = recoveries([partition, kill], histories)
    assert by_kind == {"partition trainer": [4.0], "kill parameter-server": [7.5]}
    assert node_loss == [7.5]
    assert heals == {"partition trainer": [1.5]}
    assert heal_target_values(heals) == [1.5]


def test_a_long_partition_is_a_node_loss_and_its_heal_is_not_held_to_the_heal_target() -> None:
    # The trainer is cut off for 15 s: the job goes on with a replacement (round 3 at 17 s),
    # and its next round after the heal (at 25 s) comes at its own pace, 5.5 s later.
    histories = {"a": _history((4.0, 1), (8.0, 2), (17.0, 3), (24.0, 4), (30.5, 5), (34.0, 6))}
    long = Fault("long-partition", "trainer", "c1", at=10.0, rounds_at={"a": 2}, healed_at=25.0)
    brief = Fault("partition", "parameter-server", "c2", at=31.0, rounds_at={"a": 5}, healed_at=33.0)
    by_kind, node_loss, heals = recoveries([long, brief], histories)
    assert by_kind == {"long-partition trainer": [7.0], "partition parameter-server": [3.0]}
    assert node_loss == [7.0]
    assert heals == {"long-partition trainer": [5.5], "partition parameter-server": [1.0]}
    assert heal_target_values(heals) == [1.0]


def test_a_job_that_ends_before_its_next_round_has_no_time_to_recover() -> None:
    histories = {"a": _history((4.0, 1), (8.0, 2))}
    kill = Fault("kill", "trainer", "c1", at=9.0, rounds_at={"a": 2}, restarted_at=15.0)
    assert recoveries([kill], histories) == ({}, [], {})


def _followed(job_id: str, history: list[tuple[float, int, str]]) -> Followed:
    return Followed(JobPlan(job_id, "diloco", ""), job_id, history)


def test_the_next_fault_waits_for_the_round_after_a_heal() -> None:
    # The trainer is cut off at 10 s with round 2 done; round 3 completes while it is away (its
    # work was in), and it is back at 12.5 s: the job still owes round 4, which needs the node.
    partition = Fault("partition", "trainer", "c1", at=10.0, rounds_at={"a": 2}, healed_at=12.5)
    before = _followed("a", _history((8.0, 2), (11.0, 3), (12.6, 3), (14.0, 3)))
    after = _followed("a", _history((8.0, 2), (11.0, 3), (12.6, 3), (15.0, 4)))
    assert not settled(partition, {"a": before})
    assert settled(partition, {"a": after})


def test_a_kill_is_settled_once_its_node_is_back_and_the_job_moved_on() -> None:
    kill = Fault("kill", "trainer", "c1", at=10.0, rounds_at={"a": 2})
    history = _followed("a", _history((8.0, 2), (14.0, 3)))
    assert not settled(kill, {"a": history})
    kill.restarted_at = 16.0
    assert settled(kill, {"a": history})
    ended = _followed("a", [(8.0, 2, "running"), (11.0, 2, "failed")])
    assert settled(
        Fault("kill", "trainer", "c1", at=10.0, rounds_at={"a": 2}, restarted_at=12.0), {"a": ended}
    )
