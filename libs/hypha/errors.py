"""One error tree for the whole project, and its one mapping to gRPC statuses.

Domain code raises a ``HyphaError`` subclass; servers translate it through
``status_for`` (see ``hypha.net.errors``), so no servicer writes its own
``abort`` calls. Anything that is not a ``HyphaError`` becomes a sanitized
``INTERNAL`` there.
"""

from __future__ import annotations

import grpc


class HyphaError(Exception):
    """Root of every error the project raises on purpose."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    #: Whether a client may retry the same call later.
    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(HyphaError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(HyphaError):
    status = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(HyphaError):
    status = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(HyphaError):
    status = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(HyphaError):
    status = grpc.StatusCode.UNAUTHENTICATED


class FailedPreconditionError(HyphaError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class IllegalTransitionError(FailedPreconditionError):
    """A state machine was asked to make a move its table does not allow."""

    def __init__(self, machine: str, current: str, target: str) -> None:
        super().__init__(f"{machine}: illegal transition {current} -> {target}")
        self.current = current
        self.target = target


class ResourceExhaustedError(HyphaError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class OutOfRangeError(HyphaError):
    status = grpc.StatusCode.OUT_OF_RANGE


class DataLossError(HyphaError):
    status = grpc.StatusCode.DATA_LOSS


class UnavailableError(HyphaError):
    status = grpc.StatusCode.UNAVAILABLE
    retryable = True


class ConfigError(HyphaError):
    """A configuration file, environment variable or flag is wrong.

    The message names the key and where it came from; CLIs print it and exit
    non-zero without a traceback.
    """

    status = grpc.StatusCode.INVALID_ARGUMENT


#: Status codes a client may retry (with jittered backoff); everything else
#: fails fast, TLS and authentication failures included.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
