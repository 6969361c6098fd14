"""Dataset content is pinned: the provider record carries the manifest's sha256 and fetchers hold
every provider to it (issue 16: "nothing pins a dataset's content")."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hypha.datasets.format import Dataset
from hypha.dht.records import ProviderRecord
from hypha.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from hypha.net.server import NodeServer
from hypha.scheduler.providers import one_content, provider_peer
from hypha.worker.fetcher import ProviderInfo, SliceFetcher
from tests.conftest import Pki
from tests.data.test_serving import data_node, prepare


def pinned(server: NodeServer, dataset: Dataset) -> ProviderInfo:
    """A provider as the scheduler names it: with the pin of the honest dataset's record."""
    return ProviderInfo(server.tls.identity.peer_id, (server.address,), dataset.manifest.digest())


def record(provider: str, pin: str) -> ProviderRecord:
    return ProviderRecord.issue(
        "toy", provider, ["127.0.0.1:1"], 5, seq=1, now=0.0, lifetime_s=60.0, manifest_sha256=pin
    )


async def test_a_data_node_serving_other_bytes_under_the_name_is_refused(pki: Pki, tmp_path: Path) -> None:
    honest = prepare(tmp_path / "honest")
    prepare(tmp_path / "impostor", seed=7)  # same name, same shape, other content
    async with (
        data_node(pki.tls("data"), tmp_path / "impostor") as (impostor, _),
        SliceFetcher(pki.tls("worker"), tmp_path / "cache", rng=random.Random(0)) as fetcher,
    ):
        with pytest.raises(UnavailableError, match="not the pinned"):
            await fetcher.fetch("toy", 0, [pinned(impostor, honest)])
        assert fetcher.cached("toy", 0) is None  # nothing of the impostor's landed in the cache


async def test_the_honest_copy_is_used_when_an_impostor_is_listed_first(pki: Pki, tmp_path: Path) -> None:
    honest = prepare(tmp_path / "honest")
    prepare(tmp_path / "impostor", seed=7)
    async with (
        data_node(pki.issue("data", "impostor"), tmp_path / "impostor") as (impostor, impostor_servicer),
        data_node(pki.tls("data"), tmp_path / "honest") as (good, _),
        SliceFetcher(pki.tls("worker"), tmp_path / "cache", rng=random.Random(0)) as fetcher,
    ):
        # Every rotation of the list is tried, so the impostor comes first for some slices.
        paths = [
            await fetcher.fetch("toy", i, [pinned(impostor, honest), pinned(good, honest)]) for i in range(5)
        ]

    assert [p.read_bytes() for p in paths] == [honest.slice_path(i).read_bytes() for i in range(5)]
    assert impostor_servicer.stats["streams"] == 0  # refused at the manifest, before any slice


async def test_providers_pinning_different_contents_are_refused_by_the_fetcher(
    pki: Pki, tmp_path: Path
) -> None:
    honest = prepare(tmp_path / "honest")
    other = prepare(tmp_path / "impostor", seed=7)
    async with (
        data_node(pki.tls("data"), tmp_path / "honest") as (good, _),
        SliceFetcher(pki.tls("worker"), tmp_path / "cache") as fetcher,
    ):
        with pytest.raises(FailedPreconditionError, match="different manifests"):
            await fetcher.fetch("toy", 0, [pinned(good, honest), pinned(good, other)])


def test_scheduler_refuses_a_name_announced_with_two_contents() -> None:
    a, b = "a" * 64, "b" * 64
    same = [record("p1", a), record("p2", a)]

    assert one_content("toy", same) == same
    with pytest.raises(FailedPreconditionError, match="different contents under the name 'toy'"):
        one_content("toy", [record("p1", a), record("p2", b)])
    with pytest.raises(FailedPreconditionError, match="unpinned"):
        one_content("toy", [record("p1", a), record("p2", "")])


def test_the_pin_travels_from_record_to_the_fetcher() -> None:
    pin = "c" * 64

    peer = provider_peer(record("p1", pin))

    assert ProviderInfo.from_proto(peer).manifest_sha256 == pin


@pytest.mark.parametrize("pin", ["A" * 64, "a" * 63, "z" * 64, 5])
def test_malformed_pins_are_refused_in_records(pin: object) -> None:
    with pytest.raises(InvalidArgumentError, match="manifest_sha256"):
        record("p1", pin)  # type: ignore[arg-type]


def test_manifest_digest_survives_the_wire_form(tmp_path: Path) -> None:
    dataset = prepare(tmp_path / "d")

    assert (
        type(dataset.manifest).from_proto(dataset.manifest.to_proto()).digest() == dataset.manifest.digest()
    )
