"""The DataNode service on a real mTLS server: listing, verified slice streams, resume, refusals."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from pydantic import ValidationError

from hypha.data.config import DataNodeSettings
from hypha.data.servicer import DataNodeServicer, DatasetCatalog, add_data_node_servicer
from hypha.datasets.format import CONTENT_TYPE, Dataset
from hypha.datasets.prepare import prepare_synthetic, write_dataset
from hypha.errors import DataLossError
from hypha.filestamp import FileStamp
from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.tensors.chunks import assemble
from hypha.v1 import common_pb2, data_pb2, data_pb2_grpc
from tests.conftest import Pki
from tests.gateway.tcpproxy import TcpProxy
from tests.helpers import eventually

CHUNK = 16 * 1024


def sample_tensors(samples: int = 40, width: int = 2048, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors whose slices (8 samples) span several 16 KiB chunks."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(samples, width, generator=gen),
        "labels": torch.arange(samples, dtype=torch.int64),
    }


def prepare(data_dir: Path, name: str = "toy", samples: int = 40, seed: int = 0) -> Dataset:
    return write_dataset(sample_tensors(samples, seed=seed), data_dir, name, samples_per_slice=8)


@asynccontextmanager
async def data_node(
    tls: TlsMaterial, data_dir: Path, **options: Any
) -> AsyncIterator[tuple[NodeServer, DataNodeServicer]]:
    """A real data node server on 127.0.0.1:0 serving ``data_dir``."""
    options.setdefault("chunk_bytes", CHUNK)
    servicer = DataNodeServicer(DatasetCatalog(data_dir), **options)
    server = NodeServer(tls, "127.0.0.1:0", [(add_data_node_servicer, servicer, "hypha.v1.DataNode")])
    await server.start()
    try:
        yield server, servicer
    finally:
        await server.stop(0)


async def stream(
    tls: TlsMaterial, address: str, dataset: str, index: int, offset: int = 0
) -> list[common_pb2.Chunk]:
    async with secure_channel(tls, address) as channel:
        call = data_pb2_grpc.DataNodeStub(channel).StreamSlice(
            data_pb2.StreamSliceRequest(dataset=dataset, index=index, offset=offset), timeout=10
        )
        return [chunk async for chunk in call]


async def rpc_code(coro: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code()


@pytest.fixture
def toy(tmp_path: Path) -> Dataset:
    return prepare(tmp_path / "data")


async def test_slice_streams_in_bounded_chunks_and_reassembles_bit_identical(pki: Pki, toy: Dataset) -> None:
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _):
        chunks = await stream(pki.tls("worker"), server.address, "toy", 2)

    payload, metadata = assemble(chunks, max_bytes=1 << 20, expected_content_type=CONTENT_TYPE)
    assert payload == toy.slice_path(2).read_bytes()
    assert len(chunks) > 2 and all(len(c.data) <= CHUNK for c in chunks)
    assert chunks[0].total_size == toy.slice_size(2) and chunks[-1].last
    assert chunks[-1].sha256 == toy.slice_sha256(2)
    assert metadata == {"dataset": "toy", "index": "2", "sha256": toy.slice_sha256(2), "samples": "8"}


@pytest.mark.parametrize("offset_kind", ["mid-chunk", "chunk-boundary", "end"])
async def test_resumed_stream_continues_at_offset_and_carries_the_whole_slice_sha(
    pki: Pki, toy: Dataset, offset_kind: str
) -> None:
    whole = toy.slice_path(1).read_bytes()
    offset = {"mid-chunk": CHUNK + 123, "chunk-boundary": 2 * CHUNK, "end": len(whole)}[offset_kind]
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _):
        chunks = await stream(pki.tls("worker"), server.address, "toy", 1, offset)

    assert chunks[0].offset == offset and chunks[0].total_size == len(whole)
    assert chunks[0].metadata["sha256"] == toy.slice_sha256(1)
    assert b"".join(c.data for c in chunks) == whole[offset:]
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(whole).hexdigest()


async def test_list_shows_every_dataset_and_picks_up_new_ones_without_restart(pki: Pki, toy: Dataset) -> None:
    data_dir = toy.root.parent
    async with (
        data_node(pki.tls("data"), data_dir) as (server, servicer),
        secure_channel(pki.tls("scheduler"), server.address) as channel,
    ):
        stub = data_pb2_grpc.DataNodeStub(channel)
        first = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5)
        again = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5)
        scans_before = servicer.catalog.scans

        prepare(data_dir, "newer", samples=16)
        after = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5)

    assert [m.name for m in first.datasets] == ["toy"]
    assert first.datasets[0] == toy.manifest.to_proto()
    assert again == first and scans_before == 1  # an unchanged dir is not rescanned
    assert [m.name for m in after.datasets] == ["newer", "toy"]
    assert after.datasets[0].slice_count == 2


async def test_a_dataset_replaced_under_its_name_is_served_anew_and_an_unchanged_one_never_rescanned(
    pki: Pki, toy: Dataset
) -> None:
    data_dir = toy.root.parent
    async with data_node(pki.tls("data"), data_dir) as (server, servicer):
        before = await stream(pki.tls("worker"), server.address, "toy", 1)
        again = await stream(pki.tls("worker"), server.address, "toy", 1)
        scans_unchanged = servicer.catalog.scans

        # The same name, other samples, installed as `hypha-data prepare --overwrite` does
        replaced = write_dataset(sample_tensors(seed=7), data_dir, "toy", samples_per_slice=8, overwrite=True)
        after = await stream(pki.tls("worker"), server.address, "toy", 1)

    old, new = b"".join(c.data for c in before), b"".join(c.data for c in after)
    assert old == b"".join(c.data for c in again) and scans_unchanged == 1
    assert new == replaced.slice_path(1).read_bytes() and new != old
    assert after[0].metadata["sha256"] == replaced.slice_sha256(1) != toy.slice_sha256(1)


async def test_a_missing_data_dir_serves_nothing_until_a_dataset_is_prepared(
    pki: Pki, tmp_path: Path
) -> None:
    data_dir = tmp_path / "not-yet"
    async with (
        data_node(pki.tls("data"), data_dir) as (server, _),
        secure_channel(pki.tls("admin"), server.address) as channel,
    ):
        stub = data_pb2_grpc.DataNodeStub(channel)
        empty = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5)
        prepare(data_dir, "late", samples=8)
        later = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5)

    assert list(empty.datasets) == []
    assert [m.name for m in later.datasets] == ["late"]


async def test_corrupt_slice_is_refused_with_data_loss_and_not_one_byte(
    pki: Pki, toy: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: same size, one flipped byte, so only the checksum can tell.
    path = toy.slice_path(3)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    received: list[common_pb2.Chunk] = []

    async with (
        data_node(pki.tls("data"), toy.root.parent) as (server, servicer),
        secure_channel(pki.tls("worker"), server.address) as channel,
    ):
        call = data_pb2_grpc.DataNodeStub(channel).StreamSlice(
            data_pb2.StreamSliceRequest(dataset="toy", index=3), timeout=5
        )
        with (
            caplog.at_level(logging.ERROR, logger="hypha.data.servicer"),
            pytest.raises(grpc.aio.AioRpcError) as err,
        ):
            async for chunk in call:
                received.append(chunk)
        intact = await stream(pki.tls("worker"), server.address, "toy", 2)

    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert received == []
    assert servicer.stats["refused_corrupt"] == 1
    assert "toy slice 3" in caplog.text
    assert b"".join(c.data for c in intact) == toy.slice_path(2).read_bytes()  # others still served


async def test_rot_found_while_streaming_withholds_the_last_chunk_and_the_next_stream_is_refused(
    pki: Pki, toy: Dataset
) -> None:
    async with (
        data_node(pki.tls("data"), toy.root.parent, trust_verified_s=0) as (server, servicer),
        secure_channel(pki.tls("worker"), server.address) as channel,
    ):
        stub = data_pb2_grpc.DataNodeStub(channel)
        await stream(pki.tls("worker"), server.address, "toy", 3)  # checked whole: known good
        # Prepare: rot that the file's stat cannot show (its new stamp recorded as verified)
        path = toy.slice_path(3)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        servicer.verified.record(str(path), FileStamp.of(os.stat(path)))

        # Execute: hashed as it is sent, so the bytes go out until the last chunk
        received: list[common_pb2.Chunk] = []
        with pytest.raises(grpc.aio.AioRpcError) as during:
            async for chunk in stub.StreamSlice(
                data_pb2.StreamSliceRequest(dataset="toy", index=3), timeout=5
            ):
                received.append(chunk)
        again: list[common_pb2.Chunk] = []
        with pytest.raises(grpc.aio.AioRpcError) as after:
            async for chunk in stub.StreamSlice(
                data_pb2.StreamSliceRequest(dataset="toy", index=3), timeout=5
            ):
                again.append(chunk)

    # Assert: no stream ever carried the verdict, the next one was refused before any byte
    assert during.value.code() == grpc.StatusCode.DATA_LOSS
    assert received and not any(c.last or c.sha256 for c in received)
    assert sum(len(c.data) for c in received) < toy.slice_size(3)
    assert after.value.code() == grpc.StatusCode.DATA_LOSS and again == []
    assert servicer.stats["refused_corrupt"] == 2


async def test_rot_sent_within_the_trust_window_is_refused_by_the_readers_own_check(
    pki: Pki, toy: Dataset
) -> None:
    async with data_node(pki.tls("data"), toy.root.parent, trust_verified_s=3600) as (server, servicer):
        await stream(pki.tls("worker"), server.address, "toy", 1)  # checked whole: trusted now
        # Prepare: rot that the file's stat cannot show (its new stamp recorded as verified)
        path = toy.slice_path(1)
        data = bytearray(path.read_bytes())
        data[7] ^= 0x10
        path.write_bytes(bytes(data))
        servicer.verified.record(str(path), FileStamp.of(os.stat(path)))

        # Execute
        chunks = await stream(pki.tls("worker"), server.address, "toy", 1)

    # Assert: the node sent it unhashed, with the manifest's sha256, and the reader refuses it
    assert chunks[-1].last and chunks[-1].sha256 == toy.slice_sha256(1)
    with pytest.raises(DataLossError, match="checksum"):
        assemble(chunks, max_bytes=1 << 20, expected_content_type=CONTENT_TYPE)


@pytest.mark.parametrize(
    ("dataset", "index", "offset", "code"),
    [
        ("nope", 0, 0, grpc.StatusCode.NOT_FOUND),
        ("toy", 5, 0, grpc.StatusCode.OUT_OF_RANGE),
        ("toy", 4_000_000, 0, grpc.StatusCode.OUT_OF_RANGE),
        ("toy", 0, 10**9, grpc.StatusCode.OUT_OF_RANGE),
    ],
)
async def test_unknown_dataset_or_bad_index_or_offset_is_refused(
    pki: Pki, toy: Dataset, dataset: str, index: int, offset: int, code: grpc.StatusCode
) -> None:
    async with data_node(pki.tls("data"), toy.root.parent) as (server, _):
        assert await rpc_code(stream(pki.tls("worker"), server.address, dataset, index, offset)) == code


async def test_wrong_role_caller_is_permission_denied(pki: Pki, toy: Dataset) -> None:
    async with (
        data_node(pki.tls("data"), toy.root.parent) as (server, _),
        secure_channel(pki.tls("gateway"), server.address) as channel,
    ):
        stub = data_pb2_grpc.DataNodeStub(channel)
        listing = await rpc_code(stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5))
        streaming = await rpc_code(stream(pki.tls("gateway"), server.address, "toy", 0))

    assert listing == grpc.StatusCode.PERMISSION_DENIED
    assert streaming == grpc.StatusCode.PERMISSION_DENIED


async def test_readers_are_served_in_parallel(pki: Pki, toy: Dataset) -> None:
    # Prepare: every stream parks on its first chunk until all four have started, which only
    # happens if the node serves them concurrently.
    started: set[int] = set()
    all_started = asyncio.Event()

    async def hook(dataset: str, index: int, chunk: common_pb2.Chunk) -> None:
        if chunk.offset == 0:
            started.add(index)
            if len(started) == 4:
                all_started.set()
            await asyncio.wait_for(all_started.wait(), 10)

    async with data_node(pki.tls("data"), toy.root.parent, chunk_hook=hook) as (server, _):
        results = await asyncio.gather(
            *[stream(pki.tls("worker"), server.address, "toy", i) for i in range(4)]
        )

    for index, chunks in enumerate(results):
        assert b"".join(c.data for c in chunks) == toy.slice_path(index).read_bytes()


async def test_streams_beyond_the_limit_get_resource_exhausted(pki: Pki, toy: Dataset) -> None:
    # Prepare: one stream holds the only slot until released.
    release = asyncio.Event()
    holding = asyncio.Event()

    async def hook(dataset: str, index: int, chunk: common_pb2.Chunk) -> None:
        if index == 0:
            holding.set()
            await release.wait()

    async with data_node(
        pki.tls("data"), toy.root.parent, chunk_hook=hook, max_concurrent_streams=1, stream_wait_s=0.2
    ) as (server, servicer):
        first = asyncio.create_task(stream(pki.tls("worker"), server.address, "toy", 0))
        await eventually(holding.is_set, message="first stream holds its slot")

        code = await rpc_code(stream(pki.tls("worker"), server.address, "toy", 1))
        release.set()
        held = await first
        after = await stream(pki.tls("worker"), server.address, "toy", 1)

    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and servicer.stats["busy"] == 1
    assert b"".join(c.data for c in held) == toy.slice_path(0).read_bytes()
    assert b"".join(c.data for c in after) == toy.slice_path(1).read_bytes()


async def test_data_node_app_serves_its_data_dir_and_announces_each_dataset(pki: Pki, tmp_path: Path) -> None:
    from hypha.config.common import TlsConfig
    from hypha.data.app import build
    from hypha.data.config import DataNodeSection, DataNodeSettings
    from hypha.dht.node import DhtNode
    from hypha.dht.records import RecordVerifier
    from hypha.worker.fetcher import ProviderInfo, SliceFetcher

    # Prepare: a bootstrap DHT node (a gateway's role) and a data node configured to join it.
    data_dir = tmp_path / "data"
    toy = prepare(data_dir)
    paths = pki.paths("data")
    boot = await DhtNode.create(verifier=RecordVerifier(pki.tls("gateway").trusted_cas))
    settings = DataNodeSettings(
        name="data",
        tls=TlsConfig(cert=paths.cert, key=paths.key, trust=paths.trust),
        data=DataNodeSection(
            data_dir=data_dir, dht_bootstrap=[f"127.0.0.1:{boot.port}"], announce_poll_s=0.05
        ),
    )
    node = build(settings, pki.tls("data"))

    # Execute
    async with boot, node:
        records = await eventually(lambda: boot.find_providers("toy", timeout_s=1), message="toy announced")
        prepare(data_dir, "later", samples=16)
        later = await eventually(lambda: boot.find_providers("later", timeout_s=1), message="later announced")
        async with SliceFetcher(pki.tls("worker"), tmp_path / "cache") as fetcher:
            path = await fetcher.fetch("toy", 4, [ProviderInfo.from_record(r) for r in records])

    # Assert
    assert [(r.provider, r.addresses, r.slice_count) for r in records] == [(node.peer_id, (node.address,), 5)]
    assert [r.manifest_sha256 for r in records] == [toy.manifest.digest()]  # the content is pinned
    assert [r.slice_count for r in later] == [2]
    assert path.read_bytes() == toy.slice_path(4).read_bytes()


def _arithmetic(data_dir: Path) -> Dataset:
    return prepare_synthetic("arithmetic", data_dir, "sums", samples=512, samples_per_slice=256)


@pytest.mark.parametrize(
    ("kind", "mode", "compressed"),
    [
        ("sums", "auto", True),  # int64 token ids: mostly zero bytes
        ("toy", "auto", False),  # random floats: gzip would only cost CPU
        ("sums", "none", False),
        ("sums", "gzip", True),
    ],
)
async def test_slices_travel_gzipped_where_it_pays_and_arrive_bit_identical(
    pki: Pki, tmp_path: Path, kind: str, mode: str, compressed: bool
) -> None:
    data_dir = tmp_path / "data"
    dataset = _arithmetic(data_dir) if kind == "sums" else prepare(data_dir)
    async with data_node(pki.tls("data"), data_dir, wire_compression=mode) as (server, servicer):
        proxy = await TcpProxy(server.address).start()
        try:
            chunks = await stream(pki.tls("worker"), proxy.address, dataset.name, 1)
        finally:
            await proxy.close()
        served = await servicer.catalog.get(dataset.name)

    payload, _ = assemble(chunks, max_bytes=1 << 22, expected_content_type=CONTENT_TYPE)
    assert payload == dataset.slice_path(1).read_bytes()
    size = dataset.slice_size(1)
    if compressed:
        # About an eighth measured (10 kB of an 80 kB slice).
        assert proxy.bytes_back < 0.3 * size, (proxy.bytes_back, size)
    else:
        assert proxy.bytes_back > size, (proxy.bytes_back, size)
    assert servicer.compression.known(served) is compressed


def test_an_unknown_wire_compression_is_refused_naming_the_key() -> None:
    with pytest.raises(ValidationError, match="wire_compression"):
        DataNodeSettings.model_validate({"data": {"wire_compression": "zstd"}})
