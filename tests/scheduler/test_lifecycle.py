"""The job state machine: only the table's moves are allowed, and finished jobs stay finished."""

from __future__ import annotations

import itertools

import pytest

from hypha.errors import IllegalTransitionError, InvalidArgumentError
from hypha.scheduler.lifecycle import ACTIVE, TERMINAL, TRANSITIONS, JobState, sources_of, transition
from hypha.v1 import common_pb2

ALL_PAIRS = list(itertools.product(JobState, JobState))


@pytest.mark.parametrize(("current", "target"), sorted(TRANSITIONS))
def test_allowed_moves_return_the_target(current: JobState, target: JobState) -> None:
    assert transition(current, target, "j1") is target


@pytest.mark.parametrize(("current", "target"), [p for p in ALL_PAIRS if p not in TRANSITIONS])
def test_every_other_move_raises_naming_both_states(current: JobState, target: JobState) -> None:
    with pytest.raises(IllegalTransitionError) as info:
        transition(current, target, "j1")
    assert info.value.current == current.value and info.value.target == target.value
    assert f"{current.value} -> {target.value}" in info.value.message and "job j1" in info.value.message


def test_terminal_states_have_no_way_out_and_active_ones_can_always_be_cancelled() -> None:
    for state in TERMINAL:
        assert state.terminal
        assert not [t for (s, t) in TRANSITIONS if s is state]
    for state in ACTIVE:
        assert not state.terminal
        assert (state, JobState.CANCELLED) in TRANSITIONS and (state, JobState.FAILED) in TRANSITIONS


def test_a_running_job_can_go_back_to_allocating_for_a_replacement_and_to_the_queue_for_a_retry() -> None:
    assert transition(JobState.RUNNING, JobState.ALLOCATING) is JobState.ALLOCATING
    assert transition(JobState.RUNNING, JobState.PENDING) is JobState.PENDING
    assert sources_of(JobState.SUCCEEDED) == {JobState.RUNNING}


def test_states_convert_to_and_from_proto_and_parse_user_spellings() -> None:
    for state in JobState:
        assert JobState.from_proto(state.to_proto()) is state
    assert JobState.parse("RUNNING") is JobState.RUNNING
    assert JobState.parse("job_state_failed") is JobState.FAILED
    with pytest.raises(InvalidArgumentError, match="unknown job state"):
        JobState.parse("sleeping")
    with pytest.raises(InvalidArgumentError):
        JobState.from_proto(common_pb2.JOB_STATE_UNSPECIFIED)
