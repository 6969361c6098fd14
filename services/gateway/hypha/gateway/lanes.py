"""Per-receiver lanes for the direct messages a federation link carries.

A federation link multiplexes every direct message between two gateways.
Delivering one waits for room in its receiver's queue (up to
``gateway.direct_timeout_s``), and the link used to wait in line: one full
receiver stalled all the link's other traffic (presence, topics, messages to
other peers). Now each receiver gets a lane: the link's reader hands a
direct message to its receiver's lane and reads on; the lane delivers its
messages in order, waiting for that receiver only. A lane holds at most
``gateway.queue_size`` messages; beyond that the message is bounced to its
sender at once (``PEER_UNKNOWN``, "busy"), as a timed-out delivery is.
A lane with nothing left to deliver ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from hypha.gateway.frames import RawForward
from hypha.v1 import gateway_pb2

if TYPE_CHECKING:
    from hypha.gateway.hub import Hub, Link

#: A direct message as the link's reader parsed it (``frames``: the payload as a view).
Direct = gateway_pb2.Forward | RawForward

log = logging.getLogger(__name__)


class DirectLanes:
    """The lanes of one federation link, one per receiver with messages in flight."""

    def __init__(self, hub: Hub, link: Link, max_parked: int) -> None:
        self.hub = hub
        self.link = link
        self.max_parked = max_parked
        self._lanes: dict[str, tuple[asyncio.Queue[Direct], asyncio.Task[None]]] = {}
        #: Direct messages bounced because their receiver's lane was full.
        self.overflowed = 0

    def parked(self, to_peer: str) -> int | None:
        """Messages waiting in ``to_peer``'s lane behind the one being delivered (None: no lane)."""
        lane = self._lanes.get(to_peer)
        return None if lane is None else lane[0].qsize()

    def submit(self, message: Direct) -> None:
        """Queue a direct message on its receiver's lane; never waits."""
        forward = message.forward if isinstance(message, RawForward) else message
        lane = self._lanes.get(forward.to_peer)
        if lane is None:
            queue: asyncio.Queue[Direct] = asyncio.Queue(self.max_parked)
            task = asyncio.create_task(self._drain(forward.to_peer, queue), name=f"lane-{forward.to_peer}")
            lane = self._lanes[forward.to_peer] = (queue, task)
        try:
            lane[0].put_nowait(message)
        except asyncio.QueueFull:
            self.overflowed += 1
            self._bounce(forward)

    def close(self) -> None:
        """Drop what the lanes still hold (the link is gone); never waits, so a link's
        generator can call it while it is being closed."""
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for _, task in lanes:
            task.cancel()

    async def _drain(self, to_peer: str, queue: asyncio.Queue[Direct]) -> None:
        try:
            while not queue.empty():
                forward = queue.get_nowait()
                try:
                    await self.hub.on_forward(self.link, forward)
                except Exception:
                    log.exception("delivering a direct message to %s failed", to_peer)
        finally:
            # NOTE: the check and the removal run with no await between them, so a message
            # submitted meanwhile either found this lane's queue non-empty or finds no lane.
            entry = self._lanes.get(to_peer)
            if entry is not None and entry[0] is queue:
                del self._lanes[to_peer]

    def _bounce(self, forward: gateway_pb2.Forward) -> None:
        delivery = forward.delivery
        log.info(
            "lane to %s on link %s is full: bounced a direct message", forward.to_peer, self.link.gateway_id
        )
        error = gateway_pb2.GatewayError(
            code=gateway_pb2.ERROR_CODE_PEER_UNKNOWN,
            message=f"{forward.to_peer} is busy",
            message_id=delivery.message_id.removeprefix(f"{delivery.from_peer}/"),
        )
        self.hub.on_bounce(self.link, gateway_pb2.Bounce(to_peer=delivery.from_peer, error=error))


__all__ = ["DirectLanes"]
