"""Outgoing federation links to the configured peer gateways, kept up with
jittered exponential backoff."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from hypha.gateway.config import GatewaySection
from hypha.gateway.hub import Hub
from hypha.gateway.servicer import serve_link
from hypha.gateway.streams import frames_of
from hypha.net.backoff import Backoff
from hypha.net.channel import secure_channel
from hypha.net.tls import TlsMaterial
from hypha.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


class Federation:
    def __init__(self, hub: Hub, tls: TlsMaterial, config: GatewaySection, max_message_bytes: int) -> None:
        self.hub = hub
        self.tls = tls
        self.config = config
        self.max_message_bytes = max_message_bytes
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for address in self.config.peers:
            self._tasks.append(asyncio.create_task(self._keep_link(address), name=f"federate {address}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _keep_link(self, address: str) -> None:
        backoff = Backoff(self.config.reconnect_base_s, self.config.reconnect_cap_s)
        while True:
            try:
                if await self._link_once(address):
                    backoff.reset()
            except grpc.aio.AioRpcError as err:
                log.debug("federation link to %s failed: %s", address, err.code().name)
            except Exception:
                log.exception("federation link to %s failed", address)
            await asyncio.sleep(backoff.next_delay())

    async def _link_once(self, address: str) -> bool:
        async with secure_channel(self.tls, address, max_message_bytes=self.max_message_bytes) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Federate()
            await call.write(gateway_pb2.FederationFrame(presence=self.hub.full_presence()))
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "presence":
                return False
            remote_id = first.presence.gateway_id
            if remote_id == self.hub.gateway_id:
                log.warning("federation peer %s is this gateway; not linking", address)
                await asyncio.Event().wait()  # keep the task parked; never link to self
            async for out in serve_link(self.hub, self.config, remote_id, first, frames_of(call)):
                await call.write(out)
            return True
