"""What a node advertises: configured addresses, else real interface addresses, never 127.0.0.1
for a wildcard listener (a peer dialling 127.0.0.1 reaches itself)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import pytest

from hypha.net.addresses import advertised_addresses, host_addresses
from hypha.net.probe import probe
from hypha.node import Node
from tests.conftest import Pki

pytestmark = pytest.mark.timeout(60)
#: A host with loopback, a LAN address, a link-local one and a global IPv6 one.
HOST = ["127.0.0.1", "::1", "10.1.2.3", "169.254.9.9", "fe80::1%eth0", "2001:db8::7", "10.1.2.3"]


def interfaces(*found: str) -> Callable[[], list[str]]:
    return lambda: list(found)


def test_a_wildcard_listener_advertises_the_hosts_other_addresses_of_its_family() -> None:
    assert advertised_addresses("0.0.0.0:7000", 7000, find_interfaces=interfaces(*HOST)) == ["10.1.2.3:7000"]
    assert advertised_addresses("[::]:0", 7001, find_interfaces=interfaces(*HOST)) == [
        "10.1.2.3:7001",
        "[2001:db8::7]:7001",
    ]


def test_configured_and_explicit_addresses_are_advertised_as_they_are() -> None:
    external = ["gw.example.org:7000", "203.0.113.5:17000"]

    assert advertised_addresses("0.0.0.0:7000", 7000, external, find_interfaces=interfaces(*HOST)) == external
    assert advertised_addresses("127.0.0.1:0", 7002, find_interfaces=interfaces(*HOST)) == ["127.0.0.1:7002"]
    assert advertised_addresses("[::1]:0", 7003, find_interfaces=interfaces(*HOST)) == ["[::1]:7003"]


def test_a_host_with_only_loopback_says_so_and_advertises_loopback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hypha.net.addresses"):
        advertised = advertised_addresses("0.0.0.0:0", 7004, find_interfaces=interfaces("127.0.0.1", "::1"))

    assert advertised == ["127.0.0.1:7004"]
    assert "no non-loopback address" in caplog.text and "net.external_addresses" in caplog.text


@pytest.fixture
async def wildcard_node(pki: Pki) -> AsyncIterator[Node]:
    node = Node("w-any", pki.tls("worker"), "0.0.0.0:0", [], max_message_bytes=1 << 20, keepalive_s=20.0)
    await node.start()
    yield node
    await node.stop()


async def test_a_node_on_0_0_0_0_advertises_addresses_peers_can_dial_and_never_127_0_0_1(
    pki: Pki, wildcard_node: Node
) -> None:
    real = [a for a in host_addresses() if not a.startswith("127.") and ":" not in a]
    if not real:
        pytest.skip("this host has no non-loopback IPv4 address to advertise")
    node = wildcard_node
    port = node.server.port

    advertised = node.addresses
    answers = [await probe(pki.tls("client"), a, timeout_s=5, server_name="worker") for a in advertised]

    assert advertised and f"127.0.0.1:{port}" not in advertised
    assert all(a.endswith(f":{port}") for a in advertised)
    assert answers == [(True, "SERVING")] * len(advertised)
    assert node.address == f"127.0.0.1:{port}"  # what a supervisor on this host dials


async def test_a_node_on_0_0_0_0_advertises_its_interfaces_or_its_configured_addresses(pki: Pki) -> None:
    def node(name: str, external: list[str]) -> Node:
        return Node(
            name, pki.tls("worker"), "0.0.0.0:0", [], max_message_bytes=1 << 20, keepalive_s=20.0,
            external_addresses=external, find_interfaces=interfaces(*HOST),
        )  # fmt: skip

    lan, nat = node("w-lan", []), node("w-nat", ["w.example.org:7300"])
    await lan.start()
    await nat.start()
    try:
        assert lan.addresses == [f"10.1.2.3:{lan.server.port}"]
        assert nat.addresses == ["w.example.org:7300"]
    finally:
        await lan.stop()
        await nat.stop()
