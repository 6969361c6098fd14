"""The job bridge: HTTP over a Unix socket between one executor process and its worker.

Each execution gets its own aiohttp app bound to ``bridge.sock`` in its
private work dir (0700, so only the worker's user reaches it). The
executor asks for resources, slices, tensors and directives here and the
worker does the networking: the scheduler through a ``SchedulerLink``,
peers through the ``TensorExchange``, data nodes through a ``SliceSource``,
the hub through a ``ResourceFetcher``. The contract is
``docs/job-bridge.md``; the app serves it as OpenAPI at ``/v1/openapi.json``.
The reference system's routes (``/resources/...``, ``/status/send``) are
served beside them by ``reference_bridge``.

The executor is not trusted with the worker's file system: every path it
names is resolved (symlinks included) and must stay inside its work dir
(403 otherwise); request bodies are small JSON documents with a hard size
limit (413); errors are ``{"error": ...}`` with the status the error tree
maps to.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from aiohttp import web
from google.protobuf import json_format

from hypha.directives import DirectiveKind
from hypha.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from hypha.v1 import common_pb2, scheduler_pb2
from hypha.worker.bridge_http import (
    UINT32_MAX,
    UINT64_MAX,
    bind_unix_socket,
    errors_middleware,
    json_bool,
    json_float,
    json_int,
    json_str,
    query_fields,
    resolve_inside,
    tensor_response,
)
from hypha.worker.bridge_openapi import OPENAPI
from hypha.worker.bridge_slices import SliceHandout, SliceSource
from hypha.worker.execution_state import ExecutionRecord, JobDispatch
from hypha.worker.model_fetch import ResourceFetcher, ResourceSource
from hypha.worker.reference_bridge import ReferenceRoutes
from hypha.worker.scheduler_link import LogForwarder, SchedulerLink
from hypha.worker.transfer import TensorExchange

_T = TypeVar("_T")


class ParameterServerRestored(UnavailableError):
    """A tensor call to the parameter server was abandoned: the scheduler restored it (503)."""


log = logging.getLogger(__name__)

SOCKET_NAME = "bridge.sock"
_LOG_STREAMS = frozenset({"stdout", "stderr", "system"})
_REPORTED_STATES = frozenset({"running", "succeeded", "failed"})


@dataclass(frozen=True)
class BridgeLimits:
    #: Largest request body (all bodies are small JSON documents).
    max_body_bytes: int = 1 << 20
    #: Longest an inbox or fetch request may wait.
    max_wait_s: float = 3600.0
    #: Ask the scheduler for the following slice as soon as one is handed out, and prefetch it.
    slice_lookahead: bool = True


@dataclass
class BridgeContext:
    """Everything one execution's bridge serves from."""

    dispatch: JobDispatch
    work_dir: Path
    record: ExecutionRecord
    link: SchedulerLink
    exchange: TensorExchange
    logs: LogForwarder
    resources: ResourceFetcher | None = None
    slices: SliceSource | None = None
    limits: BridgeLimits = BridgeLimits()


class JobBridge:
    """One execution's bridge server; ``start()`` binds the socket, ``stop()`` closes it (idempotent)."""

    def __init__(self, context: BridgeContext) -> None:
        self.ctx = context
        self.socket_path = context.work_dir / SOCKET_NAME
        self.app = self._make_app()
        self._runner: web.AppRunner | None = None
        self._resource_locks: dict[str, asyncio.Lock] = {}
        self._resources: dict[str, Path] = {}
        self.slices = SliceHandout(
            context.dispatch.job_id,
            context.work_dir,
            context.link,
            context.slices,
            lookahead=context.limits.slice_lookahead,
        )
        #: Set (and replaced) at each rewiring: tensor calls to a peer that moved give up.
        self._rewired = asyncio.Event()

    def rewire(self, dispatch: JobDispatch) -> None:
        """The execution's dispatch changed (``execution.is_rewiring``): serve the new one.

        Tensor calls in flight to the parameter server (it was restored, here
        or elsewhere) are abandoned: a send goes again to the restored server,
        a fetch answers 503 at once so the executor asks again (and sends its
        delta again first). Calls naming a former server reach the current one.
        """
        self.ctx.dispatch = dispatch
        self._rewired.set()
        self._rewired = asyncio.Event()

    async def _unless_rewired(self, peer: str, call: Coroutine[Any, Any, _T]) -> _T:
        """Await a tensor call to ``peer``; ``ParameterServerRestored`` if ``peer`` is the parameter
        server and a rewiring came meanwhile (the call is cancelled)."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                rewired = asyncio.ensure_future(self._rewired.wait())
                try:
                    await asyncio.wait({task, rewired}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    rewired.cancel()
                if task.done():
                    return task.result()
                dispatch = self.ctx.dispatch
                if dispatch.is_parameter_server(peer):
                    raise ParameterServerRestored(
                        f"the parameter server was restored on {dispatch.parameter_server_id}; ask again"
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.ctx.limits.max_body_bytes, middlewares=[errors_middleware])
        app.router.add_get("/v1/openapi.json", self._openapi)
        app.router.add_get("/v1/job", self._job)
        app.router.add_post("/v1/resources/fetch", self._fetch_resource)
        app.router.add_get("/v1/slices/next", self._next_slice)
        app.router.add_post("/v1/slices/used", self._slices_used)
        app.router.add_post("/v1/progress", self._progress)
        app.router.add_post("/v1/metrics", self._metrics)
        app.router.add_post("/v1/log", self._log)
        app.router.add_post("/v1/tensors/send", self._send)
        app.router.add_get("/v1/tensors/inbox", self._inbox)
        app.router.add_post("/v1/tensors/publish", self._publish)
        app.router.add_get("/v1/tensors/fetch", self._fetch_tensors)
        app.router.add_post("/v1/result", self._result)
        app.router.add_post("/v1/status", self._status)
        # The reference system's API on the same socket (reference_bridge), for executors written for it.
        self.reference = ReferenceRoutes(self)
        self.reference.mount(app)
        return app

    async def start(self) -> Path:
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        sock = bind_unix_socket(self.socket_path)
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        return self.socket_path

    async def stop(self) -> None:
        await self.reference.close()
        await self.slices.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.socket_path.unlink(missing_ok=True)

    # ---- helpers -----------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        return self.ctx.dispatch.job_id

    async def _body(self, request: web.Request) -> dict[str, Any]:
        length = request.content_length
        if length is not None and length > self.ctx.limits.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.ctx.limits.max_body_bytes, actual_size=length)
        raw = await request.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            raise InvalidArgumentError("the body is not JSON") from None
        if not isinstance(data, dict):
            raise InvalidArgumentError("the body must be a JSON object")
        return data

    async def _inside(self, raw: object, want: Literal["file", "dir", "any"]) -> Path:
        return await asyncio.to_thread(resolve_inside, self.ctx.work_dir, raw, want)

    def _wait(self, data: dict[str, Any], default: float) -> float:
        return min(max(0.0, json_float(data, "timeout_s", default)), self.ctx.limits.max_wait_s)

    # ---- handlers ------------------------------------------------------------------------

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def _job(self, request: web.Request) -> web.Response:
        dispatch = self.ctx.dispatch
        spec = common_pb2.JobSpec()
        spec.CopyFrom(dispatch.spec)
        # Credentials stay with the worker, which does the downloading.
        for source in dispatch.profile.job.sources(spec).values():
            source.token = ""
        return web.json_response(
            {
                "job_id": dispatch.job_id,
                "executor": dispatch.executor.value,
                "spec": json_format.MessageToDict(spec, preserving_proto_field_name=True),
                "work_dir": str(self.ctx.work_dir),
                "batch_size": dispatch.batch_size,
                "parameter_server_id": dispatch.parameter_server_id,
                "trainer_ids": list(dispatch.trainer_ids),
                "start_round": dispatch.start_round,
                "attempt": dispatch.attempt,
            }
        )

    async def _fetch_resource(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        name = json_str(data, "resource")
        if name not in ("model", "preprocessor"):
            raise NotFoundError(f"unknown resource {name!r} (known: model, preprocessor)")
        dispatch = self.ctx.dispatch
        named = dispatch.profile.job.sources(dispatch.spec).get(name)
        if named is None:
            raise FailedPreconditionError(f"a {dispatch.profile.job.name} job has no {name}")
        source = ResourceSource.from_proto(named)
        if source.empty:
            raise NotFoundError(f"the job's spec names no {name} to fetch")
        if self.ctx.resources is None:
            raise UnavailableError("this worker cannot fetch models")
        async with self._resource_locks.setdefault(name, asyncio.Lock()):
            path = self._resources.get(name)
            if path is None:
                self.ctx.logs.line("system", f"fetching {name} {source.repository or source.local_path}")
                path = await self.ctx.resources.fetch(source, self.ctx.work_dir / "resources" / name)
                self._resources[name] = path
        return web.json_response({"path": str(path)})

    async def _next_slice(self, request: web.Request) -> web.Response:
        handed = await self.slices.next()
        if handed is None:
            return web.Response(status=204)
        index, epoch, path = handed
        return web.json_response({"index": index, "epoch": epoch, "path": str(path)})

    async def _slices_used(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        indices = data.get("indices")
        if not isinstance(indices, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= UINT32_MAX for i in indices
        ):
            raise InvalidArgumentError(f"'indices' must be a list of integers from 0 to {UINT32_MAX}")
        self.slices.mark_used(indices)
        return web.json_response({})

    async def _progress(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        report = scheduler_pb2.ProgressReport(
            job_id=self.job_id,
            round=json_int(data, "round"),
            batches=json_int(data, "batches"),
            samples=json_int(data, "samples", maximum=UINT64_MAX),
            loss=json_float(data, "loss", 0.0),
            batch_seconds=json_float(data, "batch_seconds", 0.0),
            batch_size=json_int(data, "batch_size", 0),
            next_batch_started=json_bool(data, "next_batch_started"),
        )
        directive = await self.ctx.link.progress(report)
        return web.json_response(
            {
                "kind": (DirectiveKind.from_proto(directive.kind) or DirectiveKind.CONTINUE).value,
                "batches": directive.batches,
                "round": directive.round,
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        values = data.get("values")
        if not isinstance(values, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in values.items()
        ):
            raise InvalidArgumentError("'values' must map names to numbers")
        # The worker adds what it measured itself: the job's tensor bytes so far (cumulative),
        # once there are any (a task job's figures stay its own).
        pushed, pulled = self.ctx.exchange.job_bytes(self.job_id)
        measured = (
            {"tensor_bytes_pushed": float(pushed), "tensor_bytes_pulled": float(pulled)}
            if pushed or pulled
            else {}
        )
        await self.ctx.link.metrics(
            scheduler_pb2.MetricsReport(
                job_id=self.job_id,
                round=json_int(data, "round", 0),
                values={**{k: float(v) for k, v in values.items()}, **measured},
            )
        )
        return web.json_response({})

    async def _log(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        if "line" not in data:
            raise InvalidArgumentError("'line' is required (it may be empty)")
        stream = json_str(data, "stream", "system")
        if stream not in _LOG_STREAMS:
            raise InvalidArgumentError(f"'stream' must be one of {sorted(_LOG_STREAMS)}")
        for line in json_str(data, "line", "").splitlines() or [""]:
            self.ctx.logs.line(stream, line)
        return web.json_response({})

    async def _send(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        path = await self._inside(data.get("path"), "file")
        while True:
            peer = self.ctx.dispatch.route(json_str(data, "peer"))
            try:
                accepted, message = await self._unless_rewired(
                    peer,
                    self.ctx.exchange.send(
                        self.job_id,
                        peer,
                        self.ctx.dispatch.addresses_of(peer),
                        json_str(data, "kind"),
                        json_int(data, "round", 0),
                        json_int(data, "samples", 0, UINT64_MAX),
                        path,
                    ),
                )
            except ParameterServerRestored as restored:
                self.ctx.logs.line("system", f"{restored.message}: sending {path.name} there")
                continue
            return web.json_response({"accepted": accepted, "message": message})

    async def _inbox(self, request: web.Request) -> web.Response:
        query = query_fields(request)
        payload = await self.ctx.exchange.next_received(
            self.job_id, json_str(query, "kind"), self._wait(query, 30.0)
        )
        if payload is None:
            return web.Response(status=204)
        return tensor_response(payload)

    async def _publish(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        path = await self._inside(data.get("path"), "file")
        await self.ctx.exchange.publish(
            self.job_id,
            json_str(data, "kind"),
            json_int(data, "round", 0),
            path,
            samples=json_int(data, "samples", 0, UINT64_MAX),
        )
        return web.json_response({})

    async def _fetch_tensors(self, request: web.Request) -> web.Response:
        query = query_fields(request)
        peer = self.ctx.dispatch.route(json_str(query, "peer"))
        payload = await self._unless_rewired(
            peer,
            self.ctx.exchange.fetch(
                self.job_id,
                peer,
                self.ctx.dispatch.addresses_of(peer),
                json_str(query, "kind"),
                json_int(query, "round", 0),
                self._wait(query, 30.0),
            ),
        )
        if payload is None:
            return web.Response(status=204)
        return tensor_response(payload)

    async def _result(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        path = await self._inside(data.get("path"), "dir")
        if path == self.ctx.work_dir.resolve():
            raise InvalidArgumentError("the result must be a directory below the work dir, not the work dir")
        self.ctx.record.result_dir = str(path)
        self.ctx.logs.line("system", f"result: {path.relative_to(self.ctx.work_dir.resolve())}")
        return web.json_response({})

    async def _status(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        state = json_str(data, "state")
        if state not in _REPORTED_STATES:
            raise InvalidArgumentError(f"'state' must be one of {sorted(_REPORTED_STATES)}")
        message = json_str(data, "message", "")
        self.ctx.record.report(state, message)
        if state == "running":
            await self.ctx.link.status(
                scheduler_pb2.JobStatusReport(
                    job_id=self.job_id,
                    state=scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
                    message=message,
                    attempt=self.ctx.dispatch.attempt,
                )
            )
        return web.json_response({})


__all__ = [
    "SOCKET_NAME",
    "BridgeContext",
    "BridgeLimits",
    "JobBridge",
    "ParameterServerRestored",
    "bind_unix_socket",
    "resolve_inside",
]
