"""The caller's half of relayed calls (the framing both halves share is ``relay_frames``).

A relayed call is a gRPC call carried as ``RelayFrame`` direct messages
through the gateways, for peers that cannot accept inbound connections.
``ClientCall`` is one such call seen from the caller (frames out, ordered
frames in, deadline, cancel); ``hypha.net.relay.RelayChannel`` wraps it in the
``grpc.aio`` call surface the generated stubs expect.

Frames of one direction of one call carry consecutive ``seq`` numbers from 0;
the receiver puts them back in order and drops duplicates (``Sequencer``), so
the protocol survives a gateway path that reorders or repeats frames. The
``cancel`` frame is the one exception: it acts as soon as it arrives.

Every frame goes out under a message id naming its call (``frame_message_id``).
A gateway that cannot deliver one (PEER_UNKNOWN: the peer is not attached,
or not yet re-attached after a failover) answers with an error frame carrying
that id, and the call ends at once with UNAVAILABLE (``gateway_error_status``)
instead of waiting out its deadline; callers retry on UNAVAILABLE.

NOTE: the wire has no flow-control credit, so backpressure is the node's
dispatcher waiting (up to ``stall_timeout_s``) for room in a call's bounded
inbox; that stalls the link, which stalls the gateway and the sender. A
call whose consumer stays stuck longer fails with RESOURCE_EXHAUSTED instead
of holding up every other call on the link.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from hypha.errors import UnavailableError
from hypha.net.messages import RELAY_CHANNEL, Message
from hypha.net.relay_frames import (
    CLIENT_SIDE,
    DirectLink,
    FramesLostError,
    Mailbox,
    RelayLimits,
    Sequencer,
    Serializer,
    frame_kind,
    frame_message_id,
    gateway_error_status,
    relay_frame_bytes,
    rpc_error,
    status_code,
)
from hypha.service import BackgroundTasks
from hypha.v1 import gateway_pb2

log = logging.getLogger(__name__)

_NO_REQUEST = object()


class ClientEndpoint:
    """This node's calls in flight to relayed peers, by call id."""

    def __init__(self, link: DirectLink, limits: RelayLimits, background: BackgroundTasks) -> None:
        self.link = link
        self.limits = limits
        self.background = background
        self._calls: dict[str, ClientCall] = {}
        #: Set when the relay stops: nothing would route responses any more.
        self.closed = False

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    def register(self, call: ClientCall) -> None:
        self._calls[call.call_id] = call

    def unregister(self, call: ClientCall) -> None:
        if self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]

    async def deliver(self, message: Message, frame: gateway_pb2.RelayFrame) -> bool:
        """Route a response frame; False when no call of ours expects it from that peer."""
        call = self._calls.get(frame.call_id)
        if call is None or call.target != message.from_peer or frame_kind(frame) not in ("message", "status"):
            return False
        await call.deliver(frame)
        return True

    def fail_all(self, code: grpc.StatusCode, details: str) -> None:
        for call in list(self._calls.values()):
            call.fail(code, details, notify_server=False)

    def refused(self, call_id: str, error: gateway_pb2.GatewayError) -> bool:
        """A gateway could not deliver a frame of call ``call_id``: end it now; False if unknown."""
        call = self._calls.get(call_id)
        if call is None:
            return False
        code, details = gateway_error_status(error)
        # A peer the gateway does not know cannot be told; any other refusal leaves it waiting.
        call.fail(code, details, notify_server=error.code != gateway_pb2.ERROR_CODE_PEER_UNKNOWN)
        return True


class ClientCall:
    """One relayed call as the caller sees it: frames out, ordered frames in."""

    def __init__(
        self,
        endpoint: ClientEndpoint,
        target: str,
        method: str,
        serializer: Serializer,
        timeout_s: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.call_id = uuid.uuid4().hex
        self.target = target
        self.method = method
        self._endpoint = endpoint
        self._limits = endpoint.limits
        self._serialize = serializer
        #: Response messages (bytes) and the final status frame, in order.
        self._inbox: Mailbox[bytes | gateway_pb2.RelayFrame] = Mailbox(self._limits.queue_messages)
        self._sequencer = Sequencer(self._limits.reorder_window)
        self._next_seq = 0
        self._opened = False
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.locally_cancelled = False
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self._timer = None if self.deadline is None else loop.call_at(self.deadline, self._expire)
        self._sender: asyncio.Task[None] | None = None
        self._open_sent = loop.create_future()
        self._done = asyncio.Event()
        self._done_callbacks: list[Callable[[], None]] = []
        endpoint.register(self)
        if endpoint.closed:
            self.fail(grpc.StatusCode.UNAVAILABLE, "relay stopped", notify_server=False)

    # ---- sending -------------------------------------------------------------

    def begin(self, request: Any = _NO_REQUEST, requests: Any = None) -> None:
        """Start sending: one request, a (sync or async) iterator of them, or neither (write mode)."""
        self._sender = asyncio.get_running_loop().create_task(
            self._send_requests(request, requests), name=f"relay-send {self.method}"
        )

    async def _send_requests(self, request: Any, requests: Any) -> None:
        try:
            timeout_s = 0.0
            if self.deadline is not None:
                timeout_s = max(self.deadline - asyncio.get_running_loop().time(), 1e-3)
            self._opened = True
            await self._send(gateway_pb2.RelayFrame(open=self.method, timeout_s=timeout_s))
            if not self._open_sent.done():
                self._open_sent.set_result(None)
            if request is not _NO_REQUEST:
                await self.write(request)
                await self._send(gateway_pb2.RelayFrame(half_close=True))
            elif requests is not None:
                if hasattr(requests, "__aiter__"):
                    async for item in requests:
                        await self.write(item)
                else:
                    for item in requests:
                        await self.write(item)
                await self._send(gateway_pb2.RelayFrame(half_close=True))
        except _CallOver:
            pass
        except Exception as err:
            log.warning("relayed call %s: cannot send requests: %r", self.method, err)
            self.fail(grpc.StatusCode.INTERNAL, f"cannot send request: {type(err).__name__}")
        finally:
            if not self._open_sent.done():
                self._open_sent.cancel()

    async def write(self, request: Any) -> None:
        if self.status is not None:
            raise _CallOver()
        data = self._serialize(request)
        if len(data) > self._limits.max_message_bytes:
            self.fail(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request message of {len(data)} bytes exceeds {self._limits.max_message_bytes}",
            )
            raise _CallOver()
        await self._send(gateway_pb2.RelayFrame(), message=data)

    async def write_from_caller(self, request: Any) -> None:
        """``call.write()`` in write mode: waits for the open frame, raises the call's error."""
        await self._await_open()
        try:
            await self.write(request)
        except _CallOver:
            raise self._error() from None

    async def done_writing(self) -> None:
        await self._await_open()
        try:
            await self._send(gateway_pb2.RelayFrame(half_close=True))
        except _CallOver:
            raise self._error() from None

    async def _await_open(self) -> None:
        try:
            await asyncio.shield(self._open_sent)
        except asyncio.CancelledError:
            if self.status is None:
                raise
            raise self._error() from None

    async def _send(self, frame: gateway_pb2.RelayFrame, message: bytes | None = None) -> None:
        """Send ``frame``, or a message frame carrying ``message`` (encoded with one copy of it)."""
        if self.status is not None and not frame.cancel:
            raise _CallOver()
        frame.call_id = self.call_id
        frame.seq = self._next_seq
        self._next_seq += 1
        message_id = frame_message_id(CLIENT_SIDE, self.call_id, frame.seq)
        payload = frame.SerializeToString() if message is None else relay_frame_bytes(frame, message)
        try:
            await self._endpoint.link.send(self.target, payload, RELAY_CHANNEL, message_id)
        except UnavailableError as err:
            # Still try the cancel frame: the open may have gone out, and the server would wait for the rest.
            self.fail(grpc.StatusCode.UNAVAILABLE, f"relay unavailable: {err.message}")
            raise _CallOver() from err

    async def _send_cancel(self) -> None:
        try:
            await self._send(gateway_pb2.RelayFrame(cancel=True))
        except (_CallOver, Exception) as err:
            log.debug("relayed call %s: cancel frame not sent: %r", self.method, err)

    # ---- receiving -----------------------------------------------------------

    async def deliver(self, frame: gateway_pb2.RelayFrame) -> None:
        """Called by the dispatcher; waits (bounded) while the reader is behind."""
        try:
            ready = self._sequencer.accept(frame)
        except FramesLostError as err:
            self.fail(grpc.StatusCode.UNAVAILABLE, f"relay frames lost: {err}")
            return
        for item in ready:
            kind = frame_kind(item)
            # A message frame is queued as its message, read once (every read of a bytes field copies it).
            entry: bytes | gateway_pb2.RelayFrame = item.message if kind == "message" else item
            if isinstance(entry, bytes) and len(entry) > self._limits.max_message_bytes:
                self.fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"response message exceeds {self._limits.max_message_bytes} bytes",
                )
                return
            try:
                accepted = await self._inbox.put(entry, self._limits.stall_timeout_s)
            except TimeoutError:
                self.fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "caller stopped reading relayed responses")
                return
            if not accepted:
                return
            if kind == "status":
                self._finish((status_code(item.status.code), item.status.details))
                return

    async def read(self) -> bytes | None:
        """The next response message; None once the call ended OK; raises its error otherwise."""
        try:
            frame = await self._inbox.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if frame is None:
            return None
        if isinstance(frame, bytes):
            return frame
        code = status_code(frame.status.code)
        error = None if code == grpc.StatusCode.OK else rpc_error(code, frame.status.details)
        self._inbox.close(error)
        if error is not None:
            raise error
        return None

    # ---- ending --------------------------------------------------------------

    def cancel(self) -> bool:
        if self.status is not None:
            return False
        self.locally_cancelled = True
        self.fail(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        return True

    def _expire(self) -> None:
        self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def fail(self, code: grpc.StatusCode, details: str, *, notify_server: bool = True) -> None:
        """End the call here (deadline, cancel, link down, limits); tell the server if asked."""
        if self.status is not None:
            return
        self._inbox.close(self._error(code, details))
        self._finish((code, details))
        if notify_server and self._opened:
            self._endpoint.background.spawn(self._send_cancel(), name=f"relay-cancel {self.call_id}")

    def _error(self, code: grpc.StatusCode | None = None, details: str = "") -> BaseException:
        """What the caller sees: CancelledError after its own cancel (as grpc.aio), else AioRpcError."""
        if self.locally_cancelled:
            return asyncio.CancelledError()
        if code is None:
            code, details = self.status or (grpc.StatusCode.UNKNOWN, "call ended")
        return rpc_error(code, details)

    def _finish(self, status: tuple[grpc.StatusCode, str]) -> None:
        self.status = status
        if self._timer is not None:
            self._timer.cancel()
        if (
            self._sender is not None
            and self._sender is not asyncio.current_task()
            and not self._sender.done()
        ):
            self._sender.cancel()
        self._endpoint.unregister(self)
        self._done.set()
        for callback in self._done_callbacks:
            try:
                callback()
            except Exception:
                log.exception("relayed call done callback failed")

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        if self.status is not None:
            callback()
        else:
            self._done_callbacks.append(callback)

    async def wait_done(self) -> tuple[grpc.StatusCode, str]:
        await self._done.wait()
        assert self.status is not None
        return self.status

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


class _CallOver(Exception):
    """The call already ended; the sender stops quietly."""
