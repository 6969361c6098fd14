"""Chunked streaming: bounded chunks out, verified payloads (and nothing else) back in."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from hypha.tensors.chunks import (
    DEFAULT_CHUNK_SIZE,
    AssemblyState,
    ChunkAssembler,
    ChunkFeeder,
    assemble,
    feed_off_loop,
    sha256_hex,
    split_payload,
)
from hypha.v1 import common_pb2

MiB = 1 << 20
CT = "application/safetensors"


def _chunks(payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[common_pb2.Chunk]:
    return list(split_payload(payload, chunk_size=chunk_size, content_type=CT, metadata={"kind": "delta"}))


@pytest.mark.parametrize("size", [0, 1, MiB, MiB + 1, 3 * MiB + 5])
def test_payload_round_trips_in_bounded_chunks(size: int) -> None:
    # Prepare
    payload = os.urandom(size)

    # Execute
    chunks = _chunks(payload)
    assembled, metadata = assemble(chunks, max_bytes=8 * MiB, expected_content_type=CT)

    # Assert
    assert assembled == payload
    assert metadata == {"kind": "delta"}
    assert len(chunks) == max(1, -(-size // MiB))
    assert all(len(c.data) <= MiB for c in chunks)
    first, last = chunks[0], chunks[-1]
    assert (first.total_size, first.content_type, dict(first.metadata)) == (size, CT, {"kind": "delta"})
    assert last.last and last.sha256 == hashlib.sha256(payload).hexdigest()
    assert not any(c.last or c.sha256 for c in chunks[:-1])
    assert not any(c.total_size or c.content_type or c.metadata for c in chunks[1:])
    assert [c.offset for c in chunks] == [i * MiB for i in range(len(chunks))]


@settings(max_examples=50, deadline=None)
@given(payload=st.binary(min_size=0, max_size=300), chunk_size=st.integers(1, 64))
def test_any_payload_round_trips_for_any_chunk_size(payload: bytes, chunk_size: int) -> None:
    chunks = _chunks(payload, chunk_size)
    assert all(len(c.data) <= chunk_size for c in chunks)
    assert assemble(chunks, max_bytes=len(payload))[0] == payload


def _feed_all(assembler: ChunkAssembler, chunks: list[common_pb2.Chunk]) -> None:
    for chunk in chunks:
        assembler.feed(chunk)


def test_corrupted_chunk_is_refused_and_nothing_is_returned() -> None:
    # Prepare
    chunks = _chunks(os.urandom(3 * 1000), chunk_size=1000)
    data = bytearray(chunks[1].data)
    data[17] ^= 0xFF
    chunks[1].data = bytes(data)
    assembler = ChunkAssembler(max_bytes=10_000)

    # Execute / Assert
    with pytest.raises(DataLossError, match="checksum"):
        _feed_all(assembler, chunks)
    assert assembler.state is AssemblyState.FAILED
    with pytest.raises(FailedPreconditionError):
        assembler.finish()


def test_wrong_or_absent_checksum_on_last_chunk_is_data_loss() -> None:
    for bad in ["0" * 64, ""]:
        chunks = _chunks(b"hello world", chunk_size=4)
        chunks[-1].sha256 = bad
        with pytest.raises(DataLossError):
            assemble(chunks, max_bytes=100)


def test_stream_that_ends_before_its_last_chunk_is_incomplete() -> None:
    # Prepare
    chunks = _chunks(os.urandom(2500), chunk_size=1000)
    assembler = ChunkAssembler(max_bytes=10_000)
    _feed_all(assembler, chunks[:-1])

    # Execute / Assert
    assert not assembler.complete
    with pytest.raises(DataLossError, match="incomplete"):
        assembler.finish()
    assert assembler.state is AssemblyState.FAILED


def test_last_flag_before_all_bytes_arrived_is_incomplete() -> None:
    # Prepare: a sender that declares 2500 bytes but marks its second chunk last.
    payload = os.urandom(2500)
    chunks = _chunks(payload, chunk_size=1000)[:2]
    chunks[1].last = True
    chunks[1].sha256 = sha256_hex(payload[:2000])

    # Execute / Assert
    with pytest.raises(DataLossError, match="incomplete"):
        assemble(chunks, max_bytes=10_000)


def test_finish_without_any_chunk_is_incomplete() -> None:
    with pytest.raises(DataLossError, match="incomplete"):
        ChunkAssembler(max_bytes=10).finish()


@pytest.mark.parametrize(("drop", "kind"), [(1, "gap"), (None, "overlap")])
def test_offsets_must_be_contiguous(drop: int | None, kind: str) -> None:
    # Prepare: either lose the second chunk (gap) or send the first one twice (overlap).
    chunks = _chunks(os.urandom(3000), chunk_size=1000)
    if drop is not None:
        del chunks[drop]
    else:
        dup = common_pb2.Chunk()
        dup.CopyFrom(chunks[0])
        dup.ClearField("total_size")
        chunks.insert(1, dup)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match=kind):
        assemble(chunks, max_bytes=10_000)


def test_first_chunk_must_start_at_offset_zero() -> None:
    chunks = _chunks(os.urandom(3000), chunk_size=1000)
    with pytest.raises(InvalidArgumentError, match="gap"):
        assemble(chunks[1:], max_bytes=10_000)


def test_declared_size_over_the_limit_is_refused_before_any_data() -> None:
    assembler = ChunkAssembler(max_bytes=1000)
    with pytest.raises(InvalidArgumentError, match="exceeds the limit"):
        assembler.feed(_chunks(os.urandom(1001), chunk_size=100)[0])
    assert assembler.state is AssemblyState.FAILED


def test_data_beyond_the_declared_size_is_refused() -> None:
    # Prepare: the first chunk understates the total (a lying or buggy sender).
    payload = os.urandom(300)
    chunks = _chunks(payload, chunk_size=100)
    chunks[0].total_size = 150

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="more than the declared"):
        assemble(chunks, max_bytes=10_000)


def test_changed_total_size_mid_stream_is_refused() -> None:
    chunks = _chunks(os.urandom(300), chunk_size=100)
    chunks[1].total_size = 999
    with pytest.raises(InvalidArgumentError, match="total_size"):
        assemble(chunks, max_bytes=10_000)


def test_chunk_after_the_last_is_refused() -> None:
    chunks = _chunks(b"abc")
    assembler = ChunkAssembler(max_bytes=10)
    assembler.feed(chunks[0])
    assert assembler.complete
    with pytest.raises(InvalidArgumentError, match="after the last"):
        assembler.feed(chunks[0])
    with pytest.raises(FailedPreconditionError):
        assembler.feed(chunks[0])


def test_unexpected_content_type_is_refused() -> None:
    chunks = list(split_payload(b"abc", content_type="text/plain"))
    with pytest.raises(InvalidArgumentError, match="content type"):
        assemble(chunks, max_bytes=10, expected_content_type=CT)


def test_payload_is_handed_out_once() -> None:
    assembler = ChunkAssembler(max_bytes=10)
    _feed_all(assembler, _chunks(b"abc"))
    assert assembler.finish() == b"abc"
    with pytest.raises(FailedPreconditionError):
        assembler.finish()


def test_invalid_chunk_size_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        list(split_payload(b"abc", chunk_size=0))


def test_payload_above_the_memory_bound_is_spooled_to_a_verified_file(tmp_path: Path) -> None:
    payload = os.urandom(300_000)
    assembler = ChunkAssembler(max_bytes=1 << 20, spool_dir=tmp_path, memory_bytes=100_000)

    for chunk in split_payload(payload, chunk_size=64 * 1024):
        assembler.feed(chunk)
        assert not assembler._parts  # nothing held in memory

    assert assembler.spooled
    with pytest.raises(FailedPreconditionError, match="finish_file"):
        assembler.finish()
    path = assembler.finish_file()
    assert path.parent == tmp_path and path.read_bytes() == payload


def test_payload_at_the_memory_bound_stays_in_memory(tmp_path: Path) -> None:
    payload = os.urandom(100_000)
    assembler = ChunkAssembler(max_bytes=1 << 20, spool_dir=tmp_path, memory_bytes=100_000)
    for chunk in split_payload(payload, chunk_size=64 * 1024):
        assembler.feed(chunk)
    assert not assembler.spooled and assembler.finish() == payload
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("ending", ["corrupt", "aborted"])
def test_a_broken_spooled_stream_leaves_no_file(tmp_path: Path, ending: str) -> None:
    chunks = list(split_payload(os.urandom(300_000), chunk_size=64 * 1024))
    assembler = ChunkAssembler(max_bytes=1 << 20, spool_dir=tmp_path, memory_bytes=1000)
    for chunk in chunks[:-1]:
        assembler.feed(chunk)
    assert len(list(tmp_path.iterdir())) == 1

    if ending == "corrupt":
        chunks[-1].sha256 = "0" * 64
        with pytest.raises(DataLossError):
            assembler.feed(chunks[-1])
    else:
        assembler.abort()

    assert not list(tmp_path.iterdir())


async def test_feeding_off_the_loop_assembles_the_same_payload() -> None:
    payload = os.urandom(1 << 20)
    assembler = ChunkAssembler(max_bytes=1 << 21)
    for chunk in split_payload(payload, chunk_size=256 * 1024):
        await feed_off_loop(assembler, chunk)
    assert assembler.finish() == payload


async def test_a_feeder_one_chunk_behind_assembles_the_same_payload_and_raises_a_bad_one_later(
    tmp_path: Path,
) -> None:
    payload = os.urandom(1 << 20)
    chunks = list(split_payload(payload, chunk_size=256 * 1024))
    good = ChunkAssembler(max_bytes=1 << 21)
    feeder = ChunkFeeder(good)
    for chunk in chunks:
        await feeder.feed(chunk)
    await feeder.flush()
    assert good.finish() == payload

    # A corrupted last chunk: its failure comes out of flush, and abort leaves no spool file.
    bad = ChunkAssembler(max_bytes=1 << 21, spool_dir=tmp_path, memory_bytes=1 << 18)
    feeder = ChunkFeeder(bad)
    chunks[-1].data = bytes(len(chunks[-1].data))
    for chunk in chunks:
        await feeder.feed(chunk)
    with pytest.raises(DataLossError):
        await feeder.flush()
    await feeder.settle()
    bad.abort()
    assert not os.listdir(tmp_path)
