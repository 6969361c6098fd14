"""A slice the scheduler handed out is never dropped by the worker when its download fails.

The scheduler marks a slice handed to a trainer; if the worker then fails to
fetch it (its data node killed) and simply asks for another, that slice is
trained on by nobody in its epoch. The handout keeps it and fetches it again
on the executor's next request.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hypha.errors import UnavailableError
from hypha.v1 import scheduler_pb2
from hypha.worker.bridge_slices import SliceHandout
from hypha.worker.fetcher import ProviderInfo


class _Link:
    """The scheduler's side of NextSlice: slices 0, 1, 2 … in order, each request recorded."""

    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.NextSliceRequest] = []

    async def next_slice(self, request: scheduler_pb2.NextSliceRequest) -> scheduler_pb2.NextSliceResponse:
        self.requests.append(request)
        return scheduler_pb2.NextSliceResponse(
            available=True, dataset="ds", index=len(self.requests) - 1, epoch=0
        )


class _FlakySource:
    """A slice cache whose first ``failures`` fetches fail as a dead provider's would."""

    def __init__(self, root: Path, failures: int) -> None:
        self.root = root
        self.failures = failures
        self.fetched: list[int] = []

    async def fetch(self, dataset: str, index: int, providers: Sequence[ProviderInfo]) -> Path:
        if self.failures:
            self.failures -= 1
            raise UnavailableError("no provider of the slice answered")
        self.fetched.append(index)
        path = self.root / f"{index}.safetensors"
        path.write_bytes(b"slice %d" % index)
        return path

    def prefetch(self, dataset: str, index: int, providers: Sequence[ProviderInfo]) -> bool:
        return False


@pytest.mark.timeout(30)
async def test_a_slice_whose_fetch_failed_is_fetched_again_not_skipped(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    link = _Link()
    source = _FlakySource(cache, failures=2)
    handout = SliceHandout("job", tmp_path / "work", link, source, lookahead=False)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(UnavailableError):
            await handout.next()
    handed = await handout.next()
    assert handed is not None
    index, _epoch, path = handed
    assert index == 0 and path.read_bytes() == b"slice 0"
    assert len(link.requests) == 1, "the failed slice was asked for again instead of kept"
    handout.mark_used([index])
    following = await handout.next()
    assert following is not None and following[0] == 1
    assert list(link.requests[1].used) == [0]
    await handout.close()
