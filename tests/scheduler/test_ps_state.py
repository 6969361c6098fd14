"""The scheduler's copy of a parameter server's state: read without torch, kept atomically, newest wins."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hypha.errors import DataLossError
from hypha.scheduler.diloco.ps_state import PACKED_ROUND_KEY, StateKeeper, packed_round


def _blob(round_: int | None, body: bytes = b"\0" * 16) -> bytes:
    """A safetensors file as ``checkpoint.pack`` writes one (the round in the header's metadata)."""
    header: dict[str, object] = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, len(body)]}}
    if round_ is not None:
        header["__metadata__"] = {PACKED_ROUND_KEY: str(round_)}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def test_the_round_is_read_from_the_header_alone() -> None:
    assert packed_round(_blob(7)) == 7


@pytest.mark.parametrize("blob", [b"", b"short", _blob(None), b"\xff" * 8 + b"{}"])
def test_a_blob_naming_no_round_is_data_loss(blob: bytes) -> None:
    with pytest.raises(DataLossError):
        packed_round(blob)


async def test_the_newest_state_replaces_the_older_one_on_disk(tmp_path: Path) -> None:
    keeper = StateKeeper(tmp_path, "job-1")

    first = await keeper.keep(_blob(1), 1)
    second = await keeper.keep(_blob(2, b"\1" * 16), 2)

    assert [p.name for p in keeper.directory.iterdir()] == ["round-00000002.safetensors"]
    assert second.round == 2 and second.path.read_bytes() == _blob(2, b"\1" * 16)
    assert first.sha256 != second.sha256
    assert await keeper.read() == _blob(2, b"\1" * 16)
    # A late commit of an older round changes nothing.
    assert await keeper.keep(_blob(1), 1) == second


async def test_a_state_for_another_round_is_refused(tmp_path: Path) -> None:
    keeper = StateKeeper(tmp_path, "job-1")
    with pytest.raises(DataLossError, match="holds round 3"):
        await keeper.keep(_blob(3), 2)
    assert keeper.latest is None and await keeper.read() is None


async def test_drop_forgets_the_job(tmp_path: Path) -> None:
    keeper = StateKeeper(tmp_path, "job-1")
    await keeper.keep(_blob(1), 1)
    await keeper.drop()
    assert not keeper.directory.exists() and keeper.latest is None
