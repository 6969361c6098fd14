"""``read_cached``: the page cache's bytes at once, or None (never a wait for the disk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hypha import pagecache
from hypha.pagecache import read_cached


def test_a_cached_block_is_read_at_its_offset_and_a_short_one_is_left_to_the_blocking_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "block.bin"
    payload = os.urandom(3 * 4096)
    path.write_bytes(payload)  # just written: in the page cache
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_cached(fd, 4096, 4096) == payload[4096:8192]
        assert read_cached(fd, 4096, len(payload) - 100) is None  # past the end: not this read's to say
    finally:
        os.close(fd)


def test_a_file_system_without_the_flag_turns_the_fast_path_off_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "block.bin"
    path.write_bytes(b"x" * 4096)
    calls: list[int] = []

    def refusing(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        calls.append(flags)
        raise OSError(95, "Operation not supported")  # EOPNOTSUPP

    monkeypatch.setitem(pagecache._nowait, "supported", True)
    monkeypatch.setattr(os, "preadv", refusing)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_cached(fd, 4096, 0) is None
        assert read_cached(fd, 4096, 0) is None
    finally:
        os.close(fd)
    assert len(calls) == 1  # asked once, then never again
