"""Outgoing federation links to the configured peer gateways, kept up with
jittered exponential backoff.

The peer gateway's id comes from its TLS certificate (``check_server``: a
gateway, not revoked), never from the presence it sends: a peer that claims
another gateway's id is refused, so it cannot take over that gateway's routes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from hypha.errors import HyphaError
from hypha.gateway.config import GatewaySection
from hypha.gateway.frames import federation_frame
from hypha.gateway.hub import FederationOut, Hub
from hypha.gateway.servicer import FEDERATE_METHOD, serve_link
from hypha.gateway.streams import frames_of
from hypha.net.backoff import Backoff
from hypha.net.channel import check_server, secure_channel
from hypha.net.tls import TlsMaterial
from hypha.net.wire import frame_bytes
from hypha.pki.identity import Role
from hypha.service import BackgroundTasks, Service
from hypha.v1 import gateway_pb2

log = logging.getLogger(__name__)

#: Longest the TLS handshake that learns a peer gateway's identity may take.
HANDSHAKE_TIMEOUT_S = 5.0


class Federation(Service):
    def __init__(self, hub: Hub, tls: TlsMaterial, config: GatewaySection, max_message_bytes: int) -> None:
        self.hub = hub
        self.tls = tls
        self.config = config
        self.max_message_bytes = max_message_bytes
        self._tasks = BackgroundTasks(log)

    async def start(self) -> None:
        for address in self.config.peers:
            self._tasks.spawn(self._keep_link(address), f"federate {address}")

    async def stop(self) -> None:
        await self._tasks.cancel()

    async def _keep_link(self, address: str) -> None:
        backoff = Backoff(self.config.reconnect_base_s, self.config.reconnect_cap_s)
        while True:
            try:
                if await self._link_once(address):
                    backoff.reset()
            except grpc.aio.AioRpcError as err:
                log.debug("federation link to %s failed: %s", address, err.code().name)
            except HyphaError as err:
                log.warning("federation link to %s refused: %s", address, err.message)
            except Exception:
                log.exception("federation link to %s failed", address)
            await asyncio.sleep(backoff.next_delay())

    async def _link_once(self, address: str) -> bool:
        peer = await check_server(
            self.tls, address, roles=frozenset({Role.GATEWAY}), timeout_s=HANDSHAKE_TIMEOUT_S
        )
        if peer.peer_id == self.hub.gateway_id:
            log.warning("federation peer %s is this gateway; not linking", address)
            await asyncio.Event().wait()  # keep the task parked; never link to self
        # The frames we send are the request iterator gRPC consumes, not ``call.write``:
        # see ``hypha.net.link`` (NOTE) for the task that leaked on every broken link.
        answered: asyncio.Future[gateway_pb2.FederationFrame | None] = (
            asyncio.get_running_loop().create_future()
        )

        async def requests() -> AsyncIterator[FederationOut]:
            yield gateway_pb2.FederationFrame(presence=self.hub.full_presence())
            first = await answered
            if first is None:
                return
            async for out in serve_link(self.hub, self.config, peer.peer_id, first, frames_of(call)):
                yield out

        async with secure_channel(self.tls, address, max_message_bytes=self.max_message_bytes) as channel:
            # The generated stub's serializer, except that pre-encoded frames pass through.
            federate = channel.stream_stream(
                FEDERATE_METHOD,
                request_serializer=frame_bytes,
                response_deserializer=federation_frame,
            )
            call = federate(requests())
            try:
                first = await call.read()
                if (
                    not isinstance(first, gateway_pb2.FederationFrame)
                    or first.WhichOneof("kind") != "presence"
                ):
                    return False
                if first.presence.gateway_id != peer.peer_id:
                    log.warning(
                        "federation peer %s is %s but its presence claims %s; not linking",
                        address,
                        peer.peer_id,
                        first.presence.gateway_id,
                    )
                    return False
                answered.set_result(first)
                await call.code()  # the link runs in gRPC's request task until either side ends it
                return True
            finally:
                if not answered.done():
                    answered.set_result(None)
