"""Resources as a value type: what a worker has, what a lease holds, what a job needs.

Resources add and subtract, and they are only partially ordered: one fits in
another when every field fits, and two machines can be incomparable (more GPUs
but less memory). Protobuf appears only in ``from_proto``/``to_proto`` so the
market core never handles pb2 objects.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, fields
from enum import StrEnum

from hypha.errors import InvalidArgumentError
from hypha.v1 import common_pb2

#: Decimal places every quantity is rounded to.
#: NOTE: rounding after every construction keeps arithmetic exact on a decimal
#: grid, so a pool that hands out 0.1 + 0.2 CPU and takes both back is exactly
#: whole again; with raw floats the drift would slowly make "fits" lie.
#: Nine places is finer than any real quantity and exact for values below 1e6.
PRECISION = 9


class ExecutorKind(StrEnum):
    """What a worker runs; the same names appear in job files and configs."""

    DILOCO_TRAINER = "diloco-trainer"
    PARAMETER_SERVER = "parameter-server"
    TASK = "task"
    INFERENCE = "inference"

    @classmethod
    def parse(cls, name: str) -> ExecutorKind:
        """A kind from its config/CLI name; the error lists the valid names."""
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(kind.value for kind in cls)
            raise InvalidArgumentError(f"unknown executor kind {name!r} (valid: {valid})") from None

    @classmethod
    def from_proto(cls, value: common_pb2.ExecutorKind | int) -> ExecutorKind:
        kind = _KIND_FROM_PROTO.get(int(value))
        if kind is None:
            raise InvalidArgumentError(f"executor kind {value} is unspecified or unknown")
        return kind

    def to_proto(self) -> common_pb2.ExecutorKind:
        return _KIND_TO_PROTO[self]


_KIND_TO_PROTO: dict[ExecutorKind, common_pb2.ExecutorKind] = {
    ExecutorKind.DILOCO_TRAINER: common_pb2.EXECUTOR_KIND_DILOCO_TRAINER,
    ExecutorKind.PARAMETER_SERVER: common_pb2.EXECUTOR_KIND_PARAMETER_SERVER,
    ExecutorKind.TASK: common_pb2.EXECUTOR_KIND_TASK,
    ExecutorKind.INFERENCE: common_pb2.EXECUTOR_KIND_INFERENCE,
}
_KIND_FROM_PROTO: dict[int, ExecutorKind] = {int(v): k for k, v in _KIND_TO_PROTO.items()}


_FIELDS = ("cpu", "memory_gb", "storage_gb", "gpu", "gpu_memory_gb")


def _quantize(value: float) -> float:
    # `+ 0.0` turns -0.0 into 0.0 so equal quantities compare and print alike.
    return round(float(value), PRECISION) + 0.0


@dataclass(frozen=True)
class Resources:
    """A quantity of compute: capacity, a reservation or a minimum.

    Values may be negative only as the result of a subtraction (a deficit);
    anything received from outside is checked with ``require_non_negative``.
    """

    cpu: float = 0.0  #: cores
    memory_gb: float = 0.0
    storage_gb: float = 0.0
    gpu: float = 0.0  #: number of GPUs
    gpu_memory_gb: float = 0.0  #: total GPU memory across those GPUs

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            # NOTE: the exact-type test first: ``isinstance(x, numbers.Real)`` goes through
            # the ABC machinery, and every advertisement and offer builds several of these.
            if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise InvalidArgumentError(f"resources: {name} must be a finite number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidArgumentError(f"resources: {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, _quantize(float(value)))

    def _values(self) -> tuple[float, ...]:
        return (self.cpu, self.memory_gb, self.storage_gb, self.gpu, self.gpu_memory_gb)

    @classmethod
    def _of(cls, values: tuple[float, ...]) -> Resources:
        return cls(*values)

    def __add__(self, other: Resources) -> Resources:
        if not isinstance(other, Resources):
            return NotImplemented
        return self._of(tuple(a + b for a, b in zip(self._values(), other._values(), strict=True)))

    def __sub__(self, other: Resources) -> Resources:
        if not isinstance(other, Resources):
            return NotImplemented
        return self._of(tuple(a - b for a, b in zip(self._values(), other._values(), strict=True)))

    def fits_in(self, other: Resources) -> bool:
        """True when every field of ``self`` is at most the same field of ``other``."""
        return all(a <= b for a, b in zip(self._values(), other._values(), strict=True))

    def is_zero(self) -> bool:
        return all(v == 0.0 for v in self._values())

    def is_non_negative(self) -> bool:
        return all(v >= 0.0 for v in self._values())

    def require_non_negative(self, what: str = "resources") -> Resources:
        """Return ``self``, or raise ``InvalidArgumentError`` naming the negative fields."""
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0.0]
        if negative:
            raise InvalidArgumentError(f"{what}: negative {', '.join(negative)}")
        return self

    @classmethod
    def total(cls, items: Iterable[Resources]) -> Resources:
        result = cls()
        for item in items:
            result = result + item
        return result

    @classmethod
    def from_proto(cls, msg: common_pb2.Resources) -> Resources:
        """Validate at the edge: received quantities must be finite and non-negative."""
        return cls(
            cpu=msg.cpu,
            memory_gb=msg.memory_gb,
            storage_gb=msg.storage_gb,
            gpu=msg.gpu,
            gpu_memory_gb=msg.gpu_memory_gb,
        ).require_non_negative()

    def to_proto(self) -> common_pb2.Resources:
        return common_pb2.Resources(
            cpu=self.cpu,
            memory_gb=self.memory_gb,
            storage_gb=self.storage_gb,
            gpu=self.gpu,
            gpu_memory_gb=self.gpu_memory_gb,
        )


@dataclass(frozen=True)
class Requirements:
    """What a piece of work needs: a resource minimum on a worker that runs ``executor``."""

    minimum: Resources
    executor: ExecutorKind

    @classmethod
    def from_proto(cls, msg: common_pb2.Requirements) -> Requirements:
        return cls(
            minimum=Resources.from_proto(msg.minimum),
            executor=ExecutorKind.from_proto(msg.executor),
        )

    def to_proto(self) -> common_pb2.Requirements:
        return common_pb2.Requirements(minimum=self.minimum.to_proto(), executor=self.executor.to_proto())


# ``Resources.__post_init__`` walks ``_FIELDS`` instead of ``fields()`` (hot path); keep them one list.
assert _FIELDS == tuple(f.name for f in fields(Resources)), "update resources._FIELDS"
