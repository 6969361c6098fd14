"""The job bridge's HTTP plumbing: its Unix socket, path confinement, errors and JSON fields.

What ``bridge.JobBridge`` needs from HTTP but is not about jobs: binding the
socket (past the 108-byte ``sun_path`` limit), confining every path an
executor names to its work dir, turning the error tree (and upstream gRPC
failures) into ``{"error": ...}`` responses with the right status, and
reading typed fields out of small JSON bodies and query strings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc
from aiohttp import web

if TYPE_CHECKING:
    from hypha.worker.tensor_inbox import TensorPayload

from hypha.errors import HyphaError, InvalidArgumentError, NotFoundError, PermissionDeniedError

log = logging.getLogger("hypha.worker.bridge")

_MAX_SUN_PATH = 100

HTTP_STATUS_OF: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
    grpc.StatusCode.DATA_LOSS: 503,
}


def resolve_inside(work_dir: Path, raw: object, want: Literal["file", "dir", "any"] = "any") -> Path:
    """The real path ``raw`` names, which must lie inside ``work_dir`` after following symlinks."""
    if not isinstance(raw, str) or not raw or "\0" in raw:
        raise InvalidArgumentError("path must be a non-empty string")
    root = work_dir.resolve()
    candidate = Path(raw)
    real = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if real != root and not real.is_relative_to(root):
        raise PermissionDeniedError(f"path {raw!r} is outside the job's work dir")
    if want == "file" and not real.is_file():
        raise NotFoundError(f"no file {raw!r} in the work dir")
    if want == "dir" and not real.is_dir():
        raise NotFoundError(f"no directory {raw!r} in the work dir")
    return real


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening-ready Unix socket at ``path`` (mode 0600), even past the 108-byte sun_path limit."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if len(str(path).encode()) <= _MAX_SUN_PATH:
            sock.bind(str(path))
        else:
            # NOTE: deep work dirs exceed sun_path; bind through the directory's fd instead.
            dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
            try:
                sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
            finally:
                os.close(dir_fd)
        os.chmod(path, 0o600)
    except BaseException:
        sock.close()
        raise
    return sock


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        text = exc.text or ""
        response = error_response(
            exc.status, exc.reason if not text or text.startswith(f"{exc.status}:") else text
        )
        if "Allow" in exc.headers:  # a 405 must say which methods the path takes (RFC 9110)
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except HyphaError as err:
        return error_response(HTTP_STATUS_OF.get(err.status, 500), err.message)
    except grpc.aio.AioRpcError as err:
        code = err.code()
        return error_response(
            HTTP_STATUS_OF.get(code, 503), f"upstream call failed: {code.name}: {err.details()}"
        )
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception:
        log.exception("job bridge: %s %s failed", request.method, request.path)
        return error_response(500, "internal error")


#: The largest values of the protobuf fields the bridge's integers go into.
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def json_int(data: dict[str, Any], key: str, default: int | None = None, maximum: int = UINT32_MAX) -> int:
    """An integer in 0..``maximum`` (the protobuf field it goes into: uint32 unless said)."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise InvalidArgumentError(f"{key!r} must be an integer from 0 to {maximum}")
    return value


def json_float(data: dict[str, Any], key: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{key!r} must be a number")
    return float(value)


def json_bool(data: dict[str, Any], key: str, default: bool = False) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{key!r} must be true or false")
    return value


def json_str(data: dict[str, Any], key: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise InvalidArgumentError(f"{key!r} must be a non-empty string")
    return value


def query_fields(request: web.Request) -> dict[str, Any]:
    """Query parameters, numbers parsed, so the same readers check them."""
    out: dict[str, Any] = {}
    for key, value in request.query.items():
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def tensor_response(payload: TensorPayload) -> web.Response:
    """A received payload as the response body: its bytes, or its spool file streamed from an
    already-unlinked handle (so the file is gone however the response ends, and memory stays at
    one read block)."""
    headers = {
        "X-Hypha-From": payload.from_peer,
        "X-Hypha-Kind": payload.kind,
        "X-Hypha-Round": str(payload.round),
        "X-Hypha-Samples": str(payload.samples),
    }
    if payload.path is None:
        return web.Response(body=payload.data, content_type="application/octet-stream", headers=headers)
    handle = open(payload.path, "rb")
    payload.release()
    headers["Content-Length"] = str(payload.nbytes)
    return web.Response(body=handle, content_type="application/octet-stream", headers=headers)


__all__ = [
    "HTTP_STATUS_OF",
    "bind_unix_socket",
    "error_response",
    "errors_middleware",
    "json_float",
    "json_int",
    "json_str",
    "query_fields",
    "resolve_inside",
    "tensor_response",
]
