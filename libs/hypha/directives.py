"""What the scheduler tells a DiLoCo trainer after each progress report.

The scheduler decides (``hypha.scheduler.diloco.round_planner``), the trainer obeys
(``hypha.worker.executors.diloco_trainer``), and the job bridge carries the
value between them as its string; the proto enum ``DirectiveKind`` carries it
on the wire. This is the one definition both roles share. It lives outside
``hypha.diloco`` because that package loads torch and the scheduler must not.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from hypha.v1 import scheduler_pb2


class DirectiveKind(StrEnum):
    CONTINUE = "continue"  # run another batch and report again
    SYNC_AFTER = "sync_after"  # run `batches` more, then sync
    SYNC_NOW = "sync_now"  # send the delta now
    DONE = "done"  # the job is over

    # NOTE: the proto enum values are named DIRECTIVE_KIND_<NAME>; the import is
    # local so an executor program using only the bridge client loads no protobuf.

    def to_proto(self) -> scheduler_pb2.DirectiveKind:
        from hypha.v1 import scheduler_pb2

        return cast(
            "scheduler_pb2.DirectiveKind", scheduler_pb2.DirectiveKind.Value(f"DIRECTIVE_KIND_{self.name}")
        )

    @classmethod
    def from_proto(cls, value: int) -> DirectiveKind | None:
        """The kind of a wire value; None for UNSPECIFIED or one this version does not know."""
        from hypha.v1 import scheduler_pb2

        try:
            name = scheduler_pb2.DirectiveKind.Name(value)
        except ValueError:
            return None
        return cls.__members__.get(name.removeprefix("DIRECTIVE_KIND_"))

    @classmethod
    def parse(cls, text: object) -> DirectiveKind:
        """The kind named by ``text`` (the bridge's JSON); an unknown one means carry on."""
        try:
            return cls(str(text))
        except ValueError:
            return cls.CONTINUE


__all__ = ["DirectiveKind"]
