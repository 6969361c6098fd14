"""The DHT's UDP port gets garbage: random bytes, well-framed nonsense, oversized and store datagrams.

The gRPC fuzzers cover every TLS service; the DHT listens on plain UDP, where
anyone can send anything. Pass: after every datagram the node still answers a
ping; plain stores are refused; nothing sent is kept; and afterwards a real
peer still pings it, finds nodes through it and round-trips a signed provider
record with it, both ways.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kademlia.node import Node

from hypha.dht import DhtNode, RecordVerifier, provider_key
from hypha.dht.protocol import MAX_REQUEST_BYTES, MAX_VALUE_BYTES
from hypha.dht.records import ProviderRecord, sign_record
from tests.conftest import Pki
from tests.dht.test_records import Identity, issue_identity, trusted_roots
from tests.fuzz.cluster import LoopThread

FUZZ = settings(
    max_examples=int(os.environ.get("HYPHA_FUZZ_EXAMPLES", "200")),
    deadline=None,
    derandomize=os.environ.get("HYPHA_FUZZ_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
#: How long the target may take to answer one ping (a loaded runner is slow, a hung node never answers).
PING_S = 5.0
#: Largest UDP payload over IPv4.
MAX_DATAGRAM = 65_507
REQUEST, REPLY = b"\x00", b"\x01"
#: The RPC names the target serves, the library's internals, and names it does not have.
NAMES = [
    "ping",
    "store",
    "find_node",
    "find_value",
    "add_provider",
    "get_providers",
    "close",
    "welcome_if_new",
    "__init__",
    "_answer",
    "rpc_ping",
    "",
]


@dataclass
class Dht:
    """The fuzzed node and a real peer that joined through it, on a loop of their own."""

    loop: LoopThread
    target: DhtNode
    peer: DhtNode
    provider: Identity
    #: What reached the loop's exception handler: an error a datagram raised in a callback or task.
    errors: list[dict[str, Any]]

    @property
    def address(self) -> tuple[str, int]:
        return (self.target.host, self.target.port)


@pytest.fixture(scope="module")
def dht(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dht]:
    provider = issue_identity(pki, "data", "dht-fuzz-data", Path(tmp_path_factory.mktemp("dht-fuzz")))
    loop = LoopThread("dht-fuzz")
    errors: list[dict[str, Any]] = []
    loop.loop.set_exception_handler(lambda _, context: errors.append(context))
    verifier = RecordVerifier(trusted_roots(pki))

    async def start() -> tuple[DhtNode, DhtNode]:
        target = await DhtNode.create(verifier=verifier, rpc_timeout_s=0.5, lookup_timeout_s=3.0)
        peer = await DhtNode.create(
            bootstrap=[target.address], verifier=verifier, rpc_timeout_s=0.5, lookup_timeout_s=3.0
        )
        return target, peer

    target, peer = loop.run(start())
    try:
        yield Dht(loop, target, peer, provider, errors)
    finally:
        loop.run(target.stop())
        loop.run(peer.stop())
        loop.close()


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    try:
        yield s
    finally:
        s.close()


def await_reply(sock: socket.socket, msg_id: bytes, timeout_s: float = PING_S) -> Any:
    """The body of the reply to ``msg_id``, skipping replies to earlier datagrams; TimeoutError if none."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no reply to {msg_id.hex()} within {timeout_s}s")
        sock.settimeout(left)
        try:
            data = sock.recv(MAX_DATAGRAM)
        except TimeoutError:
            continue
        if data[:21] == REPLY + msg_id:
            return msgpack.unpackb(data[21:], raw=False, strict_map_key=False)


def call(sock: socket.socket, address: tuple[str, int], name: str, *args: Any) -> Any:
    msg_id = os.urandom(20)
    sock.sendto(REQUEST + msg_id + msgpack.packb([name, list(args)], use_bin_type=True), address)
    return await_reply(sock, msg_id)


def assert_alive(dht: Dht, sock: socket.socket) -> None:
    assert call(sock, dht.address, "ping", os.urandom(20)) == dht.target.node_id


# -- what is sent ----------------------------------------------------------------

ids = st.binary(min_size=20, max_size=20)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=64)
    | st.binary(max_size=64)
    | ids
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(scalars, inner, max_size=4),
    max_leaves=24,
)


def frame(kind: bytes, body: bytes) -> bytes:
    return kind + os.urandom(20) + body


def packed(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


#: Any bytes at all, kind byte and length included.
garbage = st.binary(max_size=2048)
#: A well-formed header (request or reply, any id) over an unparseable or arbitrary body.
framed_garbage = st.builds(frame, st.sampled_from([REQUEST, REPLY]), st.binary(max_size=1024))
#: Valid msgpack of any shape where an [name, args] request belongs.
wrong_shapes = st.builds(lambda kind, v: frame(kind, packed(v)), st.sampled_from([REQUEST, REPLY]), values)
#: [name, args] requests with real and made-up names and arguments of any type and count.
requests = st.builds(
    lambda name, args: frame(REQUEST, packed([name, args])),
    st.sampled_from(NAMES) | st.text(max_size=32),
    st.lists(values | ids, max_size=5),
)
#: Frames far past the library's 8 KiB request limit, up to the largest UDP datagram.
oversized = st.builds(
    lambda name, size: frame(REQUEST, packed([name, [os.urandom(20), os.urandom(20), b"\x00" * size]])),
    st.sampled_from(NAMES[:6]),
    st.integers(min_value=MAX_REQUEST_BYTES, max_value=MAX_DATAGRAM - 200),
)
datagrams = garbage | framed_garbage | wrong_shapes | requests | oversized
store_values = (
    st.binary(max_size=MAX_VALUE_BYTES)
    | st.text(max_size=256)
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
)


# -- the tests -------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_datagrams_of_any_shape_leave_the_node_answering_and_storing_nothing(
    dht: Dht, sock: socket.socket
) -> None:
    @FUZZ
    @given(st.lists(datagrams, min_size=1, max_size=4))
    def one(batch: list[bytes]) -> None:
        for datagram in batch:
            sock.sendto(datagram, dht.address)
        assert_alive(dht, sock)

    one()

    assert dht.errors == []
    assert len(dht.target.providers) == 0
    assert list(dht.target.protocol.storage) == []


@pytest.mark.timeout(120)
def test_plain_stores_of_any_value_are_refused(dht: Dht, sock: socket.socket) -> None:
    refused_before = dht.target.protocol.refused_stores
    answers: list[Any] = []

    @FUZZ
    @given(st.sampled_from([b"", os.urandom(20)]) | ids, store_values)
    def one(key: bytes, value: object) -> None:
        answers.append(call(sock, dht.address, "store", os.urandom(20), key, value))

    one()

    assert answers and all(answer is False for answer in answers)
    assert dht.target.protocol.refused_stores - refused_before == len(answers)
    assert list(dht.target.protocol.storage) == []
    assert len(dht.target.providers) == 0


def _signed(ident: Identity, dataset: str) -> bytes:
    record = ProviderRecord.issue(
        dataset, ident.peer_id, ["10.0.0.9:7400"], 4, seq=1, now=time.time(), lifetime_s=300.0
    )
    return sign_record(record, ident.key, ident.chain)


@pytest.mark.timeout(120)
def test_after_the_fuzzing_a_real_peer_pings_finds_and_round_trips_records(
    dht: Dht, sock: socket.socket
) -> None:
    # Prepare: a last burst of garbage, so this test holds whatever order the tests run in.
    for junk in (b"\x00" * 21, frame(REQUEST, b"\xc1"), frame(REQUEST, packed(["store", [1, 2]]))):
        sock.sendto(junk, dht.address)
    target, peer = dht.target, dht.peer
    target_node = Node(target.node_id, target.host, target.port)

    async def exchange() -> tuple[Any, ...]:
        ping = await peer.protocol.ping((target.host, target.port), peer.node_id)
        found = await peer.protocol.call_find_node(target_node, Node(os.urandom(20)))
        stored = await peer.announce(_signed(dht.provider, "fuzz-from-peer"))
        held = [r.provider for r, _ in target.providers.get(provider_key("fuzz-from-peer"))]
        await target.announce(_signed(dht.provider, "fuzz-from-target"))
        read = await peer.find_providers("fuzz-from-target", timeout_s=3.0)
        return ping, found, stored, held, read

    # Execute
    ping, (found_ok, _), stored, held, read = dht.loop.run(exchange())

    # Assert: both directions work, and the target holds exactly the two signed records.
    assert ping == (True, target.node_id)
    assert found_ok
    assert stored >= 1 and held == [dht.provider.peer_id]
    assert [r.provider for r in read] == [dht.provider.peer_id]
    assert {r.dataset for key, entries in target.providers.items() for r, _ in entries} == {
        "fuzz-from-peer",
        "fuzz-from-target",
    }
    assert dht.errors == []
