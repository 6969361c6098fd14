"""The server guard: authentication, role policy, revocation and the one
mapping of errors to gRPC statuses, applied to every handler of a server.

grpc.aio interceptors see only the method name, not the TLS session, so the
guard wraps each handler's behaviour and checks the caller inside it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from hypha.errors import HyphaError, PermissionDeniedError, UnauthenticatedError
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


class ServerGuard(grpc.aio.ServerInterceptor):
    """Refuses unauthenticated, revoked and wrong-role callers; maps errors."""

    def __init__(self, revocation: RevocationChecker, *, enforce_roles: bool = True) -> None:
        self._revocation = revocation
        self._enforce_roles = enforce_roles
        self.refused: dict[str, int] = {}

    def check(self, context: grpc.aio.ServicerContext, method: str) -> PeerIdentity:
        peer = peer_identity(context)
        if self._revocation.is_revoked(peer.issuer, peer.serial):
            self._count("revoked")
            raise UnauthenticatedError("certificate revoked")
        if self._enforce_roles and not is_allowed(method, peer.role):
            self._count("role")
            raise PermissionDeniedError(f"role {peer.role.value} may not call {method}")
        return peer

    def _count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

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


def _wrap_handler(handler: Any, guard: ServerGuard, method: str) -> grpc.RpcMethodHandler:
    if handler.unary_unary:
        kind, behavior = "unary_unary", handler.unary_unary
    elif handler.unary_stream:
        kind, behavior = "unary_stream", handler.unary_stream
    elif handler.stream_unary:
        kind, behavior = "stream_unary", handler.stream_unary
    else:
        kind, behavior = "stream_stream", handler.stream_stream

    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behavior):

        async def wrapped_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                guard.check(context, method)
                async for item in behavior(request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as err:
                await abort_with(context, err, method)

        wrapped = wrapped_gen
    else:

        async def wrapped_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                guard.check(context, method)
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as err:
                await abort_with(context, err, method)

        wrapped = wrapped_call

    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
