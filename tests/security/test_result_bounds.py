"""Results are bounded and confined: a scheduler or worker picks the names and sizes, not the disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hypha.errors import ResourceExhaustedError
from hypha.filestream import FileStreamError, FileStreamLimitError, StreamLimits, receive_files
from tests.test_filestream import chunks_of, files_under, stream


@pytest.mark.parametrize(
    "name",
    [
        ".git/hooks/pre-commit",
        ".bashrc",
        "a/.ssh/authorized_keys",
        "a\\..\\..\\x",
        "nul\x00byte",
        "/abs",
        "../x",
    ],
)
async def test_a_result_file_name_outside_plain_files_under_out_is_refused(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"

    with pytest.raises(FileStreamError):
        await receive_files(stream(chunks_of({name: b"#!/bin/sh\necho owned\n"})), out)

    assert files_under(tmp_path) == {}


async def test_a_symlink_inside_out_does_not_lead_a_result_outside(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "models")
    os.symlink(elsewhere / "planted", out / "config.json")

    with pytest.raises(FileStreamError, match="outside"):
        await receive_files(stream(chunks_of({"models/weights.bin": b"x"})), out)
    with pytest.raises(FileStreamError, match="outside"):
        await receive_files(stream(chunks_of({"config.json": b"x"})), out)

    assert list(elsewhere.iterdir()) == []


async def test_too_many_result_files_is_resource_exhausted(tmp_path: Path) -> None:
    files = {f"f{i}.bin": b"x" for i in range(4)}

    with pytest.raises(FileStreamLimitError) as err:
        await receive_files(stream(chunks_of(files)), tmp_path, StreamLimits(max_files=3))

    assert isinstance(err.value, ResourceExhaustedError)
    assert len(files_under(tmp_path)) == 3  # refused before the fourth is opened


async def test_too_many_result_bytes_is_refused_from_the_declared_size(tmp_path: Path) -> None:
    with pytest.raises(FileStreamLimitError, match="100 bytes"):
        await receive_files(stream(chunks_of({"big.bin": b"x" * 101})), tmp_path, StreamLimits(max_bytes=100))

    assert files_under(tmp_path) == {}


async def test_a_file_bringing_more_bytes_than_it_declared_is_refused(tmp_path: Path) -> None:
    items = list(chunks_of({"a.bin": b"0123456789"}))
    items[0][1].total_size = 3  # declares 3 bytes (under any limit), then sends 10

    with pytest.raises(FileStreamError, match="more bytes than"):
        await receive_files(stream(items), tmp_path, StreamLimits(max_bytes=5))

    assert files_under(tmp_path) == {}


async def test_the_scheduler_refuses_an_oversized_result_at_once_and_keeps_nothing(tmp_path: Path) -> None:
    from hypha.scheduler.config import JobsSection
    from hypha.scheduler.results import ResultPullError, pull_result, result_dir, result_limits
    from tests.scheduler.test_results import FILES, _Calls, pieces

    calls = _Calls(pieces(FILES), pieces(FILES))
    target = result_dir(tmp_path, "j")
    limits = result_limits(JobsSection(result_max_files=1))

    with pytest.raises(ResultPullError, match="more than 1 files"):
        await pull_result(calls, "w1", "j", target, timeout_s=10, limits=limits)  # type: ignore[arg-type]

    assert len(calls.attempts) == 1  # not retried: the worker would send the same result
    assert not target.exists() and not target.with_name("j.partial").exists()
