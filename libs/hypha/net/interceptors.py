"""The server guard: authentication, role policy, revocation and the one
mapping of errors to gRPC statuses, applied to every handler of a server.

grpc.aio interceptors see only the method name, not the TLS session, so the
guard wraps each handler's behaviour and checks the caller inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from hypha.errors import (
    HyphaError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from hypha.net.auth import peer_identity
from hypha.net.policy import is_allowed
from hypha.pki.crl import RevocationChecker
from hypha.pki.identity import PeerIdentity

log = logging.getLogger(__name__)


def status_for(err: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The one mapping of an exception to the status and public message a caller sees.

    HyphaError subclasses carry their own; the generated servicer base raises
    NotImplementedError for RPCs a role does not serve; anything else is
    logged here and answered with a sanitized INTERNAL.
    """
    if isinstance(err, HyphaError):
        return err.status, err.message
    if isinstance(err, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented"
    log.error("unhandled error in %s", method, exc_info=err)
    return grpc.StatusCode.INTERNAL, "internal error"


async def abort_with(context: grpc.aio.ServicerContext, err: BaseException, method: str) -> None:
    """End the call with ``status_for(err)``."""
    code, message = status_for(err, method)
    await context.abort(code, message)


#: How often an open stream's peer is checked against the CRL again, by default.
DEFAULT_RECHECK_S = 1.0


@dataclass
class _Watch:
    fired: bool = False


class ServerGuard(grpc.aio.ServerInterceptor):
    """Refuses unauthenticated, revoked and wrong-role callers; maps errors.

    A streaming call is checked when it opens and then every ``recheck_s``
    while it stays open: a certificate revoked meanwhile ends the stream with
    UNAUTHENTICATED (a gateway link or a tensor stream would otherwise outlive
    the revocation by hours). The re-check is a stat of the CRL file.

    ``max_per_peer`` bounds the calls one peer id holds open at once (the
    server's ``maximum_concurrent_rpcs`` bounds them all): the next one is
    RESOURCE_EXHAUSTED, so one caller cannot take every slot of the server.
    """

    def __init__(
        self,
        revocation: RevocationChecker,
        *,
        enforce_roles: bool = True,
        recheck_s: float = DEFAULT_RECHECK_S,
        max_per_peer: int | None = None,
    ) -> None:
        self._revocation = revocation
        self._enforce_roles = enforce_roles
        self.recheck_s = recheck_s
        self.max_per_peer = max_per_peer
        self.refused: dict[str, int] = {}
        #: Calls in progress per peer id (only admitted ones).
        self.in_flight: dict[str, int] = {}

    def revoked(self, peer: PeerIdentity) -> bool:
        return self._revocation.is_revoked(peer.issuer, peer.serial, peer.authority_key_id)

    def check(self, context: grpc.aio.ServicerContext, method: str) -> PeerIdentity:
        peer = peer_identity(context)
        if self.revoked(peer):
            self._count("revoked")
            raise UnauthenticatedError("certificate revoked")
        if self._enforce_roles and not is_allowed(method, peer.role):
            self._count("role")
            raise PermissionDeniedError(f"role {peer.role.value} may not call {method}")
        return peer

    @contextlib.contextmanager
    def admitted(self, peer: PeerIdentity) -> Iterator[None]:
        """Hold one of ``peer``'s call slots while inside; ResourceExhaustedError when none is free."""
        held = self.in_flight.get(peer.peer_id, 0)
        if self.max_per_peer is not None and held >= self.max_per_peer:
            self._count("peer_limit")
            raise ResourceExhaustedError(
                f"too many calls from one peer: at most {self.max_per_peer} at once (net.max_rpcs_per_peer)"
            )
        self.in_flight[peer.peer_id] = held + 1
        try:
            yield
        finally:
            left = self.in_flight[peer.peer_id] - 1
            if left:
                self.in_flight[peer.peer_id] = left
            else:
                del self.in_flight[peer.peer_id]

    def _count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    @contextlib.asynccontextmanager
    async def watching(self, peer: PeerIdentity) -> AsyncIterator[_Watch]:
        """While inside, the current task is cancelled (and ``fired`` set) once ``peer`` is revoked.

        Relayed calls have no certificate here (serial 0): the gateway that
        stamped them answers for their identity, so they are not watched.
        """
        watch = _Watch()
        task = asyncio.current_task()
        if task is None or peer.serial == 0:
            yield watch
            return

        async def recheck() -> None:
            # Only a CRL load that changed something can revoke the peer: the walk runs then.
            seen = -1
            while True:
                await asyncio.sleep(self.recheck_s)
                self._revocation.refresh()
                generation = self._revocation.generation
                if generation == seen:
                    continue
                seen = generation
                if self.revoked(peer):
                    self._count("revoked_open_stream")
                    watch.fired = True
                    task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(recheck(), name="revocation-recheck")
        try:
            yield watch
        finally:
            watcher.cancel()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return _wrap_handler(handler, self, method)


class _Malformed:
    """Stands for a request body that did not parse.

    grpc.aio answers a request its deserializer cannot parse with INTERNAL,
    before any handler (or the guard) runs: a caller's garbage would look
    like our bug, and a caller without the role would learn nothing of it.
    Parsing leniently and refusing inside the guarded handler gives the
    caller PERMISSION_DENIED or INVALID_ARGUMENT, in that order.
    """

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as err:
            return _Malformed(str(err) or type(err).__name__)

    return parse


def _well_formed(request: Any, method: str) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidArgumentError(f"{method}: cannot parse the request message ({request.error})")
    return request


async def _well_formed_stream(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        yield _well_formed(request, method)


def _raise_if_revoked(watch: _Watch) -> None:
    """Turn the watcher's cancellation into the status the caller should see."""
    task = asyncio.current_task()
    if watch.fired and task is not None and task.uncancel() == 0:
        raise UnauthenticatedError("certificate revoked while the call was open")


def _wrap_handler(handler: Any, guard: ServerGuard, method: str) -> grpc.RpcMethodHandler:
    if handler.unary_unary:
        kind, behavior = "unary_unary", handler.unary_unary
    elif handler.unary_stream:
        kind, behavior = "unary_stream", handler.unary_stream
    elif handler.stream_unary:
        kind, behavior = "stream_unary", handler.stream_unary
    else:
        kind, behavior = "stream_stream", handler.stream_stream

    streaming_in = kind.startswith("stream_")

    def checked(request: Any) -> Any:
        return _well_formed_stream(request, method) if streaming_in else _well_formed(request, method)

    # NOTE: a server-streaming handler that writes through ``context.write`` (a
    # coroutine, like grpc's own Health.Watch) is wrapped as an async generator
    # too: the telemetry interceptor outside this one iterates every streaming
    # handler, and answered UNKNOWN for a coroutine.
    streaming_out = kind.endswith("_stream")
    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behavior) or streaming_out:
        if not inspect.isasyncgenfunction(behavior):
            writer = behavior

            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await writer(request, context)
                return
                yield  # an async generator that yields nothing: the writer wrote its replies

        async def wrapped_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                peer = guard.check(context, method)
                with guard.admitted(peer):
                    async with guard.watching(peer) as watch:
                        try:
                            async for item in behavior(checked(request), context):
                                yield item
                        except asyncio.CancelledError:
                            _raise_if_revoked(watch)
                            raise
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as err:
                await abort_with(context, err, method)

        wrapped = wrapped_gen
    else:

        async def wrapped_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                peer = guard.check(context, method)
                with guard.admitted(peer):
                    if kind == "unary_unary":
                        return await behavior(checked(request), context)
                    async with guard.watching(peer) as watch:
                        try:
                            return await behavior(checked(request), context)
                        except asyncio.CancelledError:
                            _raise_if_revoked(watch)
                            raise
            except grpc.aio.AbortError:
                raise
            except Exception as err:
                await abort_with(context, err, method)

        wrapped = wrapped_call

    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        wrapped,
        request_deserializer=_lenient(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
