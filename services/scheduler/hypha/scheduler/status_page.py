"""The scheduler's status page: one read-only web page of jobs, rounds, curves and workers.

``GET /`` serves ``status_page.html`` (package data: one file of vanilla JS
that draws its curves as inline SVG), which polls ``GET /status.json`` every
second; that document is built from the same store and orchestrator the
client API reads.

Decisions (NOTE):
- Plain HTTP on its own port, loopback only by default
  (``scheduler.status_page_listen``; a non-loopback address needs
  ``status_page_public = true``, config.py refuses it otherwise). A browser
  would need a client certificate for the mTLS REST mirror; a read-only page
  on loopback needs none, and an operator who wants it elsewhere puts an
  authenticating proxy (or an SSH tunnel) in front. It changes nothing:
  every route is a GET, nothing can be submitted or cancelled here.
- Polling, not server-sent events: one small JSON document a second is
  cheap, survives a scheduler restart without reconnect logic, and works
  through any proxy.
- Secrets stay out: job specs are never sent, only names, states and figures.
"""

from __future__ import annotations

import logging
import math
from importlib import resources
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from hypha.net.https import serve_app
from hypha.scheduler.records import JobRecord, MetricRecord
from hypha.scheduler.servicer import SchedulerServicer

log = logging.getLogger(__name__)

#: Jobs the page shows (newest first); their curves are read per poll.
MAX_JOBS = 50
PAGE = "status_page.html"


def curves(points: list[MetricRecord]) -> dict[str, list[list[float]]]:
    """Per metric name, ``[round, mean over the workers that reported it]`` in round order."""
    sums: dict[str, dict[int, list[float]]] = {}
    for point in points:
        if math.isfinite(point.value):
            sums.setdefault(point.name, {}).setdefault(point.round, []).append(point.value)
    return {
        name: [[float(round_), sum(values) / len(values)] for round_, values in sorted(by_round.items())]
        for name, by_round in sorted(sums.items())
    }


def job_summary(job: JobRecord, points: list[MetricRecord]) -> dict[str, Any]:
    """What the page shows of one job (no spec: it may hold tokens)."""
    return {
        "job_id": job.job_id,
        "name": job.spec.name,
        "kind": job.kind,
        "state": job.state.value,
        "reason": job.reason,
        "round": job.round,
        "rounds": job.rounds,
        "loss": job.loss if math.isfinite(job.loss) else None,
        "workers": list(job.workers),
        "attempt": job.attempt,
        "curves": curves(points),
    }


class StatusPage:
    """The page's HTTP server; ``start`` binds (port 0: any free port) and returns the port."""

    def __init__(self, api: SchedulerServicer, listen: str = "127.0.0.1:0") -> None:
        self.api = api
        self.listen = listen
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._html = resources.files("hypha.scheduler").joinpath(PAGE).read_text(encoding="utf-8")

    @property
    def url(self) -> str:
        host = self.listen.rpartition(":")[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}/"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.page)
        app.router.add_get("/status.json", self.status)
        return app

    async def start(self) -> int:
        # Plain HTTP on purpose: a browser has no client certificate; the page is
        # read-only and loopback-only unless status_page_public says otherwise.
        self._runner, self.port = await serve_app(self.app(), self.listen, None, default_host="127.0.0.1")
        log.info("status page on %s", self.url)
        return self.port

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=self._html, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(await self.document(), headers={"Cache-Control": "no-store"})

    async def document(self) -> dict[str, Any]:
        """Jobs (newest first, with their curves) and the leased workers."""
        store = self.api.store
        jobs = list(reversed(await store.list_jobs(None, limit=MAX_JOBS)))
        summaries = [job_summary(job, await store.metrics(job.job_id)) for job in jobs]
        views = await self.api.orchestrator.list_workers()
        # People read workers by the name on their certificate, not by 32-character peer ids.
        names = {view.peer.peer_id: view.peer.name for view in views if view.peer.name}
        for summary in summaries:
            summary["worker_names"] = [names.get(peer_id, peer_id) for peer_id in summary["workers"]]
        workers = [json_format.MessageToDict(view, preserving_proto_field_name=True) for view in views]
        return {"jobs": summaries, "workers": workers}


__all__ = ["StatusPage", "curves", "job_summary"]
