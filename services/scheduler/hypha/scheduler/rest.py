"""The REST mirror of the client API (aiohttp), plus ``/metrics``.

Routes (JSON unless noted), the task routes first:

- ``POST /api/v1/tasks``: submit a task job; the body is the job file's
  ``[job]`` table as JSON (``{"command": "python", "args": [...], ...}``).
- ``GET /api/v1/tasks/{id}``, ``POST /api/v1/tasks/{id}/cancel``, ``GET /api/v1/tasks``.
- ``GET /api/v1/workers``.
- ``POST /api/v1/jobs``: any job: a TOML body (``Content-Type:
  application/toml``), or JSON ``{"toml": "..."}``, ``{"job": {...}}`` (the
  table, naming its ``kind``) or ``{"spec": {...}}`` (a ``hypha.v1.JobSpec`` in proto JSON).
- ``GET /api/v1/jobs[?state=running&state=pending&kind=task]``,
  ``GET /api/v1/jobs/{id}``, ``POST /api/v1/jobs/{id}/cancel``,
  ``POST /api/v1/jobs:cancel`` with ``{"all": true}``, ``GET /api/v1/jobs/{id}/logs``,
  ``POST /api/v1/jobs/{id}/scale`` with ``{"workers": N}`` (a running DiLoCo job).
- Cancelling is an action (``POST .../cancel``), not ``DELETE``: a cancelled
  job stays readable (its state, logs and result), and ``DELETE`` promises it
  would be gone. ``DELETE`` on a job is 405 with an ``Allow`` header.
- ``GET /api/v1/openapi.json``: the OpenAPI 3.1 description of all of this.
- ``GET /metrics``: Prometheus text format.

Authentication (``NOTE``): the REST server requires mutual TLS exactly like
the gRPC server: a client certificate chaining to the network's trust
bundle, not revoked (same CRL checker), with the role read from its OU.
Who may call a route is part of the route: ``RestServer.routes`` is one
table of (method, path, handler, roles), and the guard reads the roles of
the route the request *matched*, never a path prefix, so a route cannot get
its roles from how its path happens to start (and a route missing from the
table is not served). The API routes accept the client and admin roles, like
the gRPC client API; ``/metrics`` accepts any role of the network (give
Prometheus an admin or client certificate). A path no route matches is 404
(a method a route lacks 405) before any role is looked at. One identity
model for both transports means one way to issue, revoke and audit access;
bearer tokens would be a second one. Anonymous TLS connections fail in the
handshake, before any handler runs.

Every route calls the same ``SchedulerServicer`` methods the gRPC service does,
so both transports agree by construction; errors map from the one error tree
to HTTP statuses (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
PERMISSION_DENIED 403, NOT_FOUND 404, FAILED_PRECONDITION/ALREADY_EXISTS 409,
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, anything else 500 without details)
with a body ``{"error": {"code": "NOT_FOUND", "message": "..."}}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import json_format

from hypha import jobview
from hypha.errors import (
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from hypha.jobfile import KINDS, normalize_spec, parse_job_document, parse_job_table, parse_job_toml
from hypha.net.https import request_identity, serve_app, server_ssl_context
from hypha.net.metrics_server import exposition
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import PeerIdentity, Role
from hypha.scheduler.diloco.elastic import MAX_WORKERS
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.metrics import SchedulerMetrics
from hypha.scheduler.openapi import API, openapi_document
from hypha.scheduler.records import JobRecord
from hypha.scheduler.servicer import OPERATORS, SchedulerServicer
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_IDENTITY = web.RequestKey("identity", PeerIdentity)


# ---- JSON views ------------------------------------------------------------------------------


def job_json(job: JobRecord, viewer: PeerIdentity) -> dict[str, Any]:
    """The one job JSON view (``hypha.jobview``), secrets redacted as ``viewer`` must see them."""
    return jobview.job_json(job.to_proto(viewer))


def _error(err: HyphaError) -> web.Response:
    status = HTTP_STATUS.get(err.status, 500)
    message = err.message if status != 500 else "internal error"
    body = {"error": {"code": err.status.name, "message": message}}
    return web.json_response(body, status=status)


def scale_target(body: Any) -> int:
    """The trainer count of a scale body; a whole float (``3.0``) is the integer JSON Schema says it is."""
    if not isinstance(body, dict):
        raise InvalidArgumentError('body: must be {"workers": N}')
    unknown = sorted(set(body) - {"workers"})
    if unknown:
        raise InvalidArgumentError(f"body.{unknown[0]}: unknown key (give workers)")
    workers = body.get("workers")
    if isinstance(workers, float) and workers.is_integer():
        workers = int(workers)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise InvalidArgumentError(f"workers: must be an integer from 1 to {MAX_WORKERS}")
    return workers


def _routing_error(request: web.Request, err: web.HTTPException) -> web.HTTPException:
    """aiohttp's 404/405 (with ``Allow``); a ``DELETE`` of a job is told where cancelling went."""
    if isinstance(err, web.HTTPMethodNotAllowed) and request.method == "DELETE":
        return web.HTTPMethodNotAllowed(
            request.method,
            err.allowed_methods,
            text=f"405: DELETE is not served: cancel a job with POST {API}/jobs/{{job_id}}/cancel, "
            f"every active one with POST {API}/jobs:cancel (a cancelled job stays readable)",
        )
    return err


# ---- the server ------------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Every role of the network (``/metrics``).
ANY_ROLE = frozenset(Role)


@dataclass(frozen=True)
class Route:
    """One route and the roles that may call it."""

    method: str
    path: str
    handler: Handler
    roles: frozenset[Role]


class RestServer:
    """HTTPS (mutual TLS) server for the REST mirror; ``start`` binds and returns the port."""

    def __init__(
        self,
        api: SchedulerServicer,
        tls: TlsMaterial,
        listen: str = "127.0.0.1:0",
        *,
        metrics: SchedulerMetrics | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.api = api
        self.tls = tls
        self.listen = listen
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._stopped = False
        #: (method, route path) → roles that may call it; filled by ``app`` from ``routes``.
        self._roles: dict[tuple[str, str], frozenset[Role]] = {}

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"https://{self.address}"

    def routes(self) -> tuple[Route, ...]:
        """Every route this server serves, with who may call it: the one table."""
        ops = OPERATORS
        return (
            Route("POST", f"{API}/jobs", self.submit_job, ops),
            Route("GET", f"{API}/jobs", self.list_jobs, ops),
            Route("POST", f"{API}/jobs:cancel", self.cancel_all, ops),
            Route("GET", f"{API}/jobs/{{job_id}}", self.get_job, ops),
            Route("POST", f"{API}/jobs/{{job_id}}/cancel", self.cancel_job, ops),
            Route("GET", f"{API}/jobs/{{job_id}}/logs", self.get_logs, ops),
            Route("POST", f"{API}/jobs/{{job_id}}/scale", self.scale_job, ops),
            Route("POST", f"{API}/tasks", self.submit_task, ops),
            Route("GET", f"{API}/tasks", self.list_tasks, ops),
            Route("GET", f"{API}/tasks/{{job_id}}", self.get_task, ops),
            Route("POST", f"{API}/tasks/{{job_id}}/cancel", self.cancel_task, ops),
            Route("GET", f"{API}/workers", self.list_workers, ops),
            Route("GET", f"{API}/openapi.json", self.openapi, ops),
            Route("GET", "/metrics", self.prometheus, ANY_ROLE),
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        self._roles.clear()
        for route in self.routes():
            if route.method == "GET":  # GET routes answer HEAD too (aiohttp adds the HEAD route)
                app.router.add_get(route.path, route.handler)
                self._roles[("HEAD", route.path)] = route.roles
            else:
                app.router.add_route(route.method, route.path, route.handler)
            self._roles[(route.method, route.path)] = route.roles
        return app

    async def start(self) -> int:
        if self._runner is not None:
            raise RuntimeError("REST server already started")
        self._runner, self.port = await serve_app(self.app(), self.listen, server_ssl_context(self.tls))
        log.info("REST API on %s", self.url)
        return self.port

    async def stop(self) -> None:
        """Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> RestServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- authentication and errors -----------------------------------------------------

    def identity_of(self, request: web.Request) -> PeerIdentity:
        return request_identity(request, self.tls)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            peer = self.identity_of(request)
            match = request.match_info
            if match.http_exception is not None:  # no route: 404 (405), before any role logic
                raise _routing_error(request, match.http_exception)
            resource = match.route.resource
            key = (match.route.method, resource.canonical if resource is not None else "")
            roles = self._roles.get(key, frozenset())  # not in the table: nobody may call it
            if peer.role not in roles:
                raise PermissionDeniedError(f"role {peer.role.value} may not call {key[0]} {key[1]}")
            request[_IDENTITY] = peer
            return await handler(request)
        except HyphaError as err:
            return _error(err)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("REST %s %s failed", request.method, request.path)
            return web.json_response({"error": {"code": "INTERNAL", "message": "internal error"}}, status=500)

    # ---- jobs ---------------------------------------------------------------------------

    async def _json_body(self, request: web.Request) -> Any:
        try:
            body = await request.json()
            # A lone surrogate ("\ud800") parses but is no text: a 400 here, not a 500 where it is stored.
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except ValueError as err:  # also UnicodeError, and an integer of too many digits
            raise InvalidArgumentError(f"body: not valid JSON: {err}") from None
        return body

    async def _text_body(self, request: web.Request) -> str:
        try:
            return await request.text()
        except UnicodeDecodeError as err:
            raise InvalidArgumentError(f"body: not valid {request.charset or 'UTF-8'} text: {err}") from None

    async def submit_job(self, request: web.Request) -> web.Response:
        if request.content_type in ("application/toml", "text/toml", "text/plain"):
            spec = parse_job_toml(await self._text_body(request))
        else:
            body = await self._json_body(request)
            if not isinstance(body, dict):
                raise InvalidArgumentError("body: must be a JSON object")
            given = [key for key in ("toml", "job", "spec") if key in body]
            unknown = sorted(set(body) - {"toml", "job", "spec"})
            if unknown:
                raise InvalidArgumentError(f"body.{unknown[0]}: unknown key (give one of toml, job or spec)")
            if len(given) > 1:
                raise InvalidArgumentError(f"body: give one of toml, job or spec, not {' and '.join(given)}")
            if "toml" in body:
                if not isinstance(body["toml"], str):
                    raise InvalidArgumentError("toml: must be a string")
                spec = parse_job_toml(body["toml"])
            elif "spec" in body:
                if not isinstance(body["spec"], dict):
                    raise InvalidArgumentError("spec: must be a JSON object (hypha.v1.JobSpec in proto JSON)")
                try:
                    spec = json_format.ParseDict(body["spec"], common_pb2.JobSpec())
                except json_format.ParseError as err:
                    raise InvalidArgumentError(f"spec: {err}") from None
                spec = normalize_spec(spec)
            elif "job" in body:
                # The kind picks the table's schema (the document's discriminator), so JSON names it;
                # a job file may leave it out and have it inferred.
                if isinstance(body["job"], dict) and "kind" not in body["job"]:
                    raise InvalidArgumentError(
                        'job.kind: missing: set "kind": "diloco", "task" or "inference"'
                    )
                spec = parse_job_document(body)
            else:
                raise InvalidArgumentError("body: give toml, job or spec")
        job = await self.api.submit_spec(request[_IDENTITY], spec)
        return web.json_response(job_json(job, request[_IDENTITY]), status=201)

    async def submit_task(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        spec = parse_job_table(body, "task", kind="task")
        job = await self.api.submit_spec(request[_IDENTITY], spec)
        return web.json_response(job_json(job, request[_IDENTITY]), status=201)

    async def _list(self, request: web.Request, kind: str) -> web.Response:
        states = [JobState.parse(s) for s in request.query.getall("state", [])]
        if not kind and "kind" in request.query:
            kind = request.query["kind"]
            if kind not in KINDS:
                raise InvalidArgumentError(f"kind: {kind!r} is not a job kind ({', '.join(KINDS)})")
        jobs = await self.api.list_jobs(request[_IDENTITY], states, kind)
        return web.json_response({"jobs": [job_json(job, request[_IDENTITY]) for job in jobs]})

    async def list_jobs(self, request: web.Request) -> web.Response:
        return await self._list(request, "")

    async def list_tasks(self, request: web.Request) -> web.Response:
        return await self._list(request, "task")

    async def _get(self, request: web.Request, kind: str) -> JobRecord:
        job = await self.api.get(request[_IDENTITY], request.match_info["job_id"])
        if kind and job.kind != kind:
            raise NotFoundError(f"no such task: {job.job_id} (it is a {job.kind} job)")
        return job

    async def get_job(self, request: web.Request) -> web.Response:
        return web.json_response(job_json(await self._get(request, ""), request[_IDENTITY]))

    async def get_task(self, request: web.Request) -> web.Response:
        return web.json_response(job_json(await self._get(request, "task"), request[_IDENTITY]))

    async def cancel_job(self, request: web.Request) -> web.Response:
        cancelled = await self.api.cancel(request[_IDENTITY], request.match_info["job_id"])
        return web.json_response({"cancelled": cancelled})

    async def scale_job(self, request: web.Request) -> web.Response:
        workers = scale_target(await self._json_body(request))
        job = await self.api.scale(request[_IDENTITY], request.match_info["job_id"], workers)
        return web.json_response(job_json(job, request[_IDENTITY]))

    async def cancel_task(self, request: web.Request) -> web.Response:
        job = await self._get(request, "task")
        cancelled = await self.api.cancel(request[_IDENTITY], job.job_id)
        return web.json_response({"cancelled": cancelled})

    async def cancel_all(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict) or body.get("all") is not True or len(body) != 1:
            raise InvalidArgumentError('body: must be {"all": true} to cancel every active job')
        cancelled = await self.api.cancel(request[_IDENTITY], all_jobs=True)
        return web.json_response({"cancelled": cancelled})

    async def get_logs(self, request: web.Request) -> web.Response:
        lines = [
            json_format.MessageToDict(line, preserving_proto_field_name=True)
            async for line in self.api.logs(request[_IDENTITY], request.match_info["job_id"])
        ]
        return web.json_response({"lines": lines})

    async def list_workers(self, request: web.Request) -> web.Response:
        views = await self.api.workers(request[_IDENTITY])
        return web.json_response(
            {"workers": [json_format.MessageToDict(v, preserving_proto_field_name=True) for v in views]}
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def prometheus(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.Response(text="")
        await self.metrics.refresh()
        return exposition(self.metrics.registry)
