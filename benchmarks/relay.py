"""Relayed vs direct transfer of a 64 MiB payload (1 MiB chunks, server stream).

    python benchmarks/relay.py [--quick]

Direct: the worker's own mTLS gRPC server. Relayed: the same call through two
federated gateways (caller on one, worker on the other). figure = relayed
throughput (MiB/s, median), baseline = direct throughput, ratio = relayed/direct.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator

from _common import median, report, temp_pki

SIZE = 64 * 1024 * 1024
CHUNK = 1024 * 1024


async def main(quick: bool) -> None:
    import grpc

    from hypha.net.channel import secure_channel
    from hypha.net.relay import Relay
    from hypha.net.server import NodeServer
    from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from tests.gateway.conftest import Mesh, until

    payload = bytes(CHUNK)

    class Source(worker_pb2_grpc.WorkerServicer):
        async def PullTensors(
            self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[worker_pb2.TensorChunk]:
            for offset in range(0, SIZE, CHUNK):
                yield worker_pb2.TensorChunk(chunk=common_pb2.Chunk(offset=offset, data=payload))

    async def pull(stub: worker_pb2_grpc.WorkerStub) -> float:
        start = time.perf_counter()
        total = 0
        async for chunk in stub.PullTensors(worker_pb2.PullTensorsRequest(job_id="bench"), timeout=300):
            total += len(chunk.chunk.data)
        assert total == SIZE
        return SIZE / (1024 * 1024) / (time.perf_counter() - start)

    repeats = 3 if quick else 7
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
            direct = [await pull(direct_stub) for _ in range(repeats)]
            relayed = [await pull(relayed_stub) for _ in range(repeats)]
        await sink_relay.stop()
        await source_relay.stop()
    finally:
        await mesh.close()
        await server.stop(0)
    ours, base = median(relayed), median(direct)
    report(
        "relay",
        ours,
        "MiB/s",
        base,
        ours / base,
        relayed_mib_s=[round(x, 1) for x in relayed],
        direct_mib_s=[round(x, 1) for x in direct],
        payload_mib=SIZE // (1024 * 1024),
        gateways=2,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parser.parse_args().quick))
