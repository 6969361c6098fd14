"""Pub/sub fan-out latency: one publish to 100 subscribers spread over 3
federated gateways, beside a plain unary mTLS gRPC call on loopback.

    python benchmarks/pubsub.py [--quick]

figure = median over rounds of the time until the LAST subscriber has the
message (p50); the JSON also carries p99 and per-delivery medians.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from _common import median, percentile, report, temp_pki


async def main(quick: bool) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hypha.net.channel import secure_channel
    from tests.gateway.conftest import Mesh, until

    subscribers = 100
    rounds = 30 if quick else 200
    pki = temp_pki()
    mesh = Mesh(pki)
    try:
        gateways = await mesh.full_mesh(3)
        publisher = await mesh.add_link("scheduler", "bench-pub", [gateways[0].address])
        links = await asyncio.gather(
            *[mesh.add_link("worker", f"bench-sub{i}", [gateways[i % 3].address]) for i in range(subscribers)]
        )
        subs = [link.subscribe("bench") for link in links]
        await until(
            lambda: sum(len(g.hub.topics.get("bench", ())) for g in gateways) == subscribers,
            "subscribed",
            timeout=30,
        )

        async def one_round(k: int) -> tuple[float, list[float]]:
            start = time.perf_counter()
            await publisher.publish("bench", k.to_bytes(4, "big"))
            times = await asyncio.gather(*[_arrival(sub, start) for sub in subs])
            return max(times), list(times)

        for k in range(5):  # warm up
            await one_round(k)
        last: list[float] = []
        each: list[float] = []
        for k in range(rounds):
            slowest, times = await one_round(1000 + k)
            last.append(slowest)
            each.extend(times)

        async with secure_channel(pki.tls("client"), gateways[0].address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest())
            unary: list[float] = []
            for _ in range(rounds * 5):
                t0 = time.perf_counter()
                await stub.Check(health_pb2.HealthCheckRequest())
                unary.append(time.perf_counter() - t0)
    finally:
        await mesh.close()
    p50 = median(last) * 1000
    base = median(unary) * 1000
    report(
        "pubsub",
        p50,
        "ms",
        base,
        p50 / base,
        fanout_p50_ms=round(p50, 3),
        fanout_p99_ms=round(percentile(last, 99) * 1000, 3),
        delivery_p50_ms=round(median(each) * 1000, 3),
        unary_p50_ms=round(base, 3),
        unary_p99_ms=round(percentile(unary, 99) * 1000, 3),
        subscribers=subscribers,
        gateways=3,
        rounds=rounds,
    )


async def _arrival(sub, start: float) -> float:  # type: ignore[no-untyped-def]
    await sub.get(timeout=30)
    return time.perf_counter() - start


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parser.parse_args().quick))
