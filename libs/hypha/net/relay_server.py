"""The callee's half of relayed calls: this node's own servicers, served to
peers whose calls arrive as ``RelayFrame`` direct messages.

The handlers are the very ones a ``NodeServer`` serves: they are captured
from the generated ``add_XServicer_to_server`` functions, so a servicer
cannot tell a relayed call from a direct one except through its context
(``relay_context``). The caller's identity is what the gateway stamped on
the frames (it authenticated the sender's TLS session): peer id, role and
the certificate's serial, issuer and issuer key id. With a
``RevocationChecker`` the callee checks that certificate (and the CAs above
it) against its own CRL, at open and while the call stays open
(``relay_revocation``), as the server guard does for a direct call, before
the role policy (``hypha.net.policy``); the error mapping is the direct
path's too.

Bounds (``RelayLimits``): calls served at once, calls per caller, and a
deadline on every call (the caller's, capped at ``max_call_s``; a caller
that set none gets ``max_call_s``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from hypha.net.interceptors import DEFAULT_RECHECK_S, status_for
from hypha.net.messages import RELAY_CHANNEL, Message
from hypha.net.policy import is_allowed
from hypha.net.relay_context import HandlerTable, RelayBinding, RelayServicerContext, relayed_identity
from hypha.net.relay_frames import (
    SERVER_SIDE,
    DirectLink,
    FramesLostError,
    Mailbox,
    RelayLimits,
    Sequencer,
    frame_kind,
    frame_message_id,
    gateway_error_status,
    passthrough,
    relay_frame_bytes,
)
from hypha.net.relay_revocation import OpenCallRevocations, Refusal
from hypha.pki.crl import RevocationChecker
from hypha.pki.identity import PeerIdentity
from hypha.service import BackgroundTasks
from hypha.v1 import gateway_pb2

log = logging.getLogger(__name__)


class ServerEndpoint:
    """This node's relayed calls being served, by (caller, call id)."""

    def __init__(
        self,
        link: DirectLink,
        limits: RelayLimits,
        background: BackgroundTasks,
        revocation: RevocationChecker | None = None,
        recheck_s: float = DEFAULT_RECHECK_S,
    ) -> None:
        self.link = link
        self.limits = limits
        self.background = background
        #: Opens refused, by reason (revoked, unstamped, role, busy, peer_busy, ...), and open calls
        #: ended because their caller was revoked meanwhile (revoked_open_call).
        self.refusals: dict[str, int] = {}
        self.handlers = HandlerTable()
        self.accepting = True
        self._calls: dict[tuple[str, str], ServerCall] = {}
        #: Checks each caller's stamped certificate at open and while its call is open;
        #: None: no revocation checks (tests' fake links).
        self.revocations = (
            None
            if revocation is None
            else OpenCallRevocations(revocation, recheck_s, background, self._calls.values, self.refusals)
        )

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    def serve(self, bindings: Iterable[RelayBinding]) -> None:
        for register, servicer, _name in bindings:
            register(servicer, self.handlers)

    def open(self, message: Message, frame: gateway_pb2.RelayFrame) -> bool:
        """Start serving a call, or answer its refusal; False for a repeated open."""
        key = (message.from_peer, frame.call_id)
        if key in self._calls:
            return False
        handler = self.handlers.lookup(frame.open)
        identity = relayed_identity(message)
        refusal = self._refusal(frame.open, handler, identity, message.from_issuer)
        if refusal is not None:
            self.refusals[refusal[0]] = self.refusals.get(refusal[0], 0) + 1
            self.background.spawn(
                self._refuse(message.from_peer, frame.call_id, *refusal[1:]),
                name=f"relay-refuse {frame.call_id}",
            )
            return True
        call = ServerCall(self, message, frame, handler, identity)
        self._calls[key] = call
        if self.revocations is not None:
            # Checked just now: the watcher re-checks it on any later CRL generation.
            self.revocations.admitted(call)
        call.start()
        return True

    def recheck_revocations(self) -> int:
        """End the open calls whose caller is now revoked; how many (``OpenCallRevocations.recheck``)."""
        return 0 if self.revocations is None else self.revocations.recheck()

    def _refusal(self, method: str, handler: Any, caller: PeerIdentity, issuer: str) -> Refusal | None:
        """(reason, status, details) refusing a call to open, or None: the direct path's order
        (who, revoked, role), then the bounds.

        ``issuer`` is the stamped RFC 4514 text itself, which is what the CRL
        checker keys on (no round trip through a parsed name)."""
        limits = self.limits
        if not self.accepting:
            return "stopping", grpc.StatusCode.UNAVAILABLE, "relay stopping"
        if handler is None:
            return "unknown_method", grpc.StatusCode.UNIMPLEMENTED, f"method not found: {method}"
        if self.revocations is not None and (revoked := self.revocations.refusal(caller, issuer)):
            return revoked
        if not is_allowed(method, caller.role):
            return (
                "role",
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {caller.role.value} may not call {method}",
            )
        if len(self._calls) >= limits.max_concurrent_calls:
            return "busy", grpc.StatusCode.RESOURCE_EXHAUSTED, "too many relayed calls in progress"
        if sum(1 for peer, _ in self._calls if peer == caller.peer_id) >= limits.max_calls_per_peer:
            return (
                "peer_busy",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many relayed calls from one peer: at most {limits.max_calls_per_peer} "
                "(net.relay_max_calls_per_peer)",
            )
        return None

    async def _refuse(self, peer: str, call_id: str, code: grpc.StatusCode, details: str) -> None:
        frame = gateway_pb2.RelayFrame(
            call_id=call_id, seq=0, status=gateway_pb2.RelayStatus(code=code.value[0], details=details)
        )
        try:
            await self.link.send(
                peer,
                frame.SerializeToString(),
                RELAY_CHANNEL,
                frame_message_id(SERVER_SIDE, uuid.uuid4().hex, 0),
            )
        except Exception as err:
            log.debug("relay: refusal to %s not sent: %r", peer, err)

    async def deliver(self, message: Message, frame: gateway_pb2.RelayFrame) -> bool:
        """Route a request frame; False when no served call matches it."""
        call = self._calls.get((message.from_peer, frame.call_id))
        if call is None or frame_kind(frame) not in ("message", "half_close", "cancel"):
            return False
        await call.deliver(frame)
        return True

    def remove(self, call: ServerCall) -> None:
        if self._calls.get(call.key) is call:
            del self._calls[call.key]
        if not self._calls and self.revocations is not None:
            self.revocations.idle()  # nothing left to watch; the next open starts it again

    def refused(self, serve_id: str, error: gateway_pb2.GatewayError) -> bool:
        """A gateway could not deliver a response frame of the call ``serve_id``: stop serving it."""
        # NOTE: by our own id, not the caller-chosen call id, which another caller could reuse.
        call = next((c for c in self._calls.values() if c.serve_id == serve_id), None)
        if call is None:
            return False
        if error.code == gateway_pb2.ERROR_CODE_PEER_UNKNOWN:
            call.kill(None, "caller unreachable")  # nobody to tell
        else:
            call.kill(*gateway_error_status(error))
        return True

    def kill_all(self, code: grpc.StatusCode | None, details: str) -> None:
        for call in list(self._calls.values()):
            call.kill(code, details)

    async def wait_idle(self, timeout_s: float) -> None:
        tasks = [call.task for call in self._calls.values() if call.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


class ServerCall:
    """One relayed call being served: the handler task and its two frame streams."""

    def __init__(
        self,
        endpoint: ServerEndpoint,
        message: Message,
        frame: gateway_pb2.RelayFrame,
        handler: Any,
        identity: PeerIdentity,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.peer = message.from_peer
        self.call_id = frame.call_id
        self.key = (self.peer, self.call_id)
        #: Names this call in the message ids of its response frames (``refused``).
        self.serve_id = uuid.uuid4().hex
        self.method = frame.open
        #: The caller's issuer exactly as stamped (what the CRL checker keys on).
        self.issuer = message.from_issuer
        #: The CRL generation the caller was last found unrevoked at (-1: never checked).
        self.checked_generation = -1
        self._endpoint = endpoint
        self._limits = endpoint.limits
        self._handler = handler
        self._deserialize = handler.request_deserializer or passthrough
        self._serialize = handler.response_serializer or passthrough
        self._requests: Mailbox[bytes] = Mailbox(self._limits.queue_messages)
        self._sequencer = Sequencer(self._limits.reorder_window, first=frame.seq + 1)
        self._next_seq = 0
        # NOTE: never without a deadline: 0 (the caller set none), a negative or NaN one, or one
        # beyond the cap all get the cap, so no call holds a slot for ever.
        timeout_s = (
            frame.timeout_s if 0 < frame.timeout_s < self._limits.max_call_s else self._limits.max_call_s
        )
        deadline = loop.time() + timeout_s
        self.context = RelayServicerContext(self, identity, deadline)
        self._timer = loop.call_at(deadline, self._expire)
        self._kill_status: tuple[grpc.StatusCode, str] | None = None
        self._status_sent = False
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"relay-serve {self.method}")
        self.task.add_done_callback(self._on_done)

    # ---- frames from the caller ------------------------------------------------

    async def deliver(self, frame: gateway_pb2.RelayFrame) -> None:
        if frame.cancel:
            # The caller is gone: act at once, and answer nobody.
            self.kill(None, "cancelled by the caller")
            return
        try:
            ready = self._sequencer.accept(frame)
        except FramesLostError as err:
            self.kill(grpc.StatusCode.UNAVAILABLE, f"relay frames lost: {err}")
            return
        for item in ready:
            if frame_kind(item) == "half_close":
                self._requests.close()
                continue
            if frame_kind(item) != "message":
                continue
            message = item.message  # read once: every read of a bytes field copies it
            if len(message) > self._limits.max_message_bytes:
                self.kill(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request message exceeds {self._limits.max_message_bytes} bytes",
                )
                return
            try:
                await self._requests.put(message, self._limits.stall_timeout_s)
            except TimeoutError:
                self.kill(grpc.StatusCode.RESOURCE_EXHAUSTED, "relayed call stopped reading its requests")
                return
            if not self._handler.request_streaming:
                self._requests.close()  # one request is all a unary method takes

    async def read_request(self) -> Any:
        data = await self._requests.get()
        return grpc.aio.EOF if data is None else await self._decode(data)

    async def _request_stream(self) -> AsyncIterator[Any]:
        while (data := await self._requests.get()) is not None:
            yield await self._decode(data)

    async def _single_request(self) -> Any:
        data = await self._requests.get()
        if data is None:
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, "relayed call carried no request")
        return await self._decode(data)

    async def _decode(self, data: bytes) -> Any:
        try:
            return self._deserialize(data)
        except Exception:
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cannot parse request message")

    # ---- the handler -----------------------------------------------------------

    async def _run(self) -> None:
        code, details = await self._serve()
        await self._send_status(code, details)

    async def _serve(self) -> tuple[grpc.StatusCode, str]:
        """Run the handler; map its outcome with the servers' one mapping (``status_for``)."""
        try:
            await self._invoke()
        except grpc.aio.AbortError:
            pass
        except Exception as err:
            return status_for(err, self.method)
        return self.context.final_status()

    async def _invoke(self) -> None:
        handler = self._handler
        behaviour = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        )
        request = self._request_stream() if handler.request_streaming else await self._single_request()
        result = behaviour(request, self.context)
        if not handler.response_streaming:
            if inspect.isawaitable(result):
                result = await result
            if not self.context.failed():
                await self.write_response(result)
            return
        if hasattr(result, "__aiter__"):
            try:
                async for item in result:
                    await self.write_response(item)
            finally:
                if hasattr(result, "aclose"):
                    await result.aclose()
        elif inspect.isawaitable(result):
            await result  # the handler wrote through context.write()
        elif result is not None:
            for item in result:
                await self.write_response(item)

    async def write_response(self, response: Any) -> None:
        data = self._serialize(response)
        if len(data) > self._limits.max_message_bytes:
            await self.context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"response message exceeds {self._limits.max_message_bytes} bytes",
            )
        await self._send(gateway_pb2.RelayFrame(), message=data)

    async def _send(self, frame: gateway_pb2.RelayFrame, message: bytes | None = None) -> None:
        """Send ``frame``, or a message frame carrying ``message`` (encoded with one copy of it)."""
        frame.call_id = self.call_id
        frame.seq = self._next_seq
        self._next_seq += 1
        message_id = frame_message_id(SERVER_SIDE, self.serve_id, frame.seq)
        payload = frame.SerializeToString() if message is None else relay_frame_bytes(frame, message)
        await self._endpoint.link.send(self.peer, payload, RELAY_CHANNEL, message_id)

    async def _send_status(self, code: grpc.StatusCode, details: str) -> None:
        if self._status_sent:
            return
        try:
            await self._send(
                gateway_pb2.RelayFrame(status=gateway_pb2.RelayStatus(code=code.value[0], details=details))
            )
            self._status_sent = True
        except Exception as err:
            log.debug("relayed %s: status to %s not sent: %r", self.method, self.peer, err)

    # ---- ending ------------------------------------------------------------------

    def _expire(self) -> None:
        self.kill(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def kill(self, code: grpc.StatusCode | None, details: str) -> None:
        """Cancel the handler; the caller gets ``code`` (nothing when None: it left)."""
        if self.task is None or self.task.done() or self.context.cancelled():
            return
        self._kill_status = None if code is None else (code, details)
        self.context._cancelled = True
        self.task.cancel()

    def _on_done(self, task: asyncio.Task[None]) -> None:
        self._endpoint.remove(self)
        self._timer.cancel()
        self._requests.close()
        self.context._finish()
        if task.cancelled():
            if self._kill_status is not None and not self._status_sent:
                self._endpoint.background.spawn(
                    self._send_status(*self._kill_status), name=f"relay-status {self.call_id}"
                )
        elif task.exception() is not None:
            log.error("relayed %s failed outside its handler", self.method, exc_info=task.exception())
