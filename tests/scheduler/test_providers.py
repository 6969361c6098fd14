"""The scheduler's DHT endpoint over real UDP: it starts at once and joins in the background."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.dht import DhtNode, RecordVerifier
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.providers import DatasetProviders
from tests.conftest import Pki
from tests.dht.test_dht import signed
from tests.dht.test_records import issue_identity, trusted_roots

RPC_TIMEOUT_S = 1.5


@pytest.fixture
def silent_peer() -> Iterator[str]:
    """A bootstrap address that takes datagrams and never answers (a node that is gone)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def test_the_endpoint_starts_without_waiting_for_its_join_and_a_lookup_waits_for_it(
    pki: Pki, tmp_path: Path, silent_peer: str
) -> None:
    # Prepare: a DHT of one node where a data node announced "mnist"; the scheduler's
    # bootstrap list also names a peer that is gone, so joining costs an RPC timeout.
    verifier = RecordVerifier(trusted_roots(pki))
    gateway = await DhtNode.create(verifier=verifier, rpc_timeout_s=RPC_TIMEOUT_S)
    data = await DhtNode.create(bootstrap=[gateway.address], verifier=verifier, rpc_timeout_s=RPC_TIMEOUT_S)
    assert await data.announce(signed(issue_identity(pki, "data", "providers-data", tmp_path))) > 0
    section = SchedulerSection(dht_bootstrap=[silent_peer, gateway.address], dht_rpc_timeout_s=RPC_TIMEOUT_S)
    providers = DatasetProviders(pki.tls("scheduler"), section)
    try:
        # Execute
        started = time.monotonic()
        await providers.start()
        start_s = time.monotonic() - started
        async with asyncio.timeout(10):
            records = await providers.find("mnist")
        found_s = time.monotonic() - started
    finally:
        await providers.stop()
        await data.stop()
        await gateway.stop()
    # Assert: start did not wait for the silent peer; the lookup did, and found the record.
    assert start_s < RPC_TIMEOUT_S / 2
    assert found_s >= RPC_TIMEOUT_S
    assert [record.dataset for record in records] == ["mnist"]


async def test_stopping_during_the_join_cancels_it(pki: Pki, silent_peer: str) -> None:
    section = SchedulerSection(dht_bootstrap=[silent_peer], dht_rpc_timeout_s=RPC_TIMEOUT_S)
    providers = DatasetProviders(pki.tls("scheduler"), section)
    await providers.start()
    joining = providers._joining
    assert joining is not None and not joining.done()
    async with asyncio.timeout(RPC_TIMEOUT_S / 2):
        await providers.stop()
    assert joining.cancelled()
