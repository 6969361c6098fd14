"""Resources as a value type: arithmetic, partial order, validation, proto edge."""

from __future__ import annotations

import math

import pytest

from hypha.errors import InvalidArgumentError
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.timestamps import to_seconds, to_timestamp
from hypha.v1 import common_pb2


def test_add_and_subtract_fieldwise() -> None:
    a = Resources(cpu=4, memory_gb=16, storage_gb=100, gpu=1, gpu_memory_gb=24)
    b = Resources(cpu=1, memory_gb=2, storage_gb=10, gpu=1, gpu_memory_gb=8)

    assert a + b == Resources(cpu=5, memory_gb=18, storage_gb=110, gpu=2, gpu_memory_gb=32)
    assert a - b == Resources(cpu=3, memory_gb=14, storage_gb=90, gpu=0, gpu_memory_gb=16)
    assert (a - b) + b == a


def test_fits_in_needs_every_field_to_fit() -> None:
    small = Resources(cpu=2, memory_gb=4)
    big = Resources(cpu=8, memory_gb=32, gpu=1)

    assert small.fits_in(big)
    assert not big.fits_in(small)
    assert small.fits_in(small)


def test_machines_with_different_strengths_are_incomparable() -> None:
    gpu_box = Resources(cpu=2, gpu=2)
    cpu_box = Resources(cpu=32, gpu=0)

    assert not gpu_box.fits_in(cpu_box)
    assert not cpu_box.fits_in(gpu_box)


def test_fractional_arithmetic_does_not_drift() -> None:
    pool = Resources(cpu=1.0, memory_gb=0.3)
    piece = Resources(cpu=0.1, memory_gb=0.1)

    used = Resources()
    for _ in range(10):
        used = used + Resources(cpu=0.1)
    three = piece + piece + piece

    assert used == Resources(cpu=1.0)
    assert Resources(cpu=0.1, memory_gb=0.1).fits_in(pool - Resources(cpu=0.9, memory_gb=0.2))
    assert (pool - three) + three == pool
    assert three.memory_gb == 0.3


def test_zero_and_sign_checks() -> None:
    assert Resources().is_zero()
    assert not Resources(storage_gb=0.5).is_zero()
    assert (Resources(cpu=1) - Resources(cpu=1)).is_zero()
    deficit = Resources(cpu=1) - Resources(cpu=2, gpu=1)
    assert not deficit.is_non_negative()
    with pytest.raises(InvalidArgumentError, match="cpu, gpu"):
        deficit.require_non_negative()
    assert Resources(cpu=1).require_non_negative() == Resources(cpu=1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_quantities_are_rejected(bad: float) -> None:
    with pytest.raises(InvalidArgumentError, match="memory_gb"):
        Resources(memory_gb=bad)


def test_total_sums_a_list() -> None:
    assert Resources.total([Resources(cpu=1), Resources(gpu=2), Resources(cpu=0.5)]) == Resources(
        cpu=1.5, gpu=2
    )
    assert Resources.total([]) == Resources()


def test_proto_round_trip() -> None:
    r = Resources(cpu=4, memory_gb=16.5, storage_gb=100, gpu=1, gpu_memory_gb=24)

    assert Resources.from_proto(r.to_proto()) == r


def test_negative_resources_from_the_wire_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="gpu"):
        Resources.from_proto(common_pb2.Resources(cpu=1, gpu=-1))


def test_requirements_round_trip() -> None:
    req = Requirements(Resources(cpu=2, gpu_memory_gb=8), ExecutorKind.PARAMETER_SERVER)

    msg = req.to_proto()

    assert msg.executor == common_pb2.EXECUTOR_KIND_PARAMETER_SERVER
    assert Requirements.from_proto(msg) == req


def test_requirements_without_executor_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="executor"):
        Requirements.from_proto(common_pb2.Requirements(minimum=common_pb2.Resources(cpu=1)))


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (ExecutorKind.DILOCO_TRAINER, common_pb2.EXECUTOR_KIND_DILOCO_TRAINER),
        (ExecutorKind.PARAMETER_SERVER, common_pb2.EXECUTOR_KIND_PARAMETER_SERVER),
        (ExecutorKind.TASK, common_pb2.EXECUTOR_KIND_TASK),
        (ExecutorKind.INFERENCE, common_pb2.EXECUTOR_KIND_INFERENCE),
    ],
)
def test_executor_kind_maps_to_proto_both_ways(kind: ExecutorKind, value: int) -> None:
    assert kind.to_proto() == value
    assert ExecutorKind.from_proto(value) is kind


def test_executor_kind_names_match_the_job_file_names() -> None:
    assert [k.value for k in ExecutorKind] == ["diloco-trainer", "parameter-server", "task", "inference"]
    assert ExecutorKind.parse("task") is ExecutorKind.TASK
    with pytest.raises(InvalidArgumentError, match="diloco-trainer, parameter-server, task, inference"):
        ExecutorKind.parse("gpu-thing")
    with pytest.raises(InvalidArgumentError):
        ExecutorKind.from_proto(common_pb2.EXECUTOR_KIND_UNSPECIFIED)


def test_timestamp_round_trip_keeps_sub_second_precision() -> None:
    assert to_seconds(to_timestamp(1_700_000_000.25)) == pytest.approx(1_700_000_000.25)


def test_quantities_must_be_numbers() -> None:
    with pytest.raises(InvalidArgumentError, match="cpu"):
        Resources(cpu="4")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="gpu"):
        Resources(gpu=True)
    assert Resources(cpu=4).cpu == 4.0
    assert isinstance(Resources(cpu=4).cpu, float)
