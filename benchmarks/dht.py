"""Provider lookup latency of a 20-node DHT: healthy, with 2 nodes killed, with 2 more hung.

Run from the repository root: ``python benchmarks/dht.py [--quick] [--processes] [--uvloop]
[--sweep [--sizes 50,200,500]]``.

Twenty DHT nodes on 127.0.0.1 join through the first (a star bootstrap); four
datasets have three providers each, whose signed records are announced
before any node fails. One reader (itself one of the 20 nodes) then runs
sequential ``find_providers`` lookups in three phases: all nodes alive; two
nodes SIGKILLed (stopped, in-process); two more SIGSTOPped (hung: datagrams
ignored, in-process). Each phase measures the default lookup (which answers
from the provider cache while it is fresh) and the same lookup with the
cache off (``cache_fresh_s=0``: every lookup walks and answers early).
Every lookup verifies every record it returns.

``--processes`` runs each of the 19 other nodes in its own OS process, as
deployments do; the default keeps all nodes in this process (one event loop,
so a lookup also pays for the answering nodes' work). ``--uvloop`` runs every
event loop on uvloop (the ``uvloop`` extra). The baseline is one
request/response over a bare UDP socket on loopback, measured in the same
run. The last stdout line is one JSON object (ARCHITECTURE §11).

``--sweep`` repeats the whole run at each network size (default 50, 200 and
500 nodes, 10 lookups per row) and reports the series (``_common.report_sweep``);
each point's figure is the same "2 dead, cache off" p50.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import median, percentile, report, report_sweep, sizes_arg, temp_pki

from hypha.dht import DhtNode, RecordVerifier
from hypha.dht.records import ProviderRecord, sign_record
from hypha.pki import certs
from hypha.pki.identity import peer_id_of
from hypha.testing.pki import Pki

NODES = 20
KILLED = 2
HUNG = 2
DATASETS = 4
PROVIDERS_PER_DATASET = 3
RPC_TIMEOUT_S = 3.0  # hivemind's default, so a hung peer costs the same there and here unless handled
LOOKUP_TIMEOUT_S = 5.0
SWEEP = [50, 200, 500]


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
    samples = []
    try:
        for _ in range(count):
            proto.waiter = loop.create_future()
            started = time.perf_counter()
            client.sendto(b"x" * 64, target)
            await asyncio.wait_for(proto.waiter, 1.0)
            samples.append(time.perf_counter() - started)
    finally:
        client.close()
        server.close()
    return samples


def _verifier(pki_dir: Path) -> RecordVerifier:
    return RecordVerifier(certs.load_cert_chain(pki_dir / "root-ca-cert.pem"))


async def serve_node(bootstrap: str, pki_dir: Path) -> None:
    """One node of ``--processes`` mode: print its address, then serve until killed."""
    node = await DhtNode.create(
        bootstrap=[bootstrap] if bootstrap else [], verifier=_verifier(pki_dir), rpc_timeout_s=RPC_TIMEOUT_S
    )
    print(node.address, flush=True)
    await asyncio.Event().wait()


class Peers:
    """The 19 nodes besides the reader: in this process, or one OS process each."""

    def __init__(self, pki_dir: Path, processes: bool, use_uvloop: bool) -> None:
        self.pki_dir = pki_dir
        self.processes = processes
        self.use_uvloop = use_uvloop
        self.nodes: list[DhtNode] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []

    async def start(self, count: int) -> None:
        for _ in range(count):
            bootstrap = self.addresses[0] if self.addresses else ""
            if self.processes:
                argv = [sys.executable, __file__, "--serve-node", bootstrap, str(self.pki_dir)]
                proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything is measured)
                    argv + (["--uvloop"] if self.use_uvloop else []), stdout=subprocess.PIPE, text=True
                )
                self.procs.append(proc)
                assert proc.stdout is not None
                line = await asyncio.to_thread(proc.stdout.readline)
                if not line:
                    raise RuntimeError("a DHT node process exited before it listened")
                self.addresses.append(line.strip())
            else:
                node = await DhtNode.create(
                    bootstrap=[bootstrap] if bootstrap else [],
                    verifier=_verifier(self.pki_dir),
                    rpc_timeout_s=RPC_TIMEOUT_S,
                )
                self.nodes.append(node)
                self.addresses.append(node.address)

    async def kill(self, index: int) -> None:
        if self.processes:
            self.procs[index].send_signal(signal.SIGKILL)
            self.procs[index].wait()
        else:
            await self.nodes[index].stop()

    def hang(self, index: int) -> None:
        if self.processes:
            self.procs[index].send_signal(signal.SIGSTOP)
        else:
            # As if SIGSTOPped: datagrams arrive, nothing is read or answered.
            self.nodes[index].protocol.datagram_received = lambda data, address: None  # type: ignore[method-assign]

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        for node in self.nodes:
            await node.stop()


def _announcements(pki: Pki, datasets: list[str]) -> list[bytes]:
    blobs = []
    for index in range(DATASETS * PROVIDERS_PER_DATASET):
        name = f"bench-data-{index}"
        cert, key, _ = certs.make_node(pki.org_cert, pki.org_key, "data", name, pki.dir)
        chain = certs.load_cert_chain(cert)
        record = ProviderRecord.issue(
            datasets[index % DATASETS],
            peer_id_of(chain[0]),
            [f"10.0.0.{index}:7000"],
            64,
            seq=1,
            now=time.time(),
            lifetime_s=3600,
        )
        blobs.append(sign_record(record, certs.load_private_key(key), chain))
    return blobs


async def lookups(
    reader: DhtNode, datasets: list[str], count: int, rng: random.Random, *, cache: bool
) -> dict[str, float]:
    """``count`` sequential lookups of random datasets: latencies, and the share that found every provider."""
    reader.cache_fresh_s = 2.0 if cache else 0.0
    latencies: list[float] = []
    complete = 0
    for _ in range(count):
        dataset = rng.choice(datasets)
        started = time.perf_counter()
        found = await reader.find_providers(dataset, timeout_s=LOOKUP_TIMEOUT_S)
        latencies.append(time.perf_counter() - started)
        complete += len(found) == PROVIDERS_PER_DATASET
        await reader.wait_refreshed()  # lookups are spaced in practice: not timed against the last one's walk
    ms = [s * 1000 for s in latencies]
    return {
        "p50_ms": round(median(ms), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "found_all": round(complete / count, 4),
    }


async def run(
    quick: bool, processes: bool, use_uvloop: bool, nodes: int = NODES, count: int | None = None
) -> dict[str, Any]:
    rng = random.Random(7)
    random.seed(7)  # kademlia draws node ids from the global generator
    count = count or (30 if quick else 100)
    pki = temp_pki()
    datasets = [f"dataset-{d}" for d in range(DATASETS)]
    blobs = _announcements(pki, datasets)
    peers = Peers(pki.dir, processes, use_uvloop)
    reader: DhtNode | None = None
    phases: dict[str, dict[str, dict[str, float]]] = {}
    try:
        started = time.perf_counter()
        await peers.start(nodes - 1)
        reader = await DhtNode.create(
            bootstrap=[peers.addresses[0]], verifier=_verifier(pki.dir), rpc_timeout_s=RPC_TIMEOUT_S
        )
        join_s = time.perf_counter() - started
        for blob in blobs:
            await reader.announce(blob)
        # With 20 nodes and ksize 20 every node stores every record, the reader
        # too, and would answer from its own store: empty it, so lookups walk
        # (with more nodes the reader may hold some: emptied all the same).
        reader.providers._keys.clear()

        async def phase(name: str) -> None:
            phases[name] = {
                "default": await lookups(reader, datasets, count, rng, cache=True),
                "no_cache": await lookups(reader, datasets, count, rng, cache=False),
            }

        await phase("healthy")
        victims = rng.sample(range(1, nodes - 1), KILLED + HUNG)
        for index in victims[:KILLED]:
            await peers.kill(index)
        await phase("killed")
        for index in victims[KILLED:]:
            peers.hang(index)
        await phase("hung")
        udp = await udp_round_trips(500 if quick else 5000)
        stall_ms = reader.current_stall_s() * 1000
    finally:
        if reader is not None:
            await reader.stop()
        await peers.stop()

    udp_p50 = median(udp) * 1000
    figure = phases["killed"]["no_cache"]["p50_ms"]
    return {
        "figure": figure,
        "baseline": udp_p50,
        "ratio": figure / udp_p50,
        "description": "provider lookup p50 with 2 of 20 nodes dead, cache off (every lookup walks), "
        "beside a raw UDP round trip p50",
        "phases": phases,
        "udp_rtt_p50_ms": round(udp_p50, 4),
        "stall_ms": round(stall_ms, 3),
        "nodes": nodes,
        "killed": KILLED,
        "hung": HUNG,
        "lookups_per_row": count,
        "processes": processes,
        "uvloop": use_uvloop,
        "join_s": round(join_s, 3),
        "quick": quick,
    }


def _run(main: Callable[[], Awaitable[Any]], use_uvloop: bool) -> Any:
    if use_uvloop:
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute on 2 cores)")
    parser.add_argument("--processes", action="store_true", help="one OS process per DHT node")
    parser.add_argument("--uvloop", action="store_true", help="run the event loops on uvloop")
    parser.add_argument("--sweep", action="store_true", help="the whole run at several network sizes")
    parser.add_argument("--sizes", type=sizes_arg, default=SWEEP, help="node counts for --sweep")
    parser.add_argument("--serve-node", nargs=2, metavar=("BOOTSTRAP", "PKI_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    if args.serve_node:
        bootstrap, pki_dir = args.serve_node
        _run(lambda: serve_node(bootstrap, Path(pki_dir)), args.uvloop)
        return
    if args.sweep:
        _sweep(args.sizes, args.processes, args.uvloop)
        return
    result = _run(lambda: run(args.quick, args.processes, args.uvloop), args.uvloop)
    for name, rows in result["phases"].items():
        for mode, row in rows.items():
            print(
                f"{name:8} {mode:9} p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms  "
                f"max {row['max_ms']:8.3f} ms  found all {row['found_all']:.0%}",
                file=sys.stderr,
            )
    extra = {k: v for k, v in result.items() if k not in ("figure", "baseline", "ratio")}
    report("dht", result["figure"], "ms", result["baseline"], result["ratio"], **extra)


def _sweep(sizes: list[int], processes: bool, use_uvloop: bool) -> None:
    points = []
    for nodes in sizes:
        result = _run(lambda: run(True, processes, use_uvloop, nodes, count=10), use_uvloop)  # noqa: B023
        print(f"{nodes} nodes: {result['figure']:.3f} ms, join {result['join_s']:.1f} s", file=sys.stderr)
        points.append(
            {
                "nodes": nodes,
                "figure": result["figure"],
                "baseline": round(result["baseline"], 4),
                "ratio": round(result["ratio"], 4),
                "phases": result["phases"],
                "join_s": result["join_s"],
            }
        )
    report_sweep(
        "dht", "ms", "nodes", points, killed=KILLED, hung=HUNG, lookups_per_row=10, processes=processes
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
