"""The callee's half of relayed calls: this node's own servicers, served to
peers whose calls arrive as ``RelayFrame`` direct messages.

The handlers are the very ones a ``NodeServer`` serves: they are captured
from the generated ``add_XServicer_to_server`` functions, so a servicer
cannot tell a relayed call from a direct one except through its context.
The caller's identity is what the gateway stamped on the frames (it
authenticated the sender's TLS session), and the same role policy
(``hypha.net.policy``) and error mapping apply as on the direct path.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from cryptography import x509

from hypha.net.interceptors import status_for
from hypha.net.messages import RELAY_CHANNEL, Message
from hypha.net.policy import is_allowed
from hypha.net.relay_client import (
    Background,
    DirectLink,
    FramesLostError,
    Mailbox,
    RelayLimits,
    Sequencer,
    frame_kind,
    passthrough,
)
from hypha.pki.identity import PeerIdentity
from hypha.v1 import gateway_pb2

log = logging.getLogger(__name__)

#: (register function from *_pb2_grpc, servicer, full service name), as ``NodeServer`` takes them.
RelayBinding = tuple[Callable[[Any, Any], None], Any, str]


def relayed_identity(peer_id: str, role: Any) -> PeerIdentity:
    """The caller of a relayed call: no certificate reached us, so no name, serial or issuer."""
    return PeerIdentity(peer_id=peer_id, role=role, name="", serial=0, issuer=x509.Name([]))


@dataclass(frozen=True)
class _CallDetails:
    """The ``grpc.HandlerCallDetails`` that generic handlers are asked with."""

    method: str
    invocation_metadata: tuple[Any, ...] = ()


class HandlerTable:
    """Stands in for a ``grpc.aio.Server`` while generated code registers handlers."""

    def __init__(self) -> None:
        self._methods: dict[str, Any] = {}
        self._generic: list[Any] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        for name, handler in method_handlers.items():
            self._methods[f"/{service_name}/{name}"] = handler

    def lookup(self, method: str) -> Any | None:
        """The ``grpc.RpcMethodHandler`` for a full method name, or None."""
        handler = self._methods.get(method)
        if handler is None:
            for generic in self._generic:
                handler = generic.service(_CallDetails(method))
                if handler is not None:
                    break
        return handler


class RelayServicerContext(grpc.aio.ServicerContext):
    """The ``grpc.aio.ServicerContext`` of a relayed call.

    ``relay_identity`` is the gateway-stamped caller; ``auth_context()`` is
    empty because no TLS session with the caller exists.
    """

    def __init__(self, call: ServerCall, identity: PeerIdentity, deadline: float | None) -> None:
        self._call = call
        self.relay_identity = identity
        self._deadline = deadline
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._cancelled = False
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []

    async def read(self) -> Any:
        return await self._call.read_request()

    async def write(self, message: Any) -> None:
        await self._call.write_response(message)

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code = code
        self._details = details
        raise grpc.aio.AbortError()

    async def abort_with_status(self, status: Any) -> NoReturn:
        await self.abort(status.code, status.details)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        return None

    def invocation_metadata(self) -> tuple[Any, ...]:
        # NOTE: RelayFrame carries no metadata; relayed calls arrive without any.
        return ()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_compression(self, compression: Any) -> None:
        return None

    def disable_next_message_compression(self) -> None:
        return None

    def peer(self) -> str:
        return f"relay:{self.relay_identity.peer_id}"

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, Any]:
        return {}

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def trailing_metadata(self) -> tuple[Any, ...]:
        return ()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def final_status(self) -> tuple[grpc.StatusCode, str]:
        return self._code or grpc.StatusCode.OK, self._details

    def failed(self) -> bool:
        return self._code is not None and self._code != grpc.StatusCode.OK

    def _finish(self) -> None:
        self._done = True
        for callback in self._callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("relayed call done callback failed")


class ServerEndpoint:
    """This node's relayed calls being served, by (caller, call id)."""

    def __init__(self, link: DirectLink, limits: RelayLimits, background: Background) -> None:
        self.link = link
        self.limits = limits
        self.background = background
        self.handlers = HandlerTable()
        self.accepting = True
        self._calls: dict[tuple[str, str], ServerCall] = {}

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
        method = frame.open
        handler = self.handlers.lookup(method)
        refusal: tuple[grpc.StatusCode, str] | None = None
        if not self.accepting:
            refusal = grpc.StatusCode.UNAVAILABLE, "relay stopping"
        elif handler is None:
            refusal = grpc.StatusCode.UNIMPLEMENTED, f"method not found: {method}"
        elif not is_allowed(method, message.from_role):
            refusal = (
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {message.from_role.value} may not call {method}",
            )
        elif len(self._calls) >= self.limits.max_concurrent_calls:
            refusal = grpc.StatusCode.RESOURCE_EXHAUSTED, "too many relayed calls in progress"
        if refusal is not None:
            self.background.spawn(
                self._refuse(message.from_peer, frame.call_id, *refusal), name=f"relay-refuse {frame.call_id}"
            )
            return True
        call = ServerCall(self, message, frame, handler)
        self._calls[key] = call
        call.start()
        return True

    async def _refuse(self, peer: str, call_id: str, code: grpc.StatusCode, details: str) -> None:
        frame = gateway_pb2.RelayFrame(
            call_id=call_id, seq=0, status=gateway_pb2.RelayStatus(code=code.value[0], details=details)
        )
        try:
            await self.link.send(peer, frame.SerializeToString(), RELAY_CHANNEL)
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
        self, endpoint: ServerEndpoint, message: Message, frame: gateway_pb2.RelayFrame, handler: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        self.peer = message.from_peer
        self.call_id = frame.call_id
        self.key = (self.peer, self.call_id)
        self.method = frame.open
        self._endpoint = endpoint
        self._limits = endpoint.limits
        self._handler = handler
        self._deserialize = handler.request_deserializer or passthrough
        self._serialize = handler.response_serializer or passthrough
        self._requests: Mailbox[bytes] = Mailbox(self._limits.queue_messages)
        self._sequencer = Sequencer(self._limits.reorder_window, first=frame.seq + 1)
        self._next_seq = 0
        deadline = loop.time() + frame.timeout_s if frame.timeout_s > 0 else None
        self.context = RelayServicerContext(self, relayed_identity(self.peer, message.from_role), deadline)
        self._timer = None if deadline is None else loop.call_at(deadline, self._expire)
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
            if len(item.message) > self._limits.max_message_bytes:
                self.kill(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request message exceeds {self._limits.max_message_bytes} bytes",
                )
                return
            try:
                await self._requests.put(item.message, self._limits.stall_timeout_s)
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
        await self._send(gateway_pb2.RelayFrame(message=data))

    async def _send(self, frame: gateway_pb2.RelayFrame) -> None:
        frame.call_id = self.call_id
        frame.seq = self._next_seq
        self._next_seq += 1
        await self._endpoint.link.send(self.peer, frame.SerializeToString(), RELAY_CHANNEL)

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
        if self._timer is not None:
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
