"""One DirectiveKind for scheduler, worker and bridge: wire values and bridge text map both ways."""

from __future__ import annotations

import pytest

from hypha.directives import DirectiveKind
from hypha.v1 import scheduler_pb2


@pytest.mark.parametrize("kind", list(DirectiveKind))
def test_every_kind_survives_the_wire(kind: DirectiveKind) -> None:
    assert DirectiveKind.from_proto(kind.to_proto()) is kind


def test_unspecified_or_unknown_wire_values_are_none() -> None:
    assert DirectiveKind.from_proto(scheduler_pb2.DIRECTIVE_KIND_UNSPECIFIED) is None
    assert DirectiveKind.from_proto(99) is None


def test_bridge_text_parses_and_unknown_text_means_continue() -> None:
    assert DirectiveKind.parse("sync_after") is DirectiveKind.SYNC_AFTER
    assert DirectiveKind.parse(DirectiveKind.DONE) is DirectiveKind.DONE
    assert DirectiveKind.parse("rewind") is DirectiveKind.CONTINUE
