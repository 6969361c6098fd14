"""Killing a gateway process: its nodes fail over and nothing published after
recovery is lost. Gateways are real processes; nodes are in-process links."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.net.link import NodeLink, Subscription
from tests.conftest import Pki
from tests.helpers import NodeProcess, cli

#: The failover bound this test holds the link to (README: "Gateway failover").
FAILOVER_BOUND_S = 10.0


@pytest.fixture
def gateways(pki: Pki, tmp_path: Path) -> Iterator[list[NodeProcess]]:
    procs: list[NodeProcess] = []
    addresses: list[str] = []
    try:
        for i in range(3):
            name = f"kgw{i}"
            pki.issue("gateway", name)
            config = tmp_path / f"{name}.toml"
            subprocess.run(
                [
                    *cli("hypha-gateway"),
                    "init",
                    "--name",
                    name,
                    "--certs",
                    str(pki.dir),
                    "--out",
                    str(config),
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            proc = NodeProcess(
                [
                    *cli("hypha-gateway"),
                    "run",
                    "--config",
                    str(config),
                    "--set",
                    f"gateway.peers={json.dumps(addresses)}",
                    "--set",
                    "gateway.reconnect_base_s=0.05",
                ],
                tmp_path,
                name,
            )
            procs.append(proc)
            addresses.append(proc.wait_ready()["address"])
        yield procs
    finally:
        for proc in procs:
            proc.stop()


async def probe_until_received(publisher: NodeLink, subs: list[Subscription], timeout: float) -> None:
    """Publish probes until every subscriber has one (the mesh is wired end to end)."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(subs)))
    while pending:
        assert time.monotonic() < deadline, f"subscribers {pending} never received a probe"
        await publisher.publish("t", b"probe")
        for i in list(pending):
            try:
                while (await subs[i].get(timeout=0.2)).payload != b"probe":
                    pass
                pending.discard(i)
            except TimeoutError:
                pass
    for sub in subs:  # drop extra probes
        while not sub.queue.empty():
            sub.queue.get_nowait()


async def test_nodes_fail_over_when_a_gateway_process_is_killed(
    pki: Pki, gateways: list[NodeProcess]
) -> None:
    addr = [g.address for g in gateways]
    links = [
        NodeLink(pki.issue("worker", "ka"), [addr[0], addr[1]], backoff_base_s=0.05, backoff_cap_s=1.0),
        NodeLink(pki.issue("worker", "kb"), [addr[0], addr[2]], backoff_base_s=0.05, backoff_cap_s=1.0),
        NodeLink(pki.issue("worker", "kc"), [addr[1]], backoff_base_s=0.05, backoff_cap_s=1.0),
    ]
    publisher = NodeLink(pki.issue("scheduler", "kp"), [addr[2]], backoff_base_s=0.05)
    for link in [*links, publisher]:
        await link.start()
    try:
        for link in [*links, publisher]:
            await link.wait_connected(10)
        subs = [link.subscribe("t") for link in links]
        await probe_until_received(publisher, subs, timeout=15)
        assert links[0].gateway_address == addr[0] and links[1].gateway_address == addr[0]

        gateways[0].kill()
        killed_at = time.monotonic()
        await probe_until_received(publisher, subs, timeout=FAILOVER_BOUND_S)
        recovered_s = time.monotonic() - killed_at
        assert links[0].gateway_address == addr[1] and links[1].gateway_address == addr[2]
        print(f"failover and first delivery after the kill: {recovered_s:.2f}s")

        for k in range(50):
            await publisher.publish("t", f"m{k}".encode())
        for sub in subs:
            got = []
            async with asyncio.timeout(10):
                while len(got) < 50:
                    payload = (await sub.get()).payload
                    if payload != b"probe":  # a probe still in flight from the failover check
                        got.append(payload)
            assert got == [f"m{k}".encode() for k in range(50)]
    finally:
        for link in [*links, publisher]:
            await link.stop()
