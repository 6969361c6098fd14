"""The REST mirror of the client API (aiohttp), plus ``/metrics``.

Routes (JSON unless noted), the seed-001 ones first:

- ``POST /api/v1/tasks``: submit a task job; the body is the job file's
  ``[job]`` table as JSON (``{"command": "python", "args": [...], ...}``).
- ``GET /api/v1/tasks/{id}``, ``DELETE /api/v1/tasks/{id}``, ``GET /api/v1/tasks``.
- ``GET /api/v1/workers``.
- ``POST /api/v1/jobs``: any job: a TOML body (``Content-Type:
  application/toml``), or JSON ``{"toml": "..."}``, ``{"job": {...}}`` (the
  table) or ``{"spec": {...}}`` (a ``hypha.v1.JobSpec`` in proto JSON).
- ``GET /api/v1/jobs[?state=running&state=pending&kind=task]``,
  ``GET /api/v1/jobs/{id}``, ``DELETE /api/v1/jobs/{id}``,
  ``DELETE /api/v1/jobs?all=true``, ``GET /api/v1/jobs/{id}/logs``.
- ``GET /api/v1/openapi.json``: the OpenAPI 3.1 description of all of this.
- ``GET /metrics``: Prometheus text format.

Authentication (``NOTE``): the REST server requires mutual TLS exactly like
the gRPC server: a client certificate chaining to the network's trust
bundle, not revoked (same CRL checker), with the role read from its OU.
``/api/*`` accepts the client and admin roles, like the gRPC client API;
``/metrics`` accepts any role of the network (give Prometheus an admin or
client certificate). One identity model for both transports means one way
to issue, revoke and audit access; bearer tokens would be a second one.
Anonymous TLS connections fail in the handshake, before any handler runs.

Every route calls the same ``SchedulerApi`` methods the gRPC service does,
so both transports agree by construction; errors map from the one error tree
to HTTP statuses (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
PERMISSION_DENIED 403, NOT_FOUND 404, FAILED_PRECONDITION/ALREADY_EXISTS 409,
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, anything else 500 without details)
with a body ``{"error": {"code": "NOT_FOUND", "message": "..."}}``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import json_format

from hypha.errors import (
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import PeerIdentity, identity_of_pem
from hypha.scheduler.api import OPERATORS, SchedulerApi
from hypha.scheduler.jobfile import normalize_spec, parse_job_document, parse_job_table, parse_job_toml
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hypha.scheduler.metrics import SchedulerMetrics
from hypha.scheduler.records import JobRecord, redacted
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)

API = "/api/v1"
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


# ---- TLS ------------------------------------------------------------------------------------


def _load_chain(ctx: ssl.SSLContext, tls: TlsMaterial) -> None:
    """``ssl`` reads certificates and keys only from files: write them to a private
    temporary directory just long enough to load them."""
    with tempfile.TemporaryDirectory(prefix="hypha-tls-") as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(tls.cert_chain_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(tls.key_pem)
        ctx.load_cert_chain(cert, key)


def server_ssl_context(tls: TlsMaterial) -> ssl.SSLContext:
    """TLS for the REST server: our certificate, and a client certificate required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=tls.trust_pem.decode("ascii"))
    _load_chain(ctx, tls)
    return ctx


def client_ssl_context(tls: TlsMaterial) -> ssl.SSLContext:
    """TLS for a REST client (tests, scripts): verify the server by the trust bundle, present our cert."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=tls.trust_pem.decode("ascii"))
    _load_chain(ctx, tls)
    return ctx


# ---- JSON views ------------------------------------------------------------------------------


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat().replace("+00:00", "Z")


def job_json(job: JobRecord) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "name": job.name,
        "kind": job.kind,
        "state": job.state.value,
        "reason": job.reason,
        "created_at": _iso(job.created_at),
        "updated_at": _iso(job.updated_at),
        "round": job.round,
        "rounds": job.rounds,
        "loss": job.loss,
        "workers": list(job.workers),
        "attempt": job.attempt,
        "exit_code": job.exit_code,
        "submitted_by": job.submitted_by,
        "spec": json_format.MessageToDict(redacted(job.spec), preserving_proto_field_name=True),
    }


def _error(err: HyphaError) -> web.Response:
    status = HTTP_STATUS.get(err.status, 500)
    message = err.message if status != 500 else "internal error"
    body = {"error": {"code": err.status.name, "message": message}}
    return web.json_response(body, status=status)


# ---- the server ------------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RestServer:
    """HTTPS (mutual TLS) server for the REST mirror; ``start`` binds and returns the port."""

    def __init__(
        self,
        api: SchedulerApi,
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

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"https://{self.address}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        r = app.router
        r.add_post(f"{API}/jobs", self.submit_job)
        r.add_get(f"{API}/jobs", self.list_jobs)
        r.add_delete(f"{API}/jobs", self.cancel_all)
        r.add_get(f"{API}/jobs/{{job_id}}", self.get_job)
        r.add_delete(f"{API}/jobs/{{job_id}}", self.cancel_job)
        r.add_get(f"{API}/jobs/{{job_id}}/logs", self.get_logs)
        r.add_post(f"{API}/tasks", self.submit_task)
        r.add_get(f"{API}/tasks", self.list_tasks)
        r.add_get(f"{API}/tasks/{{job_id}}", self.get_task)
        r.add_delete(f"{API}/tasks/{{job_id}}", self.cancel_task)
        r.add_get(f"{API}/workers", self.list_workers)
        r.add_get(f"{API}/openapi.json", self.openapi)
        r.add_get("/metrics", self.prometheus)
        return app

    async def start(self) -> int:
        if self._runner is not None:
            raise RuntimeError("REST server already started")
        host, _, port = self.listen.rpartition(":")
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(
            runner, host.strip("[]") or "0.0.0.0", int(port), ssl_context=server_ssl_context(self.tls)
        )
        await site.start()
        self.port = int(runner.addresses[0][1])
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
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if not der:
            raise UnauthenticatedError("no client certificate")
        try:
            peer = identity_of_pem(ssl.DER_cert_to_PEM_cert(der).encode("ascii"))
        except ValueError as err:
            raise UnauthenticatedError(f"unreadable client certificate: {err}") from err
        if self.tls.revocation.is_revoked(peer.issuer, peer.serial):
            raise UnauthenticatedError("certificate revoked")
        return peer

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            peer = self.identity_of(request)
            if request.path.startswith("/api/") and peer.role not in OPERATORS:
                raise PermissionDeniedError(f"role {peer.role.value} may not use the client API")
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
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InvalidArgumentError(f"body: not valid JSON: {err}") from None

    async def submit_job(self, request: web.Request) -> web.Response:
        if request.content_type in ("application/toml", "text/toml", "text/plain"):
            spec = parse_job_toml(await request.text())
        else:
            body = await self._json_body(request)
            if not isinstance(body, dict):
                raise InvalidArgumentError("body: must be a JSON object")
            if "toml" in body:
                if not isinstance(body["toml"], str):
                    raise InvalidArgumentError("toml: must be a string")
                spec = parse_job_toml(body["toml"])
            elif "spec" in body:
                try:
                    spec = json_format.ParseDict(body["spec"], common_pb2.JobSpec())
                except json_format.ParseError as err:
                    raise InvalidArgumentError(f"spec: {err}") from None
                spec = normalize_spec(spec)
            elif "job" in body:
                spec = parse_job_document(body)
            else:
                raise InvalidArgumentError("body: give toml, job or spec")
        job = await self.api.submit_spec(request[_IDENTITY], spec)
        return web.json_response(job_json(job), status=201)

    async def submit_task(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        spec = parse_job_table(body, "task", kind="task")
        job = await self.api.submit_spec(request[_IDENTITY], spec)
        return web.json_response(job_json(job), status=201)

    async def _list(self, request: web.Request, kind: str) -> web.Response:
        states = [JobState.parse(s) for s in request.query.getall("state", [])]
        kind = kind or request.query.get("kind", "")
        jobs = await self.api.list_jobs(request[_IDENTITY], states, kind)
        return web.json_response({"jobs": [job_json(job) for job in jobs]})

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
        return web.json_response(job_json(await self._get(request, "")))

    async def get_task(self, request: web.Request) -> web.Response:
        return web.json_response(job_json(await self._get(request, "task")))

    async def cancel_job(self, request: web.Request) -> web.Response:
        cancelled = await self.api.cancel(request[_IDENTITY], request.match_info["job_id"])
        return web.json_response({"cancelled": cancelled})

    async def cancel_task(self, request: web.Request) -> web.Response:
        job = await self._get(request, "task")
        cancelled = await self.api.cancel(request[_IDENTITY], job.job_id)
        return web.json_response({"cancelled": cancelled})

    async def cancel_all(self, request: web.Request) -> web.Response:
        if request.query.get("all", "").lower() not in ("true", "1", "yes"):
            raise InvalidArgumentError("all: set all=true to cancel every active job")
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
        text = await self.metrics.render() if self.metrics is not None else ""
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})


# ---- OpenAPI ---------------------------------------------------------------------------------


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of the REST mirror."""
    errors = {
        code: _json(_ref("Error"), text)
        for code, text in (
            ("400", "malformed request (the message names the key)"),
            ("403", "the certificate's role may not call this"),
            ("404", "no such job"),
            ("409", "the job is not in a state that allows this"),
        )
    }
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    state_filter = {
        "name": "state",
        "in": "query",
        "required": False,
        "schema": {"type": "array", "items": _ref("JobState")},
        "style": "form",
        "explode": True,
    }
    job = _json(_ref("Job"), "the job")
    jobs = _json({"type": "object", "properties": {"jobs": {"type": "array", "items": _ref("Job")}}}, "jobs")
    cancelled = _json(
        {"type": "object", "properties": {"cancelled": {"type": "array", "items": {"type": "string"}}}},
        "ids of the jobs cancelled",
    )
    submitted = _json(_ref("Job"), "accepted: the job, PENDING")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Hypha scheduler REST API",
            "version": "1",
            "description": "REST mirror of the hypha.v1.Scheduler gRPC client API. Mutual TLS is required: "
            "a client or admin certificate of the network.",
        },
        "security": [{"mtls": []}],
        "paths": {
            f"{API}/tasks": {
                "post": {
                    "summary": "Submit a task job",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("TaskJob")}},
                    },
                    "responses": {"201": submitted, **errors},
                },
                "get": {
                    "summary": "List task jobs",
                    "parameters": [state_filter],
                    "responses": {"200": jobs},
                },
            },
            f"{API}/tasks/{{job_id}}": {
                "parameters": [job_id],
                "get": {"summary": "Get a task job", "responses": {"200": job, **errors}},
                "delete": {"summary": "Cancel a task job", "responses": {"200": cancelled, **errors}},
            },
            f"{API}/jobs": {
                "post": {
                    "summary": "Submit a job (TOML job file, job table, or JobSpec)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/toml": {"schema": {"type": "string"}},
                            "application/json": {"schema": _ref("JobSubmission")},
                        },
                    },
                    "responses": {"201": submitted, **errors},
                },
                "get": {
                    "summary": "List jobs",
                    "parameters": [
                        state_filter,
                        {
                            "name": "kind",
                            "in": "query",
                            "schema": {"type": "string", "enum": ["diloco", "task"]},
                        },
                    ],
                    "responses": {"200": jobs},
                },
                "delete": {
                    "summary": "Cancel every active job of the caller (every job, for an admin)",
                    "parameters": [
                        {"name": "all", "in": "query", "required": True, "schema": {"const": "true"}}
                    ],
                    "responses": {"200": cancelled, **errors},
                },
            },
            f"{API}/jobs/{{job_id}}": {
                "parameters": [job_id],
                "get": {"summary": "Get a job", "responses": {"200": job, **errors}},
                "delete": {"summary": "Cancel a job", "responses": {"200": cancelled, **errors}},
            },
            f"{API}/jobs/{{job_id}}/logs": {
                "parameters": [job_id],
                "get": {
                    "summary": "The job's kept log lines",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {"lines": {"type": "array", "items": _ref("LogLine")}},
                            },
                            "log lines, oldest first",
                        ),
                        **errors,
                    },
                },
            },
            f"{API}/workers": {
                "get": {
                    "summary": "Workers this scheduler holds leases on",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {"workers": {"type": "array", "items": {"type": "object"}}},
                            },
                            "hypha.v1.WorkerView objects in proto JSON",
                        )
                    },
                }
            },
            f"{API}/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (any certificate of the network)",
                    "responses": {"200": {"description": "text/plain; version=0.0.4"}},
                }
            },
        },
        "components": {
            "securitySchemes": {"mtls": {"type": "mutualTLS", "description": "client or admin certificate"}},
            "schemas": {
                "JobState": {"type": "string", "enum": [s.value for s in JobState]},
                "Job": {
                    "type": "object",
                    "required": ["job_id", "kind", "state"],
                    "properties": {
                        "job_id": {"type": "string"},
                        "name": {"type": "string"},
                        "kind": {"type": "string", "enum": ["diloco", "task"]},
                        "state": _ref("JobState"),
                        "reason": {"type": "string"},
                        "created_at": {"type": "string", "format": "date-time"},
                        "updated_at": {"type": "string", "format": "date-time"},
                        "round": {"type": "integer"},
                        "rounds": {"type": "integer"},
                        "loss": {"type": "number"},
                        "workers": {"type": "array", "items": {"type": "string"}},
                        "attempt": {"type": "integer"},
                        "exit_code": {"type": "integer"},
                        "submitted_by": {"type": "string", "description": "peer id of the submitting client"},
                        "spec": {
                            "type": "object",
                            "description": "hypha.v1.JobSpec in proto JSON (secrets redacted)",
                        },
                    },
                },
                "TaskJob": {
                    "type": "object",
                    "required": ["command"],
                    "description": "A job file's [job] table for a task, as JSON.",
                    "properties": {
                        "name": {"type": "string"},
                        "command": {"type": "string"},
                        "args": {"type": "array", "items": {"type": "string"}},
                        "env": {"type": "object", "additionalProperties": {"type": "string"}},
                        "gpus": {"type": "integer", "minimum": 0},
                        "timeout_s": {"type": "number", "minimum": 0},
                        "completion_marker": {"type": "string"},
                        "selection_policy": {"type": "string"},
                        "resources": {
                            "type": "object",
                            "properties": {
                                f: {"type": "number", "minimum": 0}
                                for f in ("cpu", "memory_gb", "storage_gb", "gpu", "gpu_memory_gb")
                            },
                        },
                        "price": {
                            "type": "object",
                            "properties": {"bid": {"type": "number"}, "max": {"type": "number"}},
                        },
                        "retry": {
                            "type": "object",
                            "properties": {
                                "max_attempts": {"type": "integer", "minimum": 1},
                                "backoff_base_s": {"type": "number"},
                                "backoff_cap_s": {"type": "number"},
                                "retry_on_timeout": {"type": "boolean"},
                                "retry_on_worker_loss": {"type": "boolean"},
                            },
                        },
                    },
                    "additionalProperties": False,
                },
                "JobSubmission": {
                    "type": "object",
                    "description": "Exactly one of toml, job, spec.",
                    "properties": {
                        "toml": {"type": "string", "description": "a job file's text"},
                        "job": {"type": "object", "description": "a job file's [job] table"},
                        "spec": {"type": "object", "description": "hypha.v1.JobSpec in proto JSON"},
                    },
                },
                "LogLine": {
                    "type": "object",
                    "properties": {
                        k: {"type": "string"} for k in ("job_id", "stream", "line", "at", "worker_id")
                    },
                },
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                        }
                    },
                },
            },
        },
    }
