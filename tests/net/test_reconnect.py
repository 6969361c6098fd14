"""A peer back after an outage is reached again within the capped reconnect backoff.

gRPC's default backoff grows to 120 s: a channel to a node that was down for
12 s retried at about 9 s and 16 s, so it found the node 4 s after it was back
(measured before ``grpc_options`` capped it at 2 s).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from hypha.net.options import MAX_RECONNECT_BACKOFF_MS, grpc_options

pytestmark = pytest.mark.timeout(60)

OUTAGE_S = 12.0


def _echo_server(port: int) -> tuple[grpc.aio.Server, int]:
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(_say)}
    )
    server = grpc.aio.server(options=grpc_options())
    server.add_generic_rpc_handlers((handler,))
    return server, server.add_insecure_port(f"127.0.0.1:{port}")


async def _say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def test_a_peer_back_after_an_outage_is_reached_within_the_capped_backoff() -> None:
    server, port = _echo_server(0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_options())
    say = channel.unary_unary("/test.Echo/Say")
    try:
        assert await say(b"hi", timeout=5) == b"hi"
        await server.stop(None)
        down = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError):  # the channel notices and starts backing off
            await say(b"hi", timeout=1)

        # The outage: the channel keeps retrying meanwhile, its backoff growing.
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
        server, _ = _echo_server(port)
        await server.start()
        back = time.monotonic()
        answer = await say(b"again", timeout=30, wait_for_ready=True)
        reached_after = time.monotonic() - back

        assert answer == b"again"
        assert reached_after < MAX_RECONNECT_BACKOFF_MS / 1000 * 1.2 + 0.5, reached_after
    finally:
        await channel.close()
        await server.stop(None)
