"""Price per unit of capacity: the one number both sides of the market rank by.

A scheduler prefers the offer with the lowest score (most capacity per token);
a worker prefers the advertisement with the highest bid per unit it would give
up. Both use the same weights so the two rankings are comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypha.errors import InvalidArgumentError
from hypha.market.resources import Resources
from hypha.v1 import common_pb2


@dataclass(frozen=True)
class Weights:
    """How many capacity units one of each resource is worth.

    Defaults follow the reference system: a GPU is worth 25 cores, a GB of
    memory a tenth of a core, a GB of storage a hundredth. GPU memory is
    weighted zero by default because the GPU count already prices it.
    """

    gpu: float = 25.0
    cpu: float = 1.0
    mem_gb: float = 0.1
    storage_gb: float = 0.01
    gpu_memory_gb: float = 0.0


DEFAULT_WEIGHTS = Weights()


def capacity_units(resources: Resources, weights: Weights = DEFAULT_WEIGHTS) -> float:
    return (
        weights.gpu * resources.gpu
        + weights.cpu * resources.cpu
        + weights.mem_gb * resources.memory_gb
        + weights.storage_gb * resources.storage_gb
        + weights.gpu_memory_gb * resources.gpu_memory_gb
    )


def score(price: float, resources: Resources, weights: Weights = DEFAULT_WEIGHTS) -> float:
    """Price per capacity unit; lower is a better deal for the buyer.

    Nothing (zero or less capacity) is infinitely expensive, so it ranks last.
    """
    units = capacity_units(resources, weights)
    if units <= 0.0:
        return math.inf
    return price / units


@dataclass(frozen=True)
class PriceRange:
    """What a scheduler will pay: it publishes ``bid`` and keeps ``max`` private."""

    bid: float
    max: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bid) and math.isfinite(self.max)):
            raise InvalidArgumentError("price range: bid and max must be finite")
        if self.bid < 0.0:
            raise InvalidArgumentError(f"price range: bid {self.bid} is negative")
        if self.max < self.bid:
            raise InvalidArgumentError(f"price range: max {self.max} is below bid {self.bid}")

    @classmethod
    def from_proto(cls, msg: common_pb2.PriceRange) -> PriceRange:
        return cls(bid=msg.bid, max=msg.max)

    def to_proto(self) -> common_pb2.PriceRange:
        return common_pb2.PriceRange(bid=self.bid, max=self.max)
