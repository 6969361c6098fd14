"""Calls through the relay: gRPC calls to and from peers that cannot accept
inbound connections, carried as direct messages through the gateways.

``RelayChannel`` duck-types the parts of ``grpc.aio.Channel`` that generated
stubs use, so ``worker_pb2_grpc.WorkerStub(channel)`` works the same over a
direct channel and over the relay, and failures surface as
``grpc.aio.AioRpcError`` with the same status codes either way.

One ``Relay`` per node owns the only consumer of the link's relay channel
and routes each ``RelayFrame``: ``open`` frames start a served call
(``relay_server``), request frames go to the served call they belong to,
response frames go to this node's own call in flight (``relay_client``), and
anything else is counted and dropped.

    relay = Relay(link)
    relay.serve([(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "hypha.v1.Worker")])
    await relay.start()
    stub = worker_pb2_grpc.WorkerStub(relay.channel(peer_id))

Shutdown order (``stop``): refuse new calls, let served calls finish within
the grace period, cancel what is left (callers get UNAVAILABLE), fail this
node's own calls, stop the dispatcher, flush the last status frames.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Generator, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from hypha.net.interceptors import DEFAULT_RECHECK_S
from hypha.net.messages import RELAY_CHANNEL, Message
from hypha.net.relay_client import ClientCall, ClientEndpoint
from hypha.net.relay_context import RelayBinding, RelayServicerContext, relayed_identity
from hypha.net.relay_frames import (
    CLIENT_SIDE,
    MAX_RELAY_MESSAGE_BYTES,
    Deserializer,
    DirectLink,
    RelayLimits,
    Serializer,
    frame_kind,
    parse_frame_message_id,
    passthrough,
    rpc_error,
)
from hypha.net.relay_server import ServerEndpoint
from hypha.pki.crl import RevocationChecker
from hypha.service import BackgroundTasks, Resource, Service
from hypha.v1 import gateway_pb2

log = logging.getLogger(__name__)

__all__ = [
    "MAX_RELAY_MESSAGE_BYTES",
    "DirectLink",
    "Relay",
    "RelayBinding",
    "RelayChannel",
    "RelayLimits",
    "RelayServicerContext",
    "relayed_identity",
]


# ---- what callers hold -------------------------------------------------------


class RelayCall:
    """The call object a relayed multicallable returns (the grpc.aio.Call surface)."""

    def __init__(self, core: ClientCall, deserializer: Deserializer) -> None:
        self._core = core
        self._deserialize = deserializer

    def cancel(self) -> bool:
        return self._core.cancel()

    def cancelled(self) -> bool:
        return self._core.locally_cancelled

    def done(self) -> bool:
        return self._core.status is not None

    def time_remaining(self) -> float | None:
        return self._core.time_remaining()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._core.add_done_callback(lambda: callback(self))

    async def code(self) -> grpc.StatusCode:
        return (await self._core.wait_done())[0]

    async def details(self) -> str:
        return (await self._core.wait_done())[1]

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        await self._core.wait_done()
        return grpc.aio.Metadata()

    async def wait_for_connection(self) -> None:
        return None

    async def write(self, request: Any) -> None:
        """Send one more request (stream-request calls made without an iterator)."""
        await self._core.write_from_caller(request)

    async def done_writing(self) -> None:
        await self._core.done_writing()


class RelayUnaryResponseCall(RelayCall):
    """Awaitable like grpc.aio's UnaryUnaryCall and StreamUnaryCall."""

    def __init__(self, core: ClientCall, deserializer: Deserializer) -> None:
        super().__init__(core, deserializer)
        self._result = asyncio.get_running_loop().create_task(self._response(), name=f"relay {core.method}")
        # Retrieve the outcome even when nobody awaits the call (no "never retrieved" noise).
        self._result.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _response(self) -> Any:
        data = await self._core.read()
        if data is None:
            raise rpc_error(grpc.StatusCode.INTERNAL, "relayed call ended without a response")
        if await self._core.read() is not None:
            self._core.fail(grpc.StatusCode.INTERNAL, "relayed unary call got a second response")
            raise rpc_error(grpc.StatusCode.INTERNAL, "relayed unary call got a second response")
        try:
            return self._deserialize(data)
        except Exception as err:
            raise rpc_error(grpc.StatusCode.INTERNAL, "Exception deserializing response!") from err

    def __await__(self) -> Generator[Any, None, Any]:
        return self._result.__await__()


class RelayStreamResponseCall(RelayCall):
    """Async-iterable like grpc.aio's UnaryStreamCall and StreamStreamCall."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            while (data := await self._core.read()) is not None:
                yield self._decode(data)
        finally:
            # A consumer that stops early (break) must not leave the server streaming into a full inbox.
            self._core.cancel()

    async def read(self) -> Any:
        data = await self._core.read()
        return grpc.aio.EOF if data is None else self._decode(data)

    def _decode(self, data: bytes) -> Any:
        try:
            return self._deserialize(data)
        except Exception as err:
            self._core.fail(grpc.StatusCode.INTERNAL, "Exception deserializing response!")
            raise rpc_error(grpc.StatusCode.INTERNAL, "Exception deserializing response!") from err


class RelayMultiCallable:
    """What ``channel.unary_unary(...)`` and friends return; calling it starts a call."""

    def __init__(
        self,
        channel: RelayChannel,
        method: str,
        serializer: Serializer | None,
        deserializer: Deserializer | None,
        *,
        request_streaming: bool,
        response_streaming: bool,
    ) -> None:
        self._channel = channel
        self._method = method
        self._serialize = serializer or passthrough
        self._deserialize = deserializer or passthrough
        self._request_streaming = request_streaming
        self._response_streaming = response_streaming

    def __call__(
        self,
        request: Any = None,
        *,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> RelayCall:
        # NOTE: metadata has no place in RelayFrame; relayed calls carry none.
        core = self._channel._new_call(self._method, self._serialize, timeout)
        if not self._request_streaming:
            core.begin(request=request)
        else:
            core.begin(requests=request)
        if self._response_streaming:
            return RelayStreamResponseCall(core, self._deserialize)
        return RelayUnaryResponseCall(core, self._deserialize)


class RelayChannel(Resource):
    """A ``grpc.aio.Channel`` look-alike whose calls travel through the gateways to one peer."""

    def __init__(self, endpoint: ClientEndpoint, target: str, default_timeout_s: float | None = None) -> None:
        self._endpoint = endpoint
        self.target = target
        self._default_timeout_s = default_timeout_s
        self._calls: set[ClientCall] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _new_call(self, method: str, serializer: Serializer, timeout: float | None) -> ClientCall:
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        core = ClientCall(
            self._endpoint,
            self.target,
            method,
            serializer,
            self._default_timeout_s if timeout is None else timeout,
        )
        self._calls.add(core)
        core.add_done_callback(lambda: self._calls.discard(core))
        return core

    def _multicallable(
        self,
        method: str,
        serializer: Serializer | None,
        deserializer: Deserializer | None,
        request_streaming: bool,
        response_streaming: bool,
    ) -> RelayMultiCallable:
        return RelayMultiCallable(
            self,
            method,
            serializer,
            deserializer,
            request_streaming=request_streaming,
            response_streaming=response_streaming,
        )

    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer | None = None,
        response_deserializer: Deserializer | None = None,
        _registered_method: bool | None = False,
    ) -> RelayMultiCallable:
        return self._multicallable(method, request_serializer, response_deserializer, False, False)

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer | None = None,
        response_deserializer: Deserializer | None = None,
        _registered_method: bool | None = False,
    ) -> RelayMultiCallable:
        return self._multicallable(method, request_serializer, response_deserializer, False, True)

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer | None = None,
        response_deserializer: Deserializer | None = None,
        _registered_method: bool | None = False,
    ) -> RelayMultiCallable:
        return self._multicallable(method, request_serializer, response_deserializer, True, False)

    def stream_stream(
        self,
        method: str,
        request_serializer: Serializer | None = None,
        response_deserializer: Deserializer | None = None,
        _registered_method: bool | None = False,
    ) -> RelayMultiCallable:
        return self._multicallable(method, request_serializer, response_deserializer, True, True)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.SHUTDOWN if self._closed else grpc.ChannelConnectivity.READY

    async def channel_ready(self) -> None:
        """Always ready: reachability is the gateway link's business, failures come per call."""
        return None

    async def close(self, grace: float | None = None) -> None:
        """Cancel this channel's calls (after ``grace`` seconds, if given) and refuse new ones."""
        self._closed = True
        if grace and self._calls:
            await asyncio.wait(
                [asyncio.ensure_future(call.wait_done()) for call in self._calls], timeout=grace
            )
        for call in list(self._calls):
            call.cancel()


class Relay(Service):
    """A node's relay: serves its servicers to relayed callers, and makes relayed calls."""

    def __init__(
        self,
        link: DirectLink,
        *,
        limits: RelayLimits | None = None,
        default_timeout_s: float | None = None,
        grace_s: float = 2.0,
        revocation: RevocationChecker | None = None,
        revocation_recheck_s: float = DEFAULT_RECHECK_S,
    ) -> None:
        """``revocation``: the node's CRL checker, asked about every relayed caller's certificate
        (as the gateway stamped it) when a call opens and, every ``revocation_recheck_s`` while it
        stays open, after the CRL changed; None only where no CRL applies (in-memory test links)."""
        self.limits = limits or RelayLimits()
        #: Deadline for relayed calls made without a timeout: without TCP keepalive
        #: nothing else notices a peer that vanished mid-call. None keeps calls open.
        self.default_timeout_s = default_timeout_s
        self.grace_s = grace_s
        self._link = link
        self._background = BackgroundTasks()
        self.client = ClientEndpoint(link, self.limits, self._background)
        self.server = ServerEndpoint(link, self.limits, self._background, revocation, revocation_recheck_s)
        self._channels: dict[str, RelayChannel] = {}
        self._messages: AsyncIterator[Message] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False
        #: Frames dropped: not a RelayFrame, or for no call this node knows.
        self.ignored_frames = 0

    @property
    def peer_id(self) -> str:
        return self._link.peer_id

    def channel(self, peer_id: str) -> RelayChannel:
        """The one relay channel to ``peer_id``; the relay owns it (do not close it)."""
        if peer_id == self.peer_id:
            # Its frames would come back to this node's own server half; call the servicer instead.
            raise ValueError("a node cannot relay calls to itself")
        channel = self._channels.get(peer_id)
        if channel is None or channel.closed:
            channel = RelayChannel(self.client, peer_id, self.default_timeout_s)
            self._channels[peer_id] = channel
        return channel

    def serve(self, bindings: Iterable[RelayBinding]) -> None:
        """Serve these servicers to relayed callers (the same list ``NodeServer`` takes)."""
        self.server.serve(bindings)

    async def start(self) -> None:
        """Register the relay channel's consumer and start routing; call before peers call in."""
        if self._started:
            raise RuntimeError("relay already started")
        if self._stopped:
            raise RuntimeError("relay already stopped")
        self._started = True
        self._link.on_error.append(self.gateway_error)
        self._messages = self._link.direct(RELAY_CHANNEL)
        self._dispatcher = asyncio.get_running_loop().create_task(
            self._dispatch(self._messages), name="relay-dispatch"
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Idempotent; safe before start."""
        if self._stopped:
            return
        self._stopped = True
        self.server.accepting = False
        self.client.closed = True
        if not self._started:
            return
        await self.server.wait_idle(self.grace_s if grace_s is None else grace_s)
        self.server.kill_all(grpc.StatusCode.UNAVAILABLE, "relay stopping")
        self.client.fail_all(grpc.StatusCode.UNAVAILABLE, "relay stopping")
        for channel in self._channels.values():
            await channel.close()
        await self.server.wait_idle(1.0)
        if self.gateway_error in self._link.on_error:
            self._link.on_error.remove(self.gateway_error)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.wait([self._dispatcher])
        # NodeLink's Subscription closes with close(); an async generator with aclose().
        closer = getattr(self._messages, "aclose", None) or getattr(self._messages, "close", None)
        if closer is not None:
            try:
                result = closer()
                if inspect.isawaitable(result):
                    await result
            except Exception as err:
                log.debug("relay: closing the link iterator failed: %r", err)
        await self._background.drain(1.0)

    def link_lost(self, details: str = "gateway link lost") -> None:
        """Frames in flight may be gone: end every call now instead of at its deadline.

        The link calls this when its gateway stream breaks; callers get UNAVAILABLE
        (retryable) and served calls are cancelled with an UNAVAILABLE status.
        """
        self.client.fail_all(grpc.StatusCode.UNAVAILABLE, details)
        self.server.kill_all(grpc.StatusCode.UNAVAILABLE, details)

    def gateway_error(self, error: gateway_pb2.GatewayError) -> bool:
        """The link's ``on_error`` callback: a refused frame ends its call now (True if ours).

        Without it a call whose target had not (re-)attached waited out its whole deadline.
        """
        parsed = parse_frame_message_id(error.message_id)
        if parsed is None:
            return False
        side, call_id = parsed  # our call id, or the serving side's own id of the call
        endpoint = self.client if side == CLIENT_SIDE else self.server
        if not endpoint.refused(call_id, error):
            log.debug("relay: gateway error for ended call %s: %s", call_id, error.message)
        return True  # a relay frame's: routine during a failover, not the link's to warn about

    async def _dispatch(self, messages: AsyncIterator[Message]) -> None:
        async for message in messages:
            try:
                await self._route(message)
            except Exception:
                log.exception("relay: frame from %s dropped", message.from_peer)
        if not self._stopped:
            log.warning("relay: the link's relay channel ended; failing calls in flight")
            self.link_lost("relay link closed")

    async def _route(self, message: Message) -> None:
        try:
            frame = gateway_pb2.RelayFrame.FromString(message.payload)
        except DecodeError:
            frame = None
        kind = None if frame is None else frame_kind(frame)
        if frame is None or kind is None or not frame.call_id or not message.direct:
            self._ignore(message, "not a relay frame")
            return
        if kind == "open":
            if not self.server.open(message, frame):
                self._ignore(message, "repeated open")
            return
        if await self.server.deliver(message, frame) or await self.client.deliver(message, frame):
            return
        self._ignore(message, f"{kind} frame for unknown call {frame.call_id}")

    def _ignore(self, message: Message, why: str) -> None:
        self.ignored_frames += 1
        log.debug("relay: ignored a frame from %s: %s", message.from_peer, why)
