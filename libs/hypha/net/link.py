"""A node's link to the gateway mesh: pub/sub and direct messages.

Every role keeps one ``Gateway.Connect`` stream open through a ``NodeLink``.
It connects to the first gateway of its list that answers; when the stream
breaks it moves to the next with jittered exponential backoff, re-subscribes
to its topics and carries on. Frames written while no gateway is reachable
wait in a bounded queue (``publish``/``send`` slow down when it is full).

Incoming topic messages go to each matching ``Subscription`` (bounded: a
subscriber that does not keep up loses its oldest-undelivered messages, and
the loss is counted); direct messages go to the one consumer of their
channel and are never dropped on this side (the reader waits for room).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import grpc

from hypha.errors import HyphaError, UnavailableError
from hypha.net.backoff import Backoff
from hypha.net.channel import secure_channel
from hypha.net.messages import Message
from hypha.net.tls import TlsMaterial
from hypha.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


class Subscription:
    """Messages of one topic (or direct channel), as an async iterator."""

    def __init__(self, link: NodeLink, key: str, direct: bool, maxsize: int) -> None:
        self._link = link
        self.key = key
        self.direct = direct
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue(maxsize)
        self.dropped = 0
        self.closed = False

    def _offer(self, message: Message) -> None:
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.dropped += 1

    async def get(self, timeout: float | None = None) -> Message:
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if item is None:
            raise StopAsyncIteration
        return item

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._link._forget(self)
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)


class NodeLink:
    def __init__(
        self,
        tls: TlsMaterial,
        gateways: list[str],
        *,
        name: str = "",
        addresses: list[str] | None = None,
        queue_size: int = 1024,
        backoff_base_s: float = 0.1,
        backoff_cap_s: float = 5.0,
        send_timeout_s: float = 30.0,
        max_message_bytes: int = 2 * 1024 * 1024,
    ) -> None:
        if not gateways:
            raise ValueError("a node link needs at least one gateway address")
        self.tls = tls
        self.gateways = list(gateways)
        self.name = name
        self.addresses = list(addresses or [])
        self.send_timeout_s = send_timeout_s
        self.max_message_bytes = max_message_bytes
        self.connected = asyncio.Event()
        self.gateway_id = ""
        self.gateway_address = ""
        self.errors: list[gateway_pb2.GatewayError] = []
        self.reconnects = 0
        self._outbound: asyncio.Queue[gateway_pb2.ClientFrame] = asyncio.Queue(queue_size)
        self._pending: gateway_pb2.ClientFrame | None = None
        self._topics: dict[str, list[Subscription]] = {}
        self._channels: dict[str, Subscription] = {}
        self._backoff = Backoff(backoff_base_s, backoff_cap_s)
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:12]
        #: Called (synchronously) whenever an established gateway stream breaks,
        #: e.g. so the relay can fail calls in flight instead of letting them hang.
        self.on_disconnect: list[Callable[[], None]] = []

    @property
    def peer_id(self) -> str:
        return self.tls.identity.peer_id

    # ---- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("link already started")
        self._task = asyncio.create_task(self._run(), name=f"link {self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.connected.clear()
        for sub in [*(s for subs in self._topics.values() for s in subs), *self._channels.values()]:
            sub.close()

    async def wait_connected(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.connected.wait(), timeout)
        except TimeoutError as err:
            raise UnavailableError(f"no gateway reachable among {self.gateways}") from err

    async def __aenter__(self) -> NodeLink:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ---- API -------------------------------------------------------------------

    def next_message_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def publish(self, topic: str, payload: bytes, message_id: str | None = None) -> str:
        message_id = message_id or self.next_message_id()
        await self._enqueue(
            gateway_pb2.ClientFrame(
                publish=gateway_pb2.Publish(topic=topic, payload=payload, message_id=message_id)
            )
        )
        return message_id

    async def send(self, to_peer: str, payload: bytes, channel: str) -> str:
        message_id = self.next_message_id()
        await self._enqueue(
            gateway_pb2.ClientFrame(
                send=gateway_pb2.Send(
                    to_peer=to_peer, payload=payload, channel=channel, message_id=message_id
                )
            )
        )
        return message_id

    def subscribe(self, topic: str, maxsize: int = 1024) -> Subscription:
        sub = Subscription(self, topic, direct=False, maxsize=maxsize)
        first = topic not in self._topics
        self._topics.setdefault(topic, []).append(sub)
        if first and self._task is not None:
            # Always queue it (a session being set up may already have sent its
            # topic list); a repeated subscribe is harmless at the gateway.
            self._enqueue_nowait(gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic=topic)))
        return sub

    def direct(self, channel: str, maxsize: int = 256) -> Subscription:
        if channel in self._channels and not self._channels[channel].closed:
            raise ValueError(f"direct channel {channel!r} already has a consumer")
        sub = Subscription(self, channel, direct=True, maxsize=maxsize)
        self._channels[channel] = sub
        return sub

    def _forget(self, sub: Subscription) -> None:
        if sub.direct:
            if self._channels.get(sub.key) is sub:
                del self._channels[sub.key]
            return
        subs = self._topics.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs and sub.key in self._topics:
            del self._topics[sub.key]
            if self.connected.is_set():
                self._enqueue_nowait(
                    gateway_pb2.ClientFrame(unsubscribe=gateway_pb2.Unsubscribe(topic=sub.key))
                )

    async def _enqueue(self, frame: gateway_pb2.ClientFrame) -> None:
        if self._task is None:
            raise UnavailableError("link not started")
        try:
            await asyncio.wait_for(self._outbound.put(frame), self.send_timeout_s)
        except TimeoutError as err:
            raise UnavailableError("gateway link congested or down") from err

    def _enqueue_nowait(self, frame: gateway_pb2.ClientFrame) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._outbound.put_nowait(frame)

    # ---- connection loop -----------------------------------------------------

    async def _run(self) -> None:
        for index in itertools.count():
            address = self.gateways[index % len(self.gateways)]
            try:
                await self._session(address)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as err:
                log.info("gateway %s: %s %s", address, err.code().name, (err.details() or "")[:200])
            except Exception:
                log.exception("gateway link to %s failed", address)
            if self.connected.is_set():
                self.connected.clear()
                self.reconnects += 1
            await asyncio.sleep(self._backoff.next_delay())

    async def _session(self, address: str) -> None:
        async with secure_channel(self.tls, address, max_message_bytes=self.max_message_bytes) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Connect()
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
                raise UnavailableError(f"gateway {address} did not welcome us")
            await call.write(
                gateway_pb2.ClientFrame(hello=gateway_pb2.Hello(addresses=self.addresses, name=self.name))
            )
            for topic in list(self._topics):
                await call.write(gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic=topic)))
            self.gateway_id = first.welcome.gateway_id
            self.gateway_address = address
            self._backoff.reset()
            self.connected.set()
            log.info("attached to gateway %s (%s)", address, self.gateway_id)
            reader = asyncio.create_task(self._read(call))
            writer = asyncio.create_task(self._write(call))
            try:
                done, _ = await asyncio.wait([reader, writer], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            finally:
                self.connected.clear()
                for callback in self.on_disconnect:
                    try:
                        callback()
                    except Exception:
                        log.exception("disconnect callback failed")
                for task in (reader, writer):
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                call.cancel()

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            if self._pending is None:
                self._pending = await self._outbound.get()
            await call.write(self._pending)
            self._pending = None

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                raise UnavailableError("gateway closed the stream")
            kind = frame.WhichOneof("kind")
            if kind == "delivery":
                try:
                    message = Message.from_proto(frame.delivery)
                except HyphaError as err:
                    log.warning("dropping a delivery from %s: %s", frame.delivery.from_peer, err.message)
                    continue
                await self._dispatch(message)
            elif kind == "error":
                log.warning(
                    "gateway error %s: %s", gateway_pb2.ErrorCode.Name(frame.error.code), frame.error.message
                )
                self.errors.append(frame.error)
                del self.errors[:-100]

    async def _dispatch(self, message: Message) -> None:
        if message.direct:
            sub = self._channels.get(message.topic)
            if sub is None:
                log.debug("no consumer for direct channel %s; dropped", message.topic)
                return
            await sub.queue.put(message)
            return
        for sub in list(self._topics.get(message.topic, ())):
            sub._offer(message)
