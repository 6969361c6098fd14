"""SliceReader: a slice checked whole the first time, trusted for a while when unchanged, hashed
as it goes after that, and never handed out whole by a check that finds it no longer matches."""

from __future__ import annotations

import hashlib
import os
from contextlib import aclosing
from pathlib import Path

import pytest
import torch

from hypha.data.servicer import _slice_data
from hypha.data.slices import SliceReader, VerifiedFiles
from hypha.datasets.format import Dataset
from hypha.datasets.prepare import write_dataset
from hypha.errors import DataLossError, OutOfRangeError
from hypha.filestamp import FileStamp
from tests.helpers import eventually


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    gen = torch.Generator().manual_seed(3)
    return write_dataset({"x": torch.randn(24, 512, generator=gen)}, tmp_path, "toy", samples_per_slice=8)


def read_all(reader: SliceReader) -> list[bytes]:
    chunks = []
    try:
        while (data := reader.next_chunk()) is not None:
            chunks.append(data)
    finally:
        reader.close()
    return chunks


def opened(
    dataset: Dataset, verified: VerifiedFiles, index: int = 0, chunk: int = 1000, offset: int = 0
) -> SliceReader:
    reader = SliceReader(dataset, index, chunk, offset, verified)
    reader.open()
    return reader


def pretend_rot_unseen(dataset: Dataset, verified: VerifiedFiles, index: int) -> None:
    """Flip one byte, then record the file's new stamp as verified: the rot ``stat`` cannot show
    (a disk that returns other bytes than were written), which only hashing can catch."""
    path = dataset.slice_path(index)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    verified.record(str(path), FileStamp.of(os.stat(path)))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("chunk", [1, 999, 1 << 20])
@pytest.mark.parametrize("offset", [0, 1, 4000])
def test_every_mode_gives_the_slice_from_any_offset(dataset: Dataset, chunk: int, offset: int) -> None:
    # Prepare
    clock = Clock()
    verified = VerifiedFiles(trust_s=60, clock=clock)
    whole = dataset.slice_path(1).read_bytes()

    # Execute: checked whole, then trusted within the minute, then hashed as it is read
    modes, outputs = [], []
    for advance in (0, 30, 61):
        clock.now += advance
        reader = opened(dataset, verified, 1, chunk, offset)
        modes.append(reader.mode)
        outputs.append(read_all(reader))

    # Assert
    assert modes == ["whole", "trusted", "hashed"]
    for chunks in outputs:
        assert b"".join(chunks) == whole[offset:]
        assert all(0 < len(c) <= chunk for c in chunks)


def test_a_hashed_stream_that_matches_renews_the_trust(dataset: Dataset) -> None:
    clock = Clock()
    verified = VerifiedFiles(trust_s=60, clock=clock)
    read_all(opened(dataset, verified, 0))
    clock.now += 100
    assert opened(dataset, verified, 0).mode == "hashed"  # not read to the end: no renewal
    hashed = opened(dataset, verified, 0)
    read_all(hashed)
    clock.now += 30
    assert [hashed.mode, opened(dataset, verified, 0).mode] == ["hashed", "trusted"]


def test_a_rotted_file_is_refused_before_its_first_byte(dataset: Dataset) -> None:
    # Prepare: same size, one flipped byte, never served before
    path = dataset.slice_path(2)
    data = bytearray(path.read_bytes())
    data[0] ^= 0x80
    path.write_bytes(bytes(data))
    verified = VerifiedFiles()

    # Execute / Assert
    with pytest.raises(DataLossError, match="sha256"):
        opened(dataset, verified, 2)
    assert len(verified) == 0


def test_a_file_changed_since_its_check_is_checked_whole_again(dataset: Dataset) -> None:
    # Prepare: served once (verified, trusted for an hour), then rewritten with other bytes
    verified = VerifiedFiles(trust_s=3600)
    read_all(opened(dataset, verified, 0))
    path = dataset.slice_path(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    # Execute / Assert: the stamp changed, so the check comes before any byte, trust or not
    with pytest.raises(DataLossError, match="sha256"):
        opened(dataset, verified, 0)


@pytest.mark.parametrize("offset", [0, 2000])
def test_rot_the_stamp_cannot_show_withholds_the_last_chunk_and_forgets_the_file(
    dataset: Dataset, offset: int
) -> None:
    # Prepare
    verified = VerifiedFiles()
    read_all(opened(dataset, verified, 1))
    pretend_rot_unseen(dataset, verified, 1)
    size = dataset.slice_size(1)
    reader = opened(dataset, verified, 1, 1000, offset)
    assert reader.mode == "hashed"

    # Execute
    got = []
    with pytest.raises(DataLossError, match="withheld"):
        while (data := reader.next_chunk()) is not None:
            got.append(data)

    # Assert: everything but the last chunk came out, and the file must pass whole again
    assert sum(map(len, got)) == size - offset - (size % 1000 or 1000)
    assert len(verified) == 0
    with pytest.raises(DataLossError, match="sha256"):
        opened(dataset, verified, 1)


def test_a_file_cut_short_while_streamed_is_data_loss(dataset: Dataset) -> None:
    # Prepare: verified, then truncated in place to half its size with the stamp recorded
    verified = VerifiedFiles()
    read_all(opened(dataset, verified, 0))
    path = dataset.slice_path(0)
    reader = opened(dataset, verified, 0)
    assert reader.mode == "hashed"
    os.truncate(path, dataset.slice_size(0) // 2)

    # Execute / Assert
    with pytest.raises(DataLossError, match="ends early"):
        read_all(reader)
    assert len(verified) == 0


@pytest.mark.parametrize(("index", "offset"), [(-1, 0), (3, 0), (0, -1), (0, 10**9)])
def test_bad_index_or_offset_is_out_of_range(dataset: Dataset, index: int, offset: int) -> None:
    with pytest.raises(OutOfRangeError):
        SliceReader(dataset, index, 1000, offset, VerifiedFiles())


def test_rot_within_the_trust_window_is_sent_as_it_is_and_left_to_the_readers_check(
    dataset: Dataset,
) -> None:
    # Prepare
    clock = Clock()
    verified = VerifiedFiles(trust_s=60, clock=clock)
    read_all(opened(dataset, verified, 2))
    pretend_rot_unseen(dataset, verified, 2)

    # Execute
    trusted = opened(dataset, verified, 2)
    sent = b"".join(read_all(trusted))

    # Assert: the node sent the rotted bytes (a reader's sha256 refuses them: test_serving), and
    # once the trust lapses the node finds the rot itself
    assert trusted.mode == "trusted" and sent == dataset.slice_path(2).read_bytes()
    assert hashlib.sha256(sent).hexdigest() != dataset.slice_sha256(2)
    clock.now += 61
    with pytest.raises(DataLossError, match="withheld"):
        read_all(opened(dataset, verified, 2))
    with pytest.raises(DataLossError, match="sha256"):
        opened(dataset, verified, 2)


def test_an_offset_at_the_end_yields_nothing(dataset: Dataset) -> None:
    verified = VerifiedFiles()
    for _ in range(2):  # checked first, then hashed
        assert read_all(opened(dataset, verified, 0, offset=dataset.slice_size(0))) == []


def test_read_now_gives_cached_chunks_unless_the_stream_must_hash(dataset: Dataset) -> None:
    # Prepare: checked whole (in memory), then trusted (page cache), then hashed as it goes
    clock = Clock()
    verified = VerifiedFiles(trust_s=60, clock=clock)
    whole = dataset.slice_path(2).read_bytes()
    got: dict[str, list[bytes]] = {}
    asked_thread: dict[str, bool] = {}

    # Execute: take what read_now gives, and what it refuses from next_chunk (a thread's read)
    for advance in (0, 30, 61):
        clock.now += advance
        reader = opened(dataset, verified, 2, 1000, 10)
        chunks: list[bytes] = []
        asked_thread[reader.mode] = False
        try:
            while not reader.done:
                data = reader.read_now()
                if data is None:
                    asked_thread[reader.mode] = True
                    data = reader.next_chunk()
                assert data is not None
                chunks.append(bytes(data))
        finally:
            reader.close()
        got[reader.mode] = chunks

    # Assert: the same bytes every way; only the hashing stream needs the thread
    for chunks in got.values():
        assert b"".join(chunks) == whole[10:]
        assert all(len(c) == 1000 for c in chunks[:-1])
    assert asked_thread == {"whole": False, "trusted": False, "hashed": True}


def test_open_without_the_whole_check_leaves_a_changed_file_for_the_thread(dataset: Dataset) -> None:
    # Prepare: slice 0 checked once, then rewritten with the same bytes (a new stamp)
    verified = VerifiedFiles(trust_s=60)
    read_all(opened(dataset, verified, 0))
    path = dataset.slice_path(0)
    path.write_bytes(path.read_bytes())

    # Execute
    reader = SliceReader(dataset, 0, 1000, 0, verified)
    known, quick = reader.known, reader.open(check_whole=False)
    reader.open()

    # Assert: refused on the loop's terms, then checked whole
    assert (known, quick, reader.mode) == (True, False, "whole")
    assert b"".join(read_all(reader)) == path.read_bytes()


async def test_a_hashed_stream_reads_each_next_chunk_while_the_caller_holds_this_one(
    dataset: Dataset,
) -> None:
    # Prepare: a slice checked before whose trust lapsed (trust_s = 0): hashed as it is read
    verified = VerifiedFiles(trust_s=0)
    read_all(opened(dataset, verified, 1))
    reader = opened(dataset, verified, 1, chunk=1000)
    received, chunks = 0, []

    # Execute: hold each chunk until the reader has read the one after it
    async with aclosing(_slice_data(reader)) as pieces:
        async for data in pieces:
            received += len(data)
            chunks.append(bytes(data))
            following = min(reader.size, received + 1000)
            await eventually(
                lambda end=following: reader.position >= end,
                timeout=5,
                message=f"the chunk after byte {received} read ahead",
            )

    # Assert
    assert reader.mode == "hashed" and len(chunks) > 10
    assert b"".join(chunks) == dataset.slice_path(1).read_bytes()  # the last chunk too
