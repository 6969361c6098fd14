"""The fuzz cluster, started once per module (starting four nodes per example would dominate)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hypha.testing.pki import Pki, make_pki
from tests.fuzz.cluster import FuzzBridge, FuzzCluster


def _started(tmp_path_factory: pytest.TempPathFactory, **options: bool) -> Iterator[FuzzCluster]:
    # A PKI of its own: the session's `pki` is shared, and these nodes keep state in it.
    pki: Pki = make_pki(tmp_path_factory.mktemp("fuzz-pki"))
    c = FuzzCluster(pki, tmp_path_factory.mktemp("fuzz-nodes"), **options)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzCluster]:
    yield from _started(tmp_path_factory)


@pytest.fixture(scope="module")
def market_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzCluster]:
    """A cluster whose scheduler is on the market (no worker offers): its jobs stay active."""
    yield from _started(tmp_path_factory, scheduler_on_market=True)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzBridge]:
    b = FuzzBridge(tmp_path_factory.mktemp("fuzz-bridge"))
    try:
        b.start()
        yield b
    finally:
        b.stop()
