"""Pub/sub fan-out latency: one publish to 100 subscribers spread over 3
federated gateways, beside a plain unary mTLS gRPC call on loopback.

    python benchmarks/pubsub.py [--quick] [--sweep [--sizes 10,100,1000]]

figure = median over rounds of the time until the LAST subscriber has the
message (p50); the JSON also carries p99 and per-delivery medians.
``--sweep`` measures the fan-out at each size (default 10, 100 and 1,000
subscribers, fewer rounds each) and reports the series (``_common.report_sweep``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

from _common import median, percentile, report, report_sweep, sizes_arg, temp_pki

SWEEP = [10, 100, 1000]


async def measure(subscribers: int, rounds: int) -> dict[str, Any]:
    """Fan-out of one publish to ``subscribers`` links over 3 gateways, and the unary baseline."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hypha.net.channel import secure_channel
    from hypha.testing.mesh import Mesh
    from hypha.testing.polling import until

    pki = temp_pki()
    mesh = Mesh(pki)
    try:
        gateways = await mesh.full_mesh(3)
        publisher = await mesh.add_link("scheduler", "bench-pub", [gateways[0].address])
        links = []
        for first in range(
            0, subscribers, 50
        ):  # 50 at a time: 1,000 handshakes at once outlast the connect bound
            links += await asyncio.gather(
                *[
                    mesh.add_link("worker", f"bench-sub{i}", [gateways[i % 3].address])
                    for i in range(first, min(subscribers, first + 50))
                ]
            )
        subs = [link.subscribe("bench") for link in links]
        await until(
            lambda: sum(len(g.hub.topics.get("bench", ())) for g in gateways) == subscribers,
            "subscribed",
            timeout=30 + subscribers / 10,
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
    return dict(
        subscribers=subscribers,
        figure=round(p50, 3),
        baseline=round(base, 3),
        ratio=round(p50 / base, 4),
        fanout_p50_ms=round(p50, 3),
        fanout_p99_ms=round(percentile(last, 99) * 1000, 3),
        delivery_p50_ms=round(median(each) * 1000, 3),
        unary_p50_ms=round(base, 3),
        unary_p99_ms=round(percentile(unary, 99) * 1000, 3),
        rounds=rounds,
    )


async def main(quick: bool, sweep: list[int] | None) -> None:
    if sweep:
        points = []
        for n in sweep:
            points.append(await measure(n, 10 if quick else 30))
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
        report_sweep("pubsub", "ms", "subscribers", points, gateways=3)
        return
    point = await measure(100, 30 if quick else 200)
    figure, base, ratio = point.pop("figure"), point.pop("baseline"), point.pop("ratio")
    report("pubsub", figure, "ms", base, ratio, gateways=3, **point)


async def _arrival(sub, start: float) -> float:  # type: ignore[no-untyped-def]
    await sub.get(timeout=30)
    return time.perf_counter() - start


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="fan-out at several subscriber counts")
    parser.add_argument("--sizes", type=sizes_arg, default=SWEEP, help="subscriber counts for --sweep")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(args.quick, args.sizes if args.sweep else None))
