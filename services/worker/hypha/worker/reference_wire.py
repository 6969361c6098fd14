"""The reference job bridge's request bodies, errors and paths, as its worker answers them.

The reference worker (``crates/worker``, axum) decodes each body with serde
and answers a body it cannot take as axum does: no JSON content type 415, not
JSON 400, JSON of the wrong shape 422, all plain text. Past decoding, its
errors are JSON ``{"error": kind, "detail"}``: ``invalid_request`` (400: a bad
path, a reference it will not fetch), ``network_error``, ``connector_error``
and ``io_error`` (500). Paths are relative to the work dir; an absolute one or
one with a ``..`` part is ``invalid_request``. Here a path is also resolved
(symlinks followed) and must stay in the work dir, as on our own API.

The shapes (serde's): a reference is an object tagged by ``type``
(``uri``, ``huggingface``, ``peers``, ``scheduler``); a progress value is a
bare string (``"update"``, ``"updated"``, ``"update-received"``) or a
one-key object (``{"status": {...}}``, ``{"metrics": {...}}``); unknown
fields are ignored, missing ones refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

INVALID_REQUEST = "invalid_request"
NETWORK_ERROR = "network_error"
CONNECTOR_ERROR = "connector_error"
IO_ERROR = "io_error"


class ReferenceBridgeError(Exception):
    """An error the reference answers as JSON ``{error, detail}``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail

    def response(self) -> web.Response:
        status = 400 if self.kind == INVALID_REQUEST else 500
        return web.json_response({"error": self.kind, "detail": self.detail}, status=status)


class BodyRejected(Exception):
    """A body the reference's JSON extractor refuses: plain text with 400, 413, 415 or 422."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.text, content_type="text/plain")


def shape_error(detail: str) -> BodyRejected:
    return BodyRejected(422, f"Failed to deserialize the JSON body into the target type: {detail}")


async def read_body(request: web.Request, limit: int) -> Any:
    """The request's JSON value, refused as the reference's extractor refuses it."""
    if request.content_type != "application/json":
        raise BodyRejected(415, "Expected request with `Content-Type: application/json`")
    if request.content_length is not None and request.content_length > limit:
        raise BodyRejected(413, "Failed to buffer the request body: length limit exceeded")
    raw = await request.content.read(limit + 1)
    if len(raw) > limit:
        raise BodyRejected(413, "Failed to buffer the request body: length limit exceeded")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BodyRejected(400, f"Failed to parse the request body as JSON: {exc}") from None


# ---- references --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    type: Literal["uri", "huggingface", "peers", "scheduler"]
    value: str = ""  # uri
    repository: str = ""  # huggingface
    revision: str | None = None
    filenames: tuple[str, ...] = ()
    token: str | None = None
    peers: tuple[str, ...] = ()  # peers
    strategy: str = ""
    peer: str = ""  # scheduler
    dataset: str = ""


_STRATEGIES = ("All", "Random", "One")


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise shape_error(f"{what}: invalid type, expected an object")
    return value


def _str(data: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    if key not in data or (optional and data[key] is None):
        if optional:
            return None
        raise shape_error(f"missing field `{key}`")
    value = data[key]
    if not isinstance(value, str):
        raise shape_error(f"{key}: invalid type, expected a string")
    return value


def _strs(data: dict[str, Any], key: str) -> tuple[str, ...]:
    if key not in data:
        raise shape_error(f"missing field `{key}`")
    value = data[key]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise shape_error(f"{key}: invalid type, expected a sequence of strings")
    return tuple(value)


def parse_reference(value: Any, what: str = "resource") -> Reference:
    data = _obj(value, what)
    kind = data.get("type")
    if kind is None:
        raise shape_error("missing field `type`")
    if kind == "uri":
        return Reference("uri", value=_str(data, "value") or "")
    if kind == "huggingface":
        return Reference(
            "huggingface",
            repository=_str(data, "repository") or "",
            revision=_str(data, "revision", optional=True),
            filenames=_strs(data, "filenames"),
            token=_str(data, "token", optional=True),
        )
    if kind == "peers":
        strategy = _obj(data.get("strategy"), "strategy").get("type") if "strategy" in data else None
        if strategy not in _STRATEGIES:
            raise shape_error("strategy: expected one of `All`, `Random`, `One`")
        return Reference("peers", peers=_strs(data, "peers"), strategy=str(strategy))
    if kind == "scheduler":
        return Reference("scheduler", peer=_str(data, "peer") or "", dataset=_str(data, "dataset") or "")
    raise shape_error(f"unknown variant `{kind}`, expected one of `uri`, `huggingface`, `peers`, `scheduler`")


def check_fetchable(ref: Reference) -> None:
    """The reference's own checks of a fetch, before anything is fetched."""
    if ref.type == "uri" and not ref.value.startswith(("http://", "https://")):
        raise ReferenceBridgeError(INVALID_REQUEST, f"invalid URI: expected http(s)://..., got `{ref.value}`")
    if ref.type == "huggingface":
        if not ref.repository.strip():
            raise ReferenceBridgeError(INVALID_REQUEST, "repository must not be empty")
        if not ref.filenames:
            raise ReferenceBridgeError(INVALID_REQUEST, "filenames must not be empty")
    if ref.type == "peers":
        raise ReferenceBridgeError(INVALID_REQUEST, "unsupported strategy")


def parse_transfer(value: Any, *, receive: bool) -> tuple[Reference, str | None]:
    """A send (``{resource, path}``) or receive (``{resource, path?}``) body; only peers references."""
    data = _obj(value, "body")
    if "resource" not in data:
        raise shape_error("missing field `resource`")
    ref = parse_reference(data["resource"])
    if ref.type != "peers":
        raise shape_error(f"{'Receive' if receive else 'Send'} can only be created from Peers")
    if receive and ref.strategy != "All":
        raise shape_error("Receive requires SelectionStrategy::All")
    path = _str(data, "path", optional=receive)
    return ref, path


# ---- progress ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    kind: Literal["status", "metrics", "update", "updated", "update-received"]
    batch_size: int = 0
    round: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


_U32 = 2**32 - 1
_PROGRESS_VARIANTS = "`status`, `metrics`, `update`, `updated`, `update-received`"


def _u32(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if key not in data:
        raise shape_error(f"missing field `{key}`")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32:
        raise shape_error(f"{key}: invalid value, expected u32")
    return value


def parse_progress(value: Any) -> Progress:
    if value in ("update", "updated", "update-received"):
        return Progress(value)
    if not isinstance(value, dict) or len(value) != 1:
        raise shape_error(f"unknown variant, expected one of {_PROGRESS_VARIANTS}")
    ((kind, body),) = value.items()
    if kind == "status":
        return Progress("status", batch_size=_u32(_obj(body, "status"), "batch_size"))
    if kind == "metrics":
        data = _obj(body, "metrics")
        metrics = _obj(data.get("metrics"), "metrics") if "metrics" in data else None
        if metrics is None:
            raise shape_error("missing field `metrics`")
        values: dict[str, float] = {}
        for name, number in metrics.items():
            if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
                raise shape_error(f"metrics.{name}: invalid type, expected f32")
            values[name] = float(number)
        return Progress("metrics", round=_u32(data, "round"), metrics=values)
    raise shape_error(f"unknown variant `{kind}`, expected one of {_PROGRESS_VARIANTS}")


# ---- paths -------------------------------------------------------------------------------


def safe_join(work_dir: Path, rel: str) -> Path:
    """``rel`` below the work dir: relative, no ``..``, and (symlinks followed) still inside it."""
    path = Path(rel)
    if path.is_absolute():
        raise ReferenceBridgeError(INVALID_REQUEST, "absolute paths are not allowed")
    if ".." in path.parts:
        raise ReferenceBridgeError(INVALID_REQUEST, "path traversal is not allowed")
    if "\0" in rel:
        raise ReferenceBridgeError(INVALID_REQUEST, "paths must not contain NUL")
    root = work_dir.resolve()
    real = (root / path).resolve()
    if real != root and not real.is_relative_to(root):
        raise ReferenceBridgeError(INVALID_REQUEST, "path leaves the work dir through a link")
    return root / path


def sse_event(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as a JSON line."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


#: The keep-alive comment the reference sends every 5 s on an idle event stream.
SSE_KEEPALIVE = b":keepalive\n\n"

__all__ = [
    "CONNECTOR_ERROR",
    "INVALID_REQUEST",
    "IO_ERROR",
    "NETWORK_ERROR",
    "SSE_KEEPALIVE",
    "BodyRejected",
    "Progress",
    "Reference",
    "ReferenceBridgeError",
    "check_fetchable",
    "parse_progress",
    "parse_reference",
    "parse_transfer",
    "read_body",
    "safe_join",
    "shape_error",
    "sse_event",
]
