"""Price per capacity unit, the number both sides of the market rank by."""

from __future__ import annotations

import math

import pytest

from hypha.errors import InvalidArgumentError
from hypha.market.pricing import PriceRange, Weights, capacity_units, score
from hypha.market.resources import Resources
from hypha.v1 import common_pb2


def test_capacity_units_use_the_reference_weights() -> None:
    r = Resources(cpu=8, memory_gb=32, storage_gb=500, gpu=2, gpu_memory_gb=48)

    # 25*2 + 8 + 0.1*32 + 0.01*500; GPU memory is priced through the GPU count.
    assert capacity_units(r) == pytest.approx(50 + 8 + 3.2 + 5)


def test_custom_weights_change_the_units() -> None:
    weights = Weights(gpu=0, cpu=2, mem_gb=0, storage_gb=0, gpu_memory_gb=1)

    assert capacity_units(Resources(cpu=3, gpu=4, gpu_memory_gb=10), weights) == pytest.approx(16)


def test_score_is_price_per_unit_and_lower_means_more_capacity_per_token() -> None:
    gpu_box = Resources(cpu=4, gpu=1)  # 29 units
    cpu_box = Resources(cpu=4)  # 4 units

    assert score(29.0, gpu_box) == pytest.approx(1.0)
    assert score(10.0, gpu_box) < score(10.0, cpu_box)


def test_nothing_scores_infinitely_expensive() -> None:
    assert score(1.0, Resources()) == math.inf
    assert score(0.0, Resources()) == math.inf


def test_price_range_validates_and_round_trips() -> None:
    pr = PriceRange(bid=1.0, max=2.5)

    assert PriceRange.from_proto(pr.to_proto()) == pr
    with pytest.raises(InvalidArgumentError, match="below bid"):
        PriceRange(bid=3.0, max=2.0)
    with pytest.raises(InvalidArgumentError, match="negative"):
        PriceRange.from_proto(common_pb2.PriceRange(bid=-1.0, max=1.0))
    with pytest.raises(InvalidArgumentError, match="finite"):
        PriceRange(bid=1.0, max=math.inf)
