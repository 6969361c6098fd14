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

Each session hands gRPC its own request iterator (``_requests``), which ends
when the session does. NOTE: not ``call.write()``: with interceptors that
goes through grpc.aio's proxy generator, consumed by a task gRPC cancels only
on a local cancel. When the stream broke, that task stayed pending until the
garbage collector destroyed it and closed the generator while it still ran
("Task was destroyed but it is pending", ``aclose(): asynchronous generator
is already running``), once per broken session.

Error frames from the gateway (a direct message it cannot deliver, a frame
too large) name the message they answer; the ``on_error`` callbacks see each
one, so the relay ends the call it belongs to at once, not at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from hypha.errors import HyphaError, UnavailableError
from hypha.net.backoff import Backoff
from hypha.net.channel import secure_channel
from hypha.net.messages import Message, RawDelivery, server_frame
from hypha.net.options import DEFAULT_KEEPALIVE_S
from hypha.net.tls import TlsMaterial
from hypha.net.wire import Encoded, frame_bytes
from hypha.service import Service, cancel_and_wait
from hypha.v1 import gateway_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A frame for the gateway: a message, or one already encoded (``send``: hypha.net.wire).
OutFrame = gateway_pb2.ClientFrame | bytes
#: The Connect method of ``hypha.v1.Gateway``.
CONNECT_METHOD = "/hypha.v1.Gateway/Connect"


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


class NodeLink(Service):
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
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        if not gateways:
            raise ValueError("a node link needs at least one gateway address")
        self.tls = tls
        self.gateways = list(gateways)
        self.name = name
        self.addresses = list(addresses or [])
        self.send_timeout_s = send_timeout_s
        self.max_message_bytes = max_message_bytes
        #: HTTP/2 ping interval: how soon a path that went silent (no FIN, no RST) is noticed.
        self.keepalive_s = keepalive_s
        self.connected = asyncio.Event()
        self.gateway_id = ""
        self.gateway_address = ""
        self.errors: list[gateway_pb2.GatewayError] = []
        #: Established gateway streams that broke (each followed by a new attempt).
        self.reconnects = 0
        self._outbound: asyncio.Queue[OutFrame] = asyncio.Queue(queue_size)
        self._pending: OutFrame | None = None
        self._topics: dict[str, list[Subscription]] = {}
        self._channels: dict[str, Subscription] = {}
        self._backoff = Backoff(backoff_base_s, backoff_cap_s)
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:12]
        #: Called (synchronously) whenever an established gateway stream breaks,
        #: e.g. so the relay can fail calls in flight instead of letting them hang.
        self.on_disconnect: list[Callable[[], None]] = []
        #: Called (synchronously) with each error frame from the gateway; a callback returns
        #: True when the error answers a message it sent (e.g. a relayed call's frame).
        self.on_error: list[Callable[[gateway_pb2.GatewayError], bool]] = []

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
        await cancel_and_wait(task)
        self.connected.clear()
        for sub in [*(s for subs in self._topics.values() for s in subs), *self._channels.values()]:
            sub.close()

    async def wait_connected(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.connected.wait(), timeout)
        except TimeoutError as err:
            raise UnavailableError(f"no gateway reachable among {self.gateways}") from err

    # ---- API -------------------------------------------------------------------

    def next_message_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def publish(self, topic: str, payload: bytes, message_id: str | None = None) -> str:
        message_id = message_id or self.next_message_id()
        header = gateway_pb2.Publish(topic=topic, message_id=message_id)
        frame = Encoded.with_field(header, "payload", payload).within(gateway_pb2.ClientFrame(), "publish")
        await self._enqueue(bytes(frame))
        return message_id

    async def send(self, to_peer: str, payload: bytes, channel: str, message_id: str | None = None) -> str:
        """Queue a direct message; a gateway error about it names ``message_id`` (``on_error``)."""
        message_id = message_id or self.next_message_id()
        # Encoded by hand: the payload is copied once, not serialized twice (hypha.net.wire).
        header = gateway_pb2.Send(to_peer=to_peer, channel=channel, message_id=message_id)
        frame = Encoded.with_field(header, "payload", payload).within(gateway_pb2.ClientFrame(), "send")
        await self._enqueue(bytes(frame))
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

    async def _enqueue(self, frame: OutFrame) -> None:
        if self._task is None:
            raise UnavailableError("link not started")
        if not self._outbound.full():
            self._outbound.put_nowait(frame)  # the common case, without wait_for's task and timer
            return
        try:
            await asyncio.wait_for(self._outbound.put(frame), self.send_timeout_s)
        except TimeoutError as err:
            raise UnavailableError("gateway link congested or down") from err

    def _enqueue_nowait(self, frame: OutFrame) -> None:
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
            self.connected.clear()
            await asyncio.sleep(self._backoff.next_delay())

    async def _session(self, address: str) -> None:
        welcomed = asyncio.Event()
        ended = asyncio.Event()
        channel = secure_channel(
            self.tls, address, max_message_bytes=self.max_message_bytes, keepalive_s=self.keepalive_s
        )
        try:
            # The generated stub's serializer, except that pre-encoded frames pass through.
            connect = channel.stream_stream(
                CONNECT_METHOD,
                request_serializer=frame_bytes,
                response_deserializer=server_frame,
            )
            call = connect(self._requests(welcomed, ended))
            first = await call.read()
            if not isinstance(first, gateway_pb2.ServerFrame) or first.WhichOneof("kind") != "welcome":
                raise UnavailableError(f"gateway {address} did not welcome us")
            self.gateway_id = first.welcome.gateway_id
            self.gateway_address = address
            self._backoff.reset()
            welcomed.set()
            self.connected.set()
            log.info("attached to gateway %s (%s)", address, self.gateway_id)
            try:
                await self._read(call)
            finally:
                self.connected.clear()
                self.reconnects += 1
                for callback in self.on_disconnect:
                    try:
                        callback()
                    except Exception:
                        log.exception("disconnect callback failed")
        finally:
            # End the request iterator first: gRPC's task consuming it then finishes on its own.
            ended.set()
            await channel.close()

    async def _requests(self, welcomed: asyncio.Event, ended: asyncio.Event) -> AsyncIterator[OutFrame]:
        """The session's outgoing frames: hello, subscriptions, then the queue, until ``ended``.

        A frame taken from the queue stays ``_pending`` until gRPC has sent it (it
        asks for the next one), so a frame caught in a broken session goes out in
        the next one instead of being lost.
        """
        if not await _unless(ended, welcomed.wait()):
            return
        yield gateway_pb2.ClientFrame(hello=gateway_pb2.Hello(addresses=self.addresses, name=self.name))
        for topic in list(self._topics):
            yield gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic=topic))
        while not ended.is_set():
            if self._pending is None:
                if self._outbound.empty():
                    got = await _unless(ended, self._outbound.get())
                    if got is None:
                        return
                    self._pending = got
                else:
                    self._pending = self._outbound.get_nowait()
            yield self._pending
            self._pending = None

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                raise UnavailableError("gateway closed the stream")
            if isinstance(frame, RawDelivery):
                await self._deliver(frame.delivery, frame.payload)
                continue
            kind = frame.WhichOneof("kind")
            if kind == "delivery":
                await self._deliver(frame.delivery, None)
            elif kind == "error":
                self._on_error(frame.error)

    async def _deliver(self, delivery: gateway_pb2.Delivery, payload: bytes | None) -> None:
        try:
            message = Message.from_proto(delivery, payload)
        except HyphaError as err:
            log.warning("dropping a delivery from %s: %s", delivery.from_peer, err.message)
            return
        await self._dispatch(message)

    def _on_error(self, error: gateway_pb2.GatewayError) -> None:
        self.errors.append(error)
        del self.errors[:-100]
        claimed = False
        for callback in self.on_error:
            try:
                claimed = callback(error) or claimed
            except Exception:
                log.exception("gateway error callback failed")
        log.log(
            logging.INFO if claimed else logging.WARNING,
            "gateway error %s for %s: %s",
            gateway_pb2.ErrorCode.Name(error.code),
            error.message_id or "-",
            error.message,
        )

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


async def _unless(ended: asyncio.Event, awaitable: Awaitable[T]) -> T | None:
    """``awaitable``'s result, or None (it is cancelled) once ``ended`` is set first."""
    if ended.is_set():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        return None
    task = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(ended.wait())
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None
