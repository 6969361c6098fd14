"""The one verified file-stream writer: only whole, checked files ever appear under the target."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import pytest

from hypha.filestream import FileStreamError, ReceivedFile, receive_files
from hypha.tensors.chunks import sha256_hex, split_payload
from hypha.v1 import common_pb2

FILES = {"config.json": b'{"a": 1}', "weights/model.safetensors": b"0123456789abcdef" * 3, "empty.txt": b""}


def chunks_of(files: dict[str, bytes], *, corrupt: str = "") -> Iterator[tuple[str, common_pb2.Chunk]]:
    for name, data in files.items():
        for chunk in split_payload(data, chunk_size=5):
            if name == corrupt and chunk.last:
                chunk.sha256 = "0" * 64
            yield (name if chunk.offset == 0 else ""), chunk


async def stream(
    items: Iterable[tuple[str, common_pb2.Chunk]],
) -> AsyncIterator[tuple[str, common_pb2.Chunk]]:
    for item in items:
        yield item


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def test_every_file_is_written_whole_and_reported_with_its_checksum(tmp_path: Path) -> None:
    received = await receive_files(stream(chunks_of(FILES)), tmp_path)

    assert files_under(tmp_path) == FILES
    assert received == [ReceivedFile(name, len(data), sha256_hex(data)) for name, data in FILES.items()]


async def test_a_file_failing_its_checksum_is_discarded(tmp_path: Path) -> None:
    with pytest.raises(FileStreamError, match=r"model\.safetensors"):
        await receive_files(stream(chunks_of(FILES, corrupt="weights/model.safetensors")), tmp_path)

    assert files_under(tmp_path) == {"config.json": FILES["config.json"]}  # no part file either


@pytest.mark.parametrize("name", ["../evil", "/etc/evil", ""])
async def test_a_name_outside_the_target_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    target = tmp_path / "target"
    chunk = next(split_payload(b"x"))

    with pytest.raises(FileStreamError):
        await receive_files(stream([(name, chunk)]), target)

    assert files_under(tmp_path) == {}


async def test_a_cut_off_or_reordered_stream_leaves_no_file(tmp_path: Path) -> None:
    items = list(chunks_of({"a.bin": b"abcdefghijkl"}))
    with pytest.raises(FileStreamError, match="ended before"):
        await receive_files(stream(items[:-1]), tmp_path / "cut")
    with pytest.raises(FileStreamError, match="offset"):
        await receive_files(stream([items[0], items[2], items[1]]), tmp_path / "reordered")
    with pytest.raises(FileStreamError, match="moved on"):
        await receive_files(stream([items[0], *chunks_of({"b.bin": b"b"})]), tmp_path / "interleaved")

    assert files_under(tmp_path) == {}


async def test_a_cancelled_transfer_drops_the_half_written_file(tmp_path: Path) -> None:
    first, *_ = chunks_of({"big.bin": b"0123456789"})
    sent = asyncio.Event()

    async def stalls() -> AsyncIterator[tuple[str, common_pb2.Chunk]]:
        yield first
        sent.set()
        await asyncio.Event().wait()  # the sender goes quiet
        yield first

    task = asyncio.create_task(receive_files(stalls(), tmp_path))
    await asyncio.wait_for(sent.wait(), 10)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)

    assert files_under(tmp_path) == {}
