"""In-memory gateway links: direct messages between nodes of one process.

Each ``FakeLink`` stamps ``from_peer``/``from_role`` like a gateway does, and
delivers into the receiver's bounded per-channel queue (a full queue slows
the sender, as a real link does). ``FakeNetwork.tamper`` rewrites what is
delivered (drop, repeat, reorder) so the relay's robustness can be tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

from google.protobuf.message import DecodeError

from hypha.errors import UnavailableError
from hypha.net.messages import Message
from hypha.pki.identity import Role
from hypha.v1 import gateway_pb2

#: Rewrites one delivery into what actually arrives (possibly nothing, or several).
Tamper = Callable[[Message], list[Message]]


class FakeNetwork:
    def __init__(self, queue_size: int = 16) -> None:
        self.links: dict[str, FakeLink] = {}
        self.queue_size = queue_size
        self.tamper: Tamper | None = None

    def link(self, peer_id: str, role: Role) -> FakeLink:
        link = FakeLink(self, peer_id, role)
        self.links[peer_id] = link
        return link

    async def deliver(self, message: Message, to_peer: str) -> bool:
        """False when no link ``to_peer`` exists (the sender then hears PEER_UNKNOWN)."""
        target = self.links.get(to_peer)
        if target is None:
            return False
        for item in self.tamper(message) if self.tamper else [message]:
            await target.receive(item)
        return True


class _Inbox:
    """What ``direct()`` returns: registered at once, iterated later."""

    def __init__(self, queue: asyncio.Queue[Message | None]) -> None:
        self._queue = queue

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item


class FakeLink:
    def __init__(self, network: FakeNetwork, peer_id: str, role: Role) -> None:
        self._network = network
        self._peer_id = peer_id
        self.role = role
        self.down = False
        self._queues: dict[str, asyncio.Queue[Message | None]] = {}
        #: Every relay frame this link sent: (to_peer, frame).
        self.sent: list[tuple[str, gateway_pb2.RelayFrame]] = []
        #: As ``NodeLink.on_error``: told of each frame "the gateway" could not deliver.
        self.on_error: list[Callable[[gateway_pb2.GatewayError], bool]] = []

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def send(self, to_peer: str, payload: bytes, channel: str, message_id: str | None = None) -> str:
        if self.down:
            raise UnavailableError("gateway link down")
        with contextlib.suppress(DecodeError):
            self.sent.append((to_peer, gateway_pb2.RelayFrame.FromString(payload)))
        message = Message(
            from_peer=self._peer_id,
            from_role=self.role,
            topic=channel,
            payload=payload,
            message_id=message_id or uuid.uuid4().hex,
            direct=True,
        )
        if not await self._network.deliver(message, to_peer):
            # A gateway answers out of band, after the send returned: the same for the fake.
            error = gateway_pb2.GatewayError(
                code=gateway_pb2.ERROR_CODE_PEER_UNKNOWN,
                message=f"cannot deliver to {to_peer}",
                message_id=message.message_id,
            )
            asyncio.get_running_loop().call_soon(self._refused, error)
        return message.message_id

    def _refused(self, error: gateway_pb2.GatewayError) -> None:
        for callback in list(self.on_error):
            callback(error)

    def direct(self, channel: str) -> AsyncIterator[Message]:
        queue: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=self._network.queue_size)
        self._queues[channel] = queue
        return _Inbox(queue)

    async def receive(self, message: Message) -> None:
        queue = self._queues.get(message.topic)
        if queue is not None:
            await queue.put(message)

    async def close(self) -> None:
        """End every ``direct()`` iterator, as a link that shuts down does."""
        for queue in self._queues.values():
            await queue.put(None)
