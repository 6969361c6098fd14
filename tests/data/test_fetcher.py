"""Worker-side slice fetching against real data nodes: verified, resumed, failed over, cached, prefetched."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
import torch

from hypha.data.servicer import ChunkHook
from hypha.datasets.format import Dataset, load_slice_tensors
from hypha.errors import HyphaError, UnavailableError
from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.v1 import common_pb2
from hypha.worker.fetcher import ProviderInfo, SliceFetcher
from tests.conftest import Pki
from tests.data.test_serving import CHUNK, data_node, prepare, sample_tensors


def provider(server: NodeServer) -> ProviderInfo:
    return ProviderInfo(server.tls.identity.peer_id, (server.address,))


def fetcher(pki: Pki, tmp_path: Path, **options: object) -> SliceFetcher:
    options.setdefault("rng", random.Random(0))
    options.setdefault("backoff_base_s", 0.01)
    return SliceFetcher(pki.tls("worker"), tmp_path / "cache", **options)  # type: ignore[arg-type]


@pytest.fixture
def toy(tmp_path: Path) -> Dataset:
    return prepare(tmp_path / "data-a")


@pytest.fixture
def toy_copy(tmp_path: Path, toy: Dataset) -> Dataset:
    """The same dataset on a second data node's disk."""
    shutil.copytree(toy.root, tmp_path / "data-b" / "toy")
    return Dataset.open(tmp_path / "data-b" / "toy")


async def test_prepare_serve_fetch_round_trip_gives_bit_identical_tensors(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    original = sample_tensors()
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _), fetcher(pki, tmp_path) as f:
        paths = [await f.fetch("toy", i, [provider(server)]) for i in range(toy.manifest.slice_count)]

    for index, path in enumerate(paths):
        tensors = load_slice_tensors(path.read_bytes())
        rows = slice(index * 8, (index + 1) * 8)
        assert torch.equal(tensors["x"], original["x"][rows])
        assert torch.equal(tensors["labels"], original["labels"][rows])
        assert path.read_bytes() == toy.slice_path(index).read_bytes()


async def test_second_fetch_of_a_slice_is_local(pki: Pki, tmp_path: Path, toy: Dataset) -> None:
    async with fetcher(pki, tmp_path) as f:
        async with data_node(pki.tls("data"), toy.root.parent) as (server, servicer):
            first = await f.fetch("toy", 1, [provider(server)])
        # The server is gone: only the cache can answer now.
        second = await f.fetch("toy", 1, [provider(server)])

    assert second == first
    assert f.stats["downloads"] == 1 and f.stats["hits"] == 1
    assert servicer.stats["streams"] == 1


async def test_rotted_cache_file_is_fetched_again(pki: Pki, tmp_path: Path, toy: Dataset) -> None:
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _), fetcher(pki, tmp_path) as f:
        path = await f.fetch("toy", 0, [provider(server)])
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

        again = await f.fetch("toy", 0, [provider(server)])

    assert again.read_bytes() == toy.slice_path(0).read_bytes()
    assert f.stats["downloads"] == 2


async def test_slice_cache_evicts_the_least_recently_used_slices_beyond_its_size(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    # Prepare: a cache that holds two slices of the toy dataset (they are all the same size)
    size = toy.slice_size(0)
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _):
        async with fetcher(pki, tmp_path, max_cache_bytes=2 * size) as f:
            first = await f.fetch("toy", 0, [provider(server)])
            second = await f.fetch("toy", 1, [provider(server)])
            await f.fetch("toy", 0, [provider(server)])  # a hit: slice 0 is now the recent one

            # Execute: a third slice must push the least recently used one (slice 1) out
            third = await f.fetch("toy", 2, [provider(server)])

    # Check
    assert first.is_file() and third.is_file() and not second.exists()
    assert f.stats["evicted"] == 1 and f.stats["downloads"] == 3 and f.stats["hits"] == 1
    assert sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.safetensors")) <= 2 * size


async def test_slice_larger_than_the_whole_cache_is_refused_naming_the_setting(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _):
        async with fetcher(pki, tmp_path, max_cache_bytes=toy.slice_size(0) - 1) as f:
            with pytest.raises(HyphaError, match=r"jobs\.slice_cache_bytes"):
                await f.fetch("toy", 0, [provider(server)])

    assert not list((tmp_path / "cache").rglob("*.safetensors"))


async def test_stream_broken_mid_slice_resumes_at_offset_on_the_next_provider(
    pki: Pki, tmp_path: Path, toy: Dataset, toy_copy: Dataset
) -> None:
    # Prepare: whichever node serves first fails after its first two chunks (named fault:
    # drop stream); the partial download must resume, not restart, on the other node.
    broken: list[str] = []

    def dropping(name: str) -> ChunkHook:
        async def hook(dataset: str, index: int, chunk: common_pb2.Chunk) -> None:
            if chunk.offset == 2 * CHUNK and (not broken or broken == [name]):
                broken.append(name)
                raise UnavailableError("injected: stream dropped")

        return hook

    async with (
        data_node(pki.tls("data"), toy.root.parent, chunk_hook=dropping("a")) as (a, sa),
        data_node(pki.issue("data", "data-b"), toy_copy.root.parent, chunk_hook=dropping("b")) as (b, sb),
        fetcher(pki, tmp_path) as f,
    ):
        path = await f.fetch("toy", 4, [provider(a), provider(b)])

    size = toy.slice_size(4)
    assert path.read_bytes() == toy.slice_path(4).read_bytes()
    assert len(broken) == 1 and f.stats["resumes"] == 1
    # Two chunks came from the broken node; the other sent only the rest.
    assert sorted([sa.stats["bytes"], sb.stats["bytes"]]) == [2 * CHUNK, size - 2 * CHUNK]


async def test_data_node_stopped_mid_fetch_the_other_completes_it(
    pki: Pki, tmp_path: Path, toy: Dataset, toy_copy: Dataset
) -> None:
    # Prepare: the first node to serve a chunk past the second one stops its whole server
    # (named fault: kill node) and never sends another byte.
    stopping: list[asyncio.Task[None]] = []
    servers: dict[str, NodeServer] = {}

    def killing(name: str) -> ChunkHook:
        async def hook(dataset: str, index: int, chunk: common_pb2.Chunk) -> None:
            if chunk.offset >= 2 * CHUNK and (not stopping or name == "victim"):
                if not stopping:
                    stopping.append(asyncio.create_task(servers[name].stop(0)))
                await asyncio.Event().wait()  # cancelled by the stop

        return hook

    async with (
        data_node(pki.tls("data"), toy.root.parent, chunk_hook=killing("a")) as (a, _),
        data_node(pki.issue("data", "data-b2"), toy_copy.root.parent, chunk_hook=killing("b")) as (b, _),
        fetcher(pki, tmp_path, chunk_timeout_s=5.0) as f,
    ):
        servers.update(a=a, b=b)
        path = await f.fetch("toy", 3, [provider(a), provider(b)])
        await asyncio.gather(*stopping)

    assert len(stopping) == 1
    assert path.read_bytes() == toy.slice_path(3).read_bytes()
    tensors = load_slice_tensors(path.read_bytes())
    assert torch.equal(tensors["x"], sample_tensors()["x"][24:32])
    assert f.stats["failed_attempts"] >= 1


async def test_corrupt_copy_on_one_node_is_skipped_for_the_intact_one(
    pki: Pki, tmp_path: Path, toy: Dataset, toy_copy: Dataset
) -> None:
    rotted = toy_copy.slice_path(2)
    data = bytearray(rotted.read_bytes())
    data[100] ^= 0x10
    rotted.write_bytes(bytes(data))

    async with (
        data_node(pki.tls("data"), toy.root.parent) as (a, _),
        data_node(pki.issue("data", "data-b3"), toy_copy.root.parent) as (b, sb),
    ):
        for seed in range(4):  # whatever the rotation, the intact copy wins
            async with fetcher(pki, tmp_path / str(seed), rng=random.Random(seed)) as f:
                path = await f.fetch("toy", 2, [provider(b), provider(a)])
            assert path.read_bytes() == toy.slice_path(2).read_bytes()
    assert sb.stats["refused_corrupt"] >= 1


async def test_all_providers_failing_is_unavailable_naming_each(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    toy.slice_path(1).write_bytes(b"\x00" * toy.slice_size(1))
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _):
        dead = ProviderInfo("deadpeer", ("127.0.0.1:1",))
        async with fetcher(pki, tmp_path, attempts_per_provider=1) as f:
            with pytest.raises(UnavailableError) as err:
                await f.fetch("toy", 1, [provider(server), dead])
            with pytest.raises(UnavailableError, match="no providers"):
                await f.fetch("toy", 0, [])

    message = err.value.message
    assert "DATA_LOSS" in message and server.tls.identity.peer_id in message
    assert "deadpeer: UNAVAILABLE" in message
    assert f.cached("toy", 1) is None


async def test_slice_not_matching_the_expected_sha256_is_refused(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    other = prepare(tmp_path / "other-data", seed=7)  # same name and shape, different bytes
    async with (
        data_node(pki.tls("data"), other.root.parent) as (server, _),
        fetcher(pki, tmp_path, attempts_per_provider=1) as f,
    ):
        f.remember_manifest(toy.manifest)
        with pytest.raises(UnavailableError, match="different version"):
            await f.fetch("toy", 0, [provider(server)])
        path = await f.fetch("toy", 0, [provider(server)], sha256=other.slice_sha256(0))

    assert path.read_bytes() == other.slice_path(0).read_bytes()


async def test_prefetch_makes_the_next_fetch_local(pki: Pki, tmp_path: Path, toy: Dataset) -> None:
    async with fetcher(pki, tmp_path, max_prefetch=2) as f:
        async with data_node(pki.tls("data"), toy.root.parent) as (server, servicer):
            assert f.prefetch("toy", 1, [provider(server)])
            assert f.prefetch("toy", 2, [provider(server)])
            assert not f.prefetch("toy", 3, [provider(server)])  # bounded: two in flight already
            await f.wait_prefetched()
        # The node is gone; the prefetched slices are on disk.
        one = await f.fetch("toy", 1, [provider(server)])
        two = await f.fetch("toy", 2, [provider(server)])

    assert one.read_bytes() == toy.slice_path(1).read_bytes()
    assert two.read_bytes() == toy.slice_path(2).read_bytes()
    assert servicer.stats["streams"] == 2 and f.stats["hits"] == 2


async def test_fetch_joins_a_prefetch_in_flight_instead_of_downloading_twice(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    gate = asyncio.Event()

    async def slow(dataset: str, index: int, chunk: common_pb2.Chunk) -> None:
        await gate.wait()

    async with (
        data_node(pki.tls("data"), toy.root.parent, chunk_hook=slow) as (server, servicer),
        fetcher(pki, tmp_path) as f,
    ):
        assert f.prefetch("toy", 0, [provider(server)])
        joined = asyncio.create_task(f.fetch("toy", 0, [provider(server)]))
        gate.set()
        path = await joined

    assert path.read_bytes() == toy.slice_path(0).read_bytes()
    assert servicer.stats["streams"] == 1 and f.stats["downloads"] == 1


async def test_unsafe_dataset_names_never_reach_the_cache_dir(pki: Pki, tmp_path: Path) -> None:
    async with fetcher(pki, tmp_path) as f:
        with pytest.raises(HyphaError):
            await f.fetch("../escape", 0, [ProviderInfo("p", ("127.0.0.1:1",))])


async def test_closed_fetcher_refuses_work_and_cancels_prefetches(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    gate = asyncio.Event()

    async def never(dataset: str, index: int, chunk: common_pb2.Chunk) -> None:
        await gate.wait()

    async with data_node(pki.tls("data"), toy.root.parent, chunk_hook=never) as (server, _):
        f = fetcher(pki, tmp_path)
        assert f.prefetch("toy", 0, [provider(server)])
        await f.close()
        await f.close()
        with pytest.raises(UnavailableError, match="closed"):
            await f.fetch("toy", 0, [provider(server)])
        gate.set()

    assert f.cached("toy", 0) is None


def test_provider_info_from_proto() -> None:
    peer = common_pb2.PeerInfo(peer_id="abc", addresses=["10.0.0.1:7000", "h:1"])
    assert ProviderInfo.from_proto(peer) == ProviderInfo("abc", ("10.0.0.1:7000", "h:1"))


async def test_injected_connect_is_used_once_per_provider_and_channels_are_reused(
    pki: Pki, tmp_path: Path, toy: Dataset
) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []

    def connect(peer_id: str, addresses: Sequence[str]) -> grpc.aio.Channel:
        calls.append((peer_id, tuple(addresses)))
        return secure_channel(pki.tls("worker"), addresses[-1])  # e.g. a relay would pick its own way

    async with (
        data_node(pki.tls("data"), toy.root.parent) as (server, _),
        fetcher(pki, tmp_path, connect=connect) as f,
    ):
        info = ProviderInfo(server.tls.identity.peer_id, ("192.0.2.1:9", server.address))
        paths = [await f.fetch("toy", i, [info]) for i in range(3)]

    assert calls == [(info.peer_id, info.addresses)]
    assert [p.read_bytes() for p in paths] == [toy.slice_path(i).read_bytes() for i in range(3)]
