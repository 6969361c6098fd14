"""Stand-ins for the ``grpc.aio`` server objects a relayed call's handler
meets: the table the generated ``add_XServicer_to_server`` functions register
into (``HandlerTable``, in place of a ``grpc.aio.Server``), and the
``grpc.aio.ServicerContext`` the handler runs with.

The servicers a ``NodeServer`` serves run unchanged over the relay
(``relay_server``); the context is the only place a relayed call differs
from a direct one: ``relay_identity`` names the caller, as the caller's
gateway stamped it, in place of a TLS session, there is no metadata, and its
deadline and cancellation are the relay's (the served call's timer and
``kill``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from cryptography import x509

from hypha.net.messages import Message
from hypha.pki.identity import PeerIdentity

if TYPE_CHECKING:
    from hypha.net.relay_server import ServerCall

log = logging.getLogger(__name__)


#: (register function from *_pb2_grpc, servicer, full service name), as ``NodeServer`` takes them.
RelayBinding = tuple[Callable[[Any, Any], None], Any, str]


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


def relayed_identity(message: Message) -> PeerIdentity:
    """The caller of a relayed call, as its gateway stamped it from TLS.

    No certificate reached us, so no name; serial 0 means the gateway
    stamped no certificate (the call is then refused where a CRL is checked).
    """
    try:
        issuer = x509.Name.from_rfc4514_string(message.from_issuer)
    except ValueError:
        issuer = x509.Name([])
    return PeerIdentity(
        peer_id=message.from_peer,
        role=message.from_role,
        name="",
        serial=message.from_serial,
        issuer=issuer,
        authority_key_id=message.from_issuer_key_id or None,
    )


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
