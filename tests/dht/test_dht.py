"""The DHT over real UDP on 127.0.0.1: nodes started in-process, records signed by real certificates."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import umsgpack
from kademlia.network import Server
from kademlia.node import Node
from kademlia.utils import digest

from hypha.dht import DhtNode, Publisher, RecordVerifier, provider_key
from hypha.dht.protocol import PAGE_BUDGET_BYTES
from hypha.dht.records import ProviderRecord, sign_record
from tests.conftest import Pki
from tests.dht.test_records import Identity, issue_identity, trusted_roots
from tests.helpers import eventually

Cluster = Callable[..., Awaitable[list[DhtNode]]]


@pytest.fixture(scope="module")
def providers(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    out = tmp_path_factory.mktemp("dht-certs")
    return [issue_identity(pki, "data", f"dht-data-{i}", out) for i in range(8)]


@pytest.fixture(scope="module")
def stranger(foreign_pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return issue_identity(foreign_pki, "data", "dht-stranger", tmp_path_factory.mktemp("dht-foreign"))


@pytest.fixture
async def cluster(pki: Pki) -> AsyncIterator[Cluster]:
    """Start ``n`` nodes that all bootstrap from the first; every node is stopped at teardown."""
    started: list[DhtNode] = []

    async def start(n: int = 10, *, max_skew_s: float = 5.0, **options: Any) -> list[DhtNode]:
        verifier = RecordVerifier(trusted_roots(pki), max_skew_s=max_skew_s)
        options = {"rpc_timeout_s": 1.0, **options}
        first = await DhtNode.create(verifier=verifier, **options)
        started.append(first)
        for _ in range(n - 1):
            started.append(await DhtNode.create(bootstrap=[first.address], verifier=verifier, **options))
        return started[-n:]

    yield start
    for node in started:
        await node.stop()


async def announce_everywhere(node: DhtNode, blob: bytes, nodes: int) -> None:
    """Announce until all ``nodes`` - 1 others stored the record: on a loaded runner an
    announce's walk may end before a slow storer answered (``hypha.dht.lookup``'s NOTE),
    and tests that read one storer's early answer need the record on every storer."""

    async def stored() -> bool:
        return await node.announce(blob) == nodes - 1

    await eventually(stored, timeout=10.0, message="the record on every node")


def signed(
    ident: Identity, dataset: str = "mnist", *, seq: int = 1, lifetime_s: float = 60.0, port: int = 7000
) -> bytes:
    record = ProviderRecord.issue(
        dataset, ident.peer_id, [f"127.0.0.1:{port}"], 16, seq=seq, now=time.time(), lifetime_s=lifetime_s
    )
    return sign_record(record, ident.key, ident.chain)


async def raw_call(address: tuple[str, int], method: str, *args: Any, timeout_s: float = 2.0) -> Any:
    """One rpcudp request from a bare socket, the way a hostile peer would send it."""

    class Inbox(asyncio.DatagramProtocol):
        def __init__(self) -> None:
            self.replies: asyncio.Queue[bytes] = asyncio.Queue(maxsize=8)

        def datagram_received(self, data: bytes, addr: Any) -> None:
            self.replies.put_nowait(data)

    loop = asyncio.get_running_loop()
    transport, inbox = await loop.create_datagram_endpoint(Inbox, local_addr=("127.0.0.1", 0))
    try:
        msg_id = os.urandom(20)
        transport.sendto(b"\x00" + msg_id + umsgpack.packb([method, list(args)]), address)
        reply = await asyncio.wait_for(inbox.replies.get(), timeout_s)
    finally:
        transport.close()
    assert reply[:21] == b"\x01" + msg_id
    return umsgpack.unpackb(reply[21:])


def addr(node: DhtNode) -> tuple[str, int]:
    return (node.host, node.port)


async def test_lookup_finds_every_provider_of_a_dataset(cluster: Cluster, providers: list[Identity]) -> None:
    # Prepare: three data nodes announce the same dataset from three different DHT nodes.
    nodes = await cluster(10, ksize=4)
    for i, ident in enumerate(providers[:3]):
        assert await nodes[i + 1].announce(signed(ident, port=7000 + i)) > 0

    # Execute: the whole walk (the default answers with the first storer's set, maybe not all).
    # A walk is bounded by its timeout, and on a loaded 2-core machine UDP replies can all come
    # after it (one CI run found nothing in 5 s): a caller walks again, and so does the test.
    want = {p.peer_id for p in providers[:3]}

    async def walk() -> list[ProviderRecord]:
        found = await nodes[-1].find_providers("mnist", timeout_s=5.0, min_providers=None)
        assert {r.provider for r in found} == want
        return found

    found = await eventually(walk, timeout=30.0, message="every provider found by one walk")

    # Assert
    assert {r.provider for r in found} == want
    assert {r.addresses for r in found} == {("127.0.0.1:7000",), ("127.0.0.1:7001",), ("127.0.0.1:7002",)}
    assert await nodes[-1].find_providers("unknown-dataset", timeout_s=5.0) == []


async def test_providers_beyond_one_reply_page_are_all_found(
    cluster: Cluster, providers: list[Identity]
) -> None:
    nodes = await cluster(6)
    blobs = [signed(ident, "imagenet") for ident in providers]
    for i, blob in enumerate(blobs):
        await nodes[i % 3].announce(blob)
    first_page = await raw_call(addr(nodes[4]), "get_providers", os.urandom(20), provider_key("imagenet"), "")

    found = await nodes[5].find_providers("imagenet", timeout_s=5.0, min_providers=None)

    assert sum(len(b) for b in blobs) > PAGE_BUDGET_BYTES
    assert first_page["next"] is not None and len(first_page["providers"]) < len(providers)
    assert len(found) == len(providers)


async def test_plain_stores_from_the_network_are_refused_and_nothing_is_kept(cluster: Cluster) -> None:
    # Prepare: a stock kademlia peer and a bare socket, both outside anyone's PKI.
    nodes = await cluster(4)
    attacker_id = os.urandom(20)
    stock = Server()
    await stock.listen(0, "127.0.0.1")
    try:
        # Execute: scalar and non-scalar values, from a raw datagram and from the stock library.
        replies = []
        for node in nodes:
            for value in (b"hello", "text", 7, [1, 2, 3]):
                replies.append(await raw_call(addr(node), "store", attacker_id, digest("greeting"), value))
        await stock.bootstrap([addr(nodes[0])])
        await stock.set("planted", b"value")  # the library reports success whatever peers answer
        answers = [await raw_call(addr(node), "find_value", attacker_id, digest("planted")) for node in nodes]
    finally:
        stock.stop()

    # Assert: refused everywhere, counted, and a read finds only closer nodes, never a value.
    assert replies == [False] * len(replies)
    assert sum(node.protocol.refused_stores for node in nodes) > len(replies)  # the stock peer's too
    assert all(isinstance(answer, list) for answer in answers)


async def test_one_certificate_cannot_fill_a_storer_with_provider_records(
    cluster: Cluster, providers: list[Identity]
) -> None:
    # Prepare: a storer that keeps at most two records of any one provider.
    (node,) = await cluster(1, max_records_per_provider=2)
    flooder, other = providers[0], providers[1]
    sender = os.urandom(20)

    # Execute: the flooder announces three datasets; then another data node announces one.
    flooded = [
        await raw_call(addr(node), "add_provider", sender, provider_key(name), signed(flooder, name))
        for name in ("flood-0", "flood-1", "flood-2")
    ]
    bystander = await raw_call(
        addr(node), "add_provider", sender, provider_key("flood-2"), signed(other, "flood-2")
    )

    # Assert
    assert flooded == [True, True, False]
    assert bystander is True
    assert node.providers.records_of(flooder.peer_id) == 2


async def test_garbage_datagrams_do_not_break_a_node(cluster: Cluster) -> None:
    nodes = await cluster(2)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
    for junk in (
        b"\x00" + os.urandom(20) + b"\xc1",
        b"\x00" + os.urandom(20) + umsgpack.packb("x"),
        b"\x07" * 40,
    ):
        transport.sendto(junk, addr(nodes[1]))
    transport.close()

    # A request with the wrong number of arguments is dropped, a good one still answered.
    with pytest.raises(TimeoutError):
        await raw_call(addr(nodes[1]), "ping", timeout_s=0.3)
    assert await raw_call(addr(nodes[1]), "ping", os.urandom(20)) == nodes[1].node_id


async def test_nodes_speak_with_stock_kademlia_peers_both_ways(cluster: Cluster) -> None:
    # Our codec is msgpack's C extension, the library's is u-msgpack: same frames, same bytes.
    ours, other = await cluster(2)
    stock = Server()
    await stock.listen(0, "127.0.0.1")
    try:
        stock_addr = stock.transport.get_extra_info("sockname")[:2]
        assert await ours.protocol.ping(stock_addr, ours.node_id) == (True, stock.node.id)
        assert await stock.protocol.ping(addr(ours), stock.node.id) == (True, ours.node_id)
        ok, nodes = await stock.protocol.call_find_node(Node(ours.node_id, *addr(ours)), Node(digest("any")))
        assert ok and [(n[0], n[1], n[2]) for n in nodes] == [(other.node_id, *addr(other))]
    finally:
        stock.stop()


async def test_storers_refuse_forged_and_misfiled_records(
    cluster: Cluster, providers: list[Identity], stranger: Identity
) -> None:
    nodes = await cluster(3)
    attacker_id = os.urandom(20)
    foreign = signed(stranger)
    misfiled = signed(providers[0], "cifar")

    assert (
        await raw_call(addr(nodes[1]), "add_provider", attacker_id, provider_key("mnist"), foreign) is False
    )
    assert (
        await raw_call(addr(nodes[1]), "add_provider", attacker_id, provider_key("mnist"), misfiled) is False
    )
    assert await raw_call(addr(nodes[1]), "add_provider", attacker_id, provider_key("mnist"), [1]) is False
    assert await nodes[2].find_providers("mnist", timeout_s=2.0) == []


async def test_reader_keeps_the_highest_seq_and_storers_refuse_replays(
    cluster: Cluster, providers: list[Identity]
) -> None:
    # Prepare: seq 3 everywhere, then seq 5 on one storer only.
    nodes = await cluster(6)
    ident = providers[0]
    old, new = signed(ident, seq=3, port=7003), signed(ident, seq=5, port=7005)
    await nodes[1].announce(old)
    key, attacker_id = provider_key("mnist"), os.urandom(20)
    assert await raw_call(addr(nodes[2]), "add_provider", attacker_id, key, new) is True

    # Execute: replaying the old record to the storer that holds the new one.
    replay = await raw_call(addr(nodes[2]), "add_provider", attacker_id, key, old)
    whole_walk = await nodes[5].find_providers("mnist", timeout_s=5.0, min_providers=None)
    early = await nodes[4].find_providers("mnist", timeout_s=5.0)

    # The early answer may come from a storer with seq 3; its walk goes on and caches seq 5.
    async def newest_seen() -> list[ProviderRecord]:
        found = await nodes[4].find_providers("mnist", timeout_s=5.0)
        assert [r.seq for r in found] == [5]
        return found

    later = await eventually(newest_seen, timeout=5.0, message="seq 5 cached")

    # Assert
    assert replay is False
    assert [(r.seq, r.addresses) for r in whole_walk] == [(5, ("127.0.0.1:7005",))]
    assert [r.seq for r in early] in ([3], [5])
    assert [(r.seq, r.addresses) for r in later] == [(5, ("127.0.0.1:7005",))]


async def test_lookup_with_dead_nodes_finishes_in_time_and_finds_live_copies(
    cluster: Cluster, providers: list[Identity]
) -> None:
    # Prepare: records everywhere, then a third of the network dies.
    nodes = await cluster(9, rpc_timeout_s=20.0)
    for i, ident in enumerate(providers[:3]):
        await announce_everywhere(nodes[i], signed(ident, port=7000 + i), len(nodes))
    for node in nodes[3:6]:
        await node.stop()

    # Execute
    started = time.monotonic()
    found = await nodes[8].find_providers("mnist", timeout_s=1.5)
    elapsed = time.monotonic() - started

    # Assert: about the lookup deadline, far from even one 20 s RPC timeout (the slack is
    # for a loaded runner; the defect this guards against costs 20 s per dead peer).
    assert elapsed < 1.5 + 3.0
    assert len(found) == 3


async def test_lookup_with_every_peer_dead_returns_at_its_deadline(
    cluster: Cluster, providers: list[Identity]
) -> None:
    nodes = await cluster(5, rpc_timeout_s=20.0)
    for node in nodes[1:]:
        await node.stop()

    started = time.monotonic()
    found = await nodes[0].find_providers("mnist", timeout_s=0.4)
    elapsed = time.monotonic() - started

    assert found == []
    assert elapsed < 0.4 + 3.0  # the deadline, not a 20 s RPC timeout (slack for a loaded runner)


async def test_republish_bumps_seq_and_outlives_the_first_expiry(
    cluster: Cluster, providers: list[Identity]
) -> None:
    # Prepare
    skew = 0.1
    nodes = await cluster(6, max_skew_s=skew)
    ident = providers[0]
    publisher = Publisher(nodes[1], ident.key, ident.chain, lifetime_s=1.0, republish_fraction=0.4)

    async with publisher:
        # Execute
        first = await publisher.publish("mnist", ["127.0.0.1:7000"], 16)
        await eventually(lambda: time.time() > first.expires_at + skew, timeout=5.0, message="first expiry")
        found = await nodes[4].find_providers("mnist", timeout_s=2.0)

    # Assert: a newer record, alive after the first one died.
    assert len(found) == 1
    assert found[0].seq > first.seq
    assert found[0].expires_at > first.expires_at
    assert publisher.records["mnist"].seq >= found[0].seq


async def test_bootstrap_resolves_host_names(cluster: Cluster, pki: Pki) -> None:
    nodes = await cluster(2)
    verifier = RecordVerifier(trusted_roots(pki))

    async with await DhtNode.create(bootstrap=[f"localhost:{nodes[0].port}"], verifier=verifier) as late:
        assert late.contacts() >= 1
        assert late.port not in (0, nodes[0].port)


async def test_node_started_before_its_bootstrap_peer_answers_joins_later(
    cluster: Cluster, pki: Pki, providers: list[Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the bootstrap peer is up but not answering yet.
    (peer,) = await cluster(1)
    with monkeypatch.context() as patch:
        patch.setattr(peer.protocol, "rpc_ping", lambda *args: 1 / 0)
        early = await DhtNode.create(bootstrap=[peer.address], verifier=peer.verifier, rpc_timeout_s=0.3)
    try:
        assert early.contacts() == 0

        # Execute: once it answers, the next announce joins first.
        accepted = await early.announce(signed(providers[0]))

        # Assert
        assert accepted == 1
        assert [r.provider for r in await peer.find_providers("mnist", timeout_s=2.0)] == [
            providers[0].peer_id
        ]
    finally:
        await early.stop()


def contacts_of(node: DhtNode) -> set[bytes]:
    return {contact.id for bucket in node.protocol.router.buckets for contact in bucket.get_nodes()}


def count_asked(node: DhtNode, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record the id of every peer ``node`` asks for providers from now on."""
    asked: list[bytes] = []
    call = node.protocol.call_get_providers

    async def counting(peer: Any, key: bytes, after: str = "") -> Any:
        asked.append(peer.id)
        return await call(peer, key, after)

    monkeypatch.setattr(node.protocol, "call_get_providers", counting)
    return asked


async def test_lookup_answers_early_despite_hung_peers(
    cluster: Cluster, providers: list[Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: every record on every node, then two nodes hang (they read nothing, answer nothing).
    nodes = await cluster(8, rpc_timeout_s=20.0, cache_fresh_s=0.0)
    for i, ident in enumerate(providers[:3]):
        await announce_everywhere(nodes[i], signed(ident, port=7000 + i), len(nodes))
    reader = nodes[-1]
    reader.providers.prune()
    for hung in nodes[1:3]:  # as if SIGSTOPped: datagrams arrive, nothing is read or answered
        monkeypatch.setattr(hung.protocol, "datagram_received", lambda data, address: None)

    # Execute: several lookups, none answered from the reader's cache.
    elapsed, found = [], []
    for _ in range(5):
        started = time.monotonic()
        found.append(await reader.find_providers("mnist", timeout_s=5.0))
        elapsed.append(time.monotonic() - started)
        await reader.wait_refreshed()

    # Assert: far below one 20 s RPC timeout (slack for a loaded runner), every provider found every time.
    assert max(elapsed) < 4.0
    assert all({r.provider for r in f} == {p.peer_id for p in providers[:3]} for f in found)


async def test_a_dead_peer_is_skipped_by_later_walks_then_evicted(
    cluster: Cluster, providers: list[Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    nodes = await cluster(6, rpc_timeout_s=0.3, cache_fresh_s=0.0)
    await nodes[0].announce(signed(providers[0]))
    reader, dead = nodes[-1], nodes[2]
    await dead.stop()
    first = await reader.find_providers("mnist", timeout_s=3.0, min_providers=None)
    await eventually(
        lambda: reader.health.failures(dead.node_id) >= 2, timeout=3.0, message="stall and timeout"
    )

    # Execute: a second whole walk within the backoff.
    asked = count_asked(reader, monkeypatch)
    second = await reader.find_providers("mnist", timeout_s=3.0, min_providers=None)

    # Assert: not asked again; once the backoff lapses and it fails again, it leaves routing.
    assert len(first) == len(second) == 1
    assert reader.health.backing_off(dead.node_id)
    assert dead.node_id not in asked and asked
    reader.health.base_s = reader.health.cap_s = 0.001
    await eventually(lambda: not reader.health.backing_off(dead.node_id), timeout=3.0, message="backoff over")
    await reader.find_providers("mnist", timeout_s=3.0, min_providers=None)
    await eventually(
        lambda: dead.node_id not in contacts_of(reader), timeout=3.0, message="dead peer evicted"
    )


async def test_a_fresh_cache_answers_without_asking_anyone(
    cluster: Cluster, providers: list[Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = await cluster(5, cache_fresh_s=30.0)
    await nodes[0].announce(signed(providers[0]))
    reader = nodes[-1]
    reader.providers.prune()
    first = await reader.find_providers("mnist", timeout_s=3.0)
    await reader.wait_refreshed()

    asked = count_asked(reader, monkeypatch)
    again = await reader.find_providers("mnist", timeout_s=3.0)
    whole = await reader.find_providers("mnist", timeout_s=3.0, min_providers=None)

    assert [r.provider for r in first] == [r.provider for r in again] == [providers[0].peer_id]
    assert [r.provider for r in whole] == [providers[0].peer_id]
    assert asked  # only the whole walk (min_providers=None) went to the network


async def test_a_fresh_cache_with_fewer_than_min_providers_asks_the_network(
    cluster: Cluster, providers: list[Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the reader's cache holds one provider, fresh; two more announce afterwards.
    nodes = await cluster(6, cache_fresh_s=30.0)
    await nodes[0].announce(signed(providers[0], port=7000))
    reader = nodes[-1]
    reader.providers.prune()
    assert len(await reader.find_providers("mnist", timeout_s=3.0)) == 1
    await reader.wait_refreshed()
    for i in (1, 2):
        assert await nodes[i].announce(signed(providers[i], port=7000 + i)) > 0

    # Execute
    asked = count_asked(reader, monkeypatch)
    one = await reader.find_providers("mnist", timeout_s=3.0)  # one is enough: the cache answers
    three = await reader.find_providers("mnist", timeout_s=3.0, min_providers=3)

    # Assert
    assert [r.provider for r in one] == [providers[0].peer_id]
    assert asked  # the cache had too few for three: the network was asked
    assert {r.provider for r in three} == {p.peer_id for p in providers[:3]}
