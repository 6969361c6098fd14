"""SliceReader: a slice checked whole the first time, hashed as it goes once known good, never
handed out whole when its bytes no longer match the manifest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hypha.data.slices import FileStamp, SliceReader, VerifiedFiles
from hypha.datasets.format import Dataset
from hypha.datasets.prepare import write_dataset
from hypha.errors import DataLossError, OutOfRangeError


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


@pytest.mark.parametrize("chunk", [1, 999, 1 << 20])
@pytest.mark.parametrize("offset", [0, 1, 4000])
def test_both_modes_give_the_slice_from_any_offset(dataset: Dataset, chunk: int, offset: int) -> None:
    # Prepare
    verified = VerifiedFiles()
    whole = dataset.slice_path(1).read_bytes()

    # Execute: the first stream checks the file whole, the second hashes as it reads
    first = opened(dataset, verified, 1, chunk, offset)
    first_chunks = read_all(first)
    second = opened(dataset, verified, 1, chunk, offset)
    second_chunks = read_all(second)

    # Assert
    assert first.checked_first and not second.checked_first
    for chunks in (first_chunks, second_chunks):
        assert b"".join(chunks) == whole[offset:]
        assert all(0 < len(c) <= chunk for c in chunks)


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
    # Prepare: served once (verified), then rewritten with other bytes of the same size
    verified = VerifiedFiles()
    read_all(opened(dataset, verified, 0))
    path = dataset.slice_path(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    # Execute / Assert: the stamp changed, so the check comes before any byte
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
    assert not reader.checked_first

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
    assert not reader.checked_first
    os.truncate(path, dataset.slice_size(0) // 2)

    # Execute / Assert
    with pytest.raises(DataLossError, match="ends early"):
        read_all(reader)
    assert len(verified) == 0


@pytest.mark.parametrize(("index", "offset"), [(-1, 0), (3, 0), (0, -1), (0, 10**9)])
def test_bad_index_or_offset_is_out_of_range(dataset: Dataset, index: int, offset: int) -> None:
    with pytest.raises(OutOfRangeError):
        SliceReader(dataset, index, 1000, offset, VerifiedFiles())


def test_an_offset_at_the_end_yields_nothing(dataset: Dataset) -> None:
    verified = VerifiedFiles()
    for _ in range(2):  # checked first, then streaming
        assert read_all(opened(dataset, verified, 0, offset=dataset.slice_size(0))) == []
