"""Relayed vs direct transfer of a 64 MiB payload (1 MiB chunks, server stream).

    python benchmarks/relay.py [--quick] [--sweep [--sizes 1,4,16]]

Direct: the worker's own mTLS gRPC server. Relayed: the same call through two
federated gateways (caller on one, worker on the other). figure = relayed
throughput (MiB/s, median), baseline = direct throughput, ratio = relayed/direct.
``--sweep`` runs N such pulls at once (default 1, 4 and 16 concurrent streams,
16 MiB each) over the same relay link and reports the aggregate throughput of
each N against N direct pulls at once (``_common.report_sweep``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from _common import median, report, report_sweep, sizes_arg, temp_pki

SIZE = 64 * 1024 * 1024
SWEEP_SIZE = 16 * 1024 * 1024
CHUNK = 1024 * 1024
SWEEP = [1, 4, 16]


async def measure(streams_list: list[int], size: int, repeats: int) -> list[dict[str, Any]]:
    """Aggregate MiB/s of ``streams`` concurrent pulls of ``size`` bytes, relayed and direct,
    for each count in ``streams_list`` (one mesh for all)."""
    import grpc

    from hypha.memtune import tune_malloc
    from hypha.net.channel import secure_channel
    from hypha.net.relay import Relay
    from hypha.net.server import NodeServer
    from hypha.testing.mesh import Mesh
    from hypha.testing.polling import until
    from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    # As every node and gateway process does (hypha.cli.node); the direct baseline shares the process.
    tune_malloc()
    payload = bytes(CHUNK)

    class Source(worker_pb2_grpc.WorkerServicer):
        async def PullTensors(
            self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[worker_pb2.TensorChunk]:
            for offset in range(0, size, CHUNK):
                yield worker_pb2.TensorChunk(chunk=common_pb2.Chunk(offset=offset, data=payload))

    async def one(stub: worker_pb2_grpc.WorkerStub) -> None:
        total = 0
        async for chunk in stub.PullTensors(worker_pb2.PullTensorsRequest(job_id="bench"), timeout=300):
            total += len(chunk.chunk.data)
        assert total == size

    async def pull(stub: worker_pb2_grpc.WorkerStub, streams: int = 1) -> float:
        start = time.perf_counter()
        await asyncio.gather(*[one(stub) for _ in range(streams)])
        return streams * size / (1024 * 1024) / (time.perf_counter() - start)

    points: list[dict[str, Any]] = []
    pki = temp_pki()
    mesh = Mesh(pki)
    binding = [(worker_pb2_grpc.add_WorkerServicer_to_server, Source(), "hypha.v1.Worker")]
    server = NodeServer(pki.tls("worker"), "127.0.0.1:0", binding)
    await server.start()
    try:
        gateways = await mesh.full_mesh(2)
        source = await mesh.add_link("worker", "bench-source", [gateways[1].address])
        sink = await mesh.add_link("worker", "bench-sink", [gateways[0].address])
        source_relay, sink_relay = Relay(source), Relay(sink)
        source_relay.serve(binding)
        await source_relay.start()
        await sink_relay.start()
        await until(lambda: any(source.peer_id in p for p in gateways[0].hub.remote.values()), "presence")
        relayed_stub = worker_pb2_grpc.WorkerStub(sink_relay.channel(source.peer_id))
        async with secure_channel(pki.tls("worker"), server.address) as channel:
            direct_stub = worker_pb2_grpc.WorkerStub(channel)
            await pull(direct_stub)
            await pull(relayed_stub)
            for streams in streams_list:
                direct = [await pull(direct_stub, streams) for _ in range(repeats)]
                relayed = [await pull(relayed_stub, streams) for _ in range(repeats)]
                ours, base = median(relayed), median(direct)
                points.append(
                    {
                        "streams": streams,
                        "figure": round(ours, 3),
                        "baseline": round(base, 3),
                        "ratio": round(ours / base, 4),
                        "relayed_mib_s": [round(x, 1) for x in relayed],
                        "direct_mib_s": [round(x, 1) for x in direct],
                    }
                )
        await sink_relay.stop()
        await source_relay.stop()
    finally:
        await mesh.close()
        await server.stop(0)
    return points


async def main(quick: bool, sweep: list[int] | None) -> None:
    if sweep:
        points = await measure(sweep, SWEEP_SIZE, 3 if quick else 5)
        report_sweep("relay", "MiB/s", "streams", points, payload_mib=SWEEP_SIZE // (1024 * 1024), gateways=2)
        return
    (point,) = await measure([1], SIZE, 3 if quick else 7)
    report(
        "relay",
        point["figure"],
        "MiB/s",
        point["baseline"],
        point["ratio"],
        relayed_mib_s=point["relayed_mib_s"],
        direct_mib_s=point["direct_mib_s"],
        payload_mib=SIZE // (1024 * 1024),
        gateways=2,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="aggregate throughput at several stream counts")
    parser.add_argument("--sizes", type=sizes_arg, default=SWEEP, help="concurrent stream counts for --sweep")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(args.quick, args.sizes if args.sweep else None))
