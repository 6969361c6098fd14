"""Provider lookup latency in a 50-node DHT with 10% of the nodes dead, beside one raw UDP round trip.

Run from the repository root: ``python benchmarks/dht.py [--quick]``. All nodes
run in this process on 127.0.0.1 (one event loop, so a lookup's latency also
pays for the answering nodes' work). Each dataset has three providers whose
signed records were announced before the dead nodes were stopped; every
lookup verifies every record it receives. The baseline is one request/response
over a bare asyncio UDP socket on loopback, measured in the same run; a single
kademlia ``ping`` RPC is reported beside it. The last stdout line is one JSON
object (ARCHITECTURE §11).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypha.dht import DhtNode, RecordVerifier
from hypha.dht.records import ProviderRecord, sign_record
from hypha.pki import certs
from hypha.pki.identity import peer_id_of

NODES = 50
DEAD_FRACTION = 0.10
PROVIDERS_PER_DATASET = 3
DATASETS = 4
RPC_TIMEOUT_S = 2.0
LOOKUP_TIMEOUT_S = 5.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transport.sendto(data, addr)


class _Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future[bytes] | None = None

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(data)


async def udp_round_trips(count: int) -> list[float]:
    """Seconds per request/response over bare asyncio UDP sockets on loopback (64-byte payload)."""
    loop = asyncio.get_running_loop()
    server, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    target = server.get_extra_info("sockname")
    client, proto = await loop.create_datagram_endpoint(_Client, local_addr=("127.0.0.1", 0))
    payload = b"x" * 64
    samples = []
    try:
        for _ in range(count):
            proto.waiter = loop.create_future()
            started = time.perf_counter()
            client.sendto(payload, target)
            await asyncio.wait_for(proto.waiter, 1.0)
            samples.append(time.perf_counter() - started)
    finally:
        client.close()
        server.close()
    return samples


async def lookup_latencies(
    nodes: list[DhtNode], datasets: list[str], count: int, rng: random.Random
) -> tuple[list[float], int]:
    """Seconds per find_providers (random node, random dataset) and how many found every provider."""
    latencies: list[float] = []
    complete = 0
    for _ in range(count):
        node, dataset = rng.choice(nodes), rng.choice(datasets)
        started = time.perf_counter()
        found = await node.find_providers(dataset, timeout_s=LOOKUP_TIMEOUT_S)
        latencies.append(time.perf_counter() - started)
        complete += len(found) == PROVIDERS_PER_DATASET
    return latencies, complete


async def ping_rpcs(nodes: list[DhtNode], count: int, rng: random.Random) -> list[float]:
    samples = []
    for _ in range(count):
        a, b = rng.sample(nodes, 2)
        started = time.perf_counter()
        ok, _ = await a.protocol.ping((b.host, b.port), a.node_id)
        samples.append(time.perf_counter() - started)
        assert ok, "a live node did not answer ping"
    return samples


def build_pki(base: Path, count: int) -> tuple[list[Any], list[tuple[Any, list[Any]]]]:
    root_cert, root_key = certs.make_root(base)
    org_cert, org_key = certs.make_org(root_cert, root_key, "bench", base)
    identities = []
    for i in range(count):
        cert, key, _ = certs.make_node(org_cert, org_key, "data", f"data-{i}", base)
        identities.append((certs.load_private_key(key), certs.load_cert_chain(cert)))
    return certs.load_cert_chain(root_cert), identities


async def run(quick: bool) -> dict[str, Any]:
    rng = random.Random(7)
    random.seed(7)  # kademlia draws node ids from the global generator
    lookups = 40 if quick else 300
    round_trips = 500 if quick else 5000

    with tempfile.TemporaryDirectory() as tmp:
        trusted, identities = build_pki(Path(tmp), PROVIDERS_PER_DATASET * DATASETS)
    verifier = RecordVerifier(trusted)

    nodes: list[DhtNode] = []
    try:
        started = time.perf_counter()
        nodes.append(await DhtNode.create(verifier=verifier, rpc_timeout_s=RPC_TIMEOUT_S))
        for _ in range(NODES - 1):
            seed = rng.choice(nodes)
            nodes.append(
                await DhtNode.create(bootstrap=[seed.address], verifier=verifier, rpc_timeout_s=RPC_TIMEOUT_S)
            )
        join_s = time.perf_counter() - started

        datasets = [f"dataset-{d}" for d in range(DATASETS)]
        for index, (key, chain) in enumerate(identities):
            dataset = datasets[index % DATASETS]
            record = ProviderRecord.issue(
                dataset,
                peer_id_of(chain[0]),
                [f"10.0.0.{index}:7000"],
                64,
                seq=1,
                now=time.time(),
                lifetime_s=3600,
            )
            await rng.choice(nodes).announce(sign_record(record, key, chain))

        healthy = await lookup_latencies(nodes, datasets, lookups // 2, rng)

        dead = rng.sample(nodes, round(NODES * DEAD_FRACTION))
        for node in dead:
            await node.stop()
        live = [n for n in nodes if n not in dead]

        udp = await udp_round_trips(round_trips)
        pings = await ping_rpcs(live, round_trips // 5, rng)

        latencies, complete = await lookup_latencies(live, datasets, lookups, rng)
    finally:
        for node in nodes:
            await node.stop()

    lookup_p50 = statistics.median(latencies) * 1000
    udp_p50 = statistics.median(udp) * 1000
    return {
        "name": "dht",
        "figure": round(lookup_p50, 3),
        "unit": "ms",
        "description": "provider lookup latency p50 (50 nodes, 10% dead) beside a raw UDP round trip p50",
        "baseline": round(udp_p50, 4),
        "ratio": round(lookup_p50 / udp_p50, 1),
        "lookup_p50_ms": round(lookup_p50, 3),
        "lookup_p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "lookup_max_ms": round(max(latencies) * 1000, 3),
        "lookup_p50_ms_no_dead": round(statistics.median(healthy[0]) * 1000, 3),
        "udp_rtt_p50_ms": round(udp_p50, 4),
        "ping_rpc_p50_ms": round(statistics.median(pings) * 1000, 4),
        "lookups": lookups,
        "lookups_finding_all_providers": complete,
        "nodes": NODES,
        "dead_nodes": len(dead),
        "rpc_timeout_s": RPC_TIMEOUT_S,
        "stall_s_median": round(statistics.median(n.current_stall_s() for n in live), 4),
        "join_s": round(join_s, 3),
        "quick": quick,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute on 2 cores)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    result = asyncio.run(run(args.quick))
    print(
        f"lookup p50 {result['lookup_p50_ms']} ms, p99 {result['lookup_p99_ms']} ms; "
        f"UDP round trip p50 {result['udp_rtt_p50_ms']} ms; ping RPC p50 {result['ping_rpc_p50_ms']} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
