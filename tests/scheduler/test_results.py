"""A finished job's result is pulled whole into the state dir, retried over broken streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hypha.errors import PermissionDeniedError, UnavailableError
from hypha.scheduler.results import ResultPullError, pull_result, result_dir
from hypha.tensors.chunks import split_payload
from hypha.v1 import worker_pb2

FILES = {"config.json": b'{"a": 1}', "model.safetensors": b"0123456789abcdef"}


def pieces(files: dict[str, bytes]) -> list[worker_pb2.TensorChunk]:
    return [
        worker_pb2.TensorChunk(job_id="j", kind="result", chunk=chunk)
        for name, data in files.items()
        for chunk in split_payload(data, chunk_size=4, metadata={"path": name})
    ]


class _Calls:
    """A worker whose successive result streams are given: each a list of pieces, or an error to raise."""

    def __init__(self, *attempts: list[Any]) -> None:
        self.attempts = list(attempts)

    async def result_stream(self, worker_id: str, job_id: str, timeout_s: float) -> AsyncIterator[Any]:
        for item in self.attempts.pop(0):
            if isinstance(item, BaseException):
                raise item
            yield item


async def test_a_broken_stream_is_retried_and_only_the_whole_result_lands(tmp_path: Path) -> None:
    whole = pieces(FILES)
    calls = _Calls([*whole[:3], UnavailableError("stream broke")], whole)
    target = result_dir(tmp_path, "j")

    size = await pull_result(calls, "w1", "j", target, timeout_s=10)  # type: ignore[arg-type]

    assert size == sum(map(len, FILES.values()))
    assert {p.name: p.read_bytes() for p in target.iterdir()} == FILES
    assert not calls.attempts and [p.name for p in target.parent.iterdir()] == ["j"]  # no .partial left


async def test_a_refusal_is_not_retried_and_leaves_nothing(tmp_path: Path) -> None:
    calls = _Calls([PermissionDeniedError("not yours")], pieces(FILES))
    target = result_dir(tmp_path, "j")

    with pytest.raises(ResultPullError, match="not yours"):
        await pull_result(calls, "w1", "j", target, timeout_s=10)  # type: ignore[arg-type]

    assert len(calls.attempts) == 1  # the second stream was never asked for
    assert not target.exists() and not target.with_name("j.partial").exists()
