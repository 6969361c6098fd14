"""The reference system's job bridge API, served on our bridge socket beside ``/v1``.

An executor written for the reference system (``hypha-space/hypha``: its RFC
``rfc/2025-08-14_job_bridge.md`` and ``crates/worker``) runs here unchanged:
its four routes are mounted on the same socket and mapped onto what our
bridge already does (docs/job-bridge.md has both APIs side by side):

- ``POST /resources/fetch``: the job's model or preprocessor (a
  ``huggingface`` reference naming the spec's repository or local path)
  through our fetcher and hub cache; ``{"type": "scheduler"}``, the next slice
  from our ``SliceHandout`` (waiting while the scheduler has none). The files
  land in ``artifacts/`` (0600) and the answer lists them.
- ``POST /resources/send``: the trainer's pseudo-gradient goes to the
  parameter server as our Δ for the current round (``reference_tensors``
  converts it), in the background; 200 at once.
- ``POST /resources/receive``: an event stream; each round's update from the
  parameter server, converted to the difference the trainer merges, is
  written to ``<path>/<server>`` and announced as one ``data:`` line.
- ``POST /status/send``: a batch (``status``) becomes our progress report and
  the scheduler's directive comes back as ``Continue`` / ``ScheduleUpdate``
  (``sync_after K`` and ``sync_now`` as counter K and 0) / ``Done``;
  ``metrics`` go to the scheduler as ours do; ``update-received`` answers
  ``Done`` once the job's rounds are over, else ``Continue``.

The bookkeeping our trainer keeps itself (round number, batches and samples
of the round, the slices in use) is kept here for a reference-style trainer,
which knows none of it.

Decisions (NOTE):
- Only what the job's spec names is fetched: the executor chooses among the
  spec's sources, never a repository, URI or path of its own (the worker's
  hub token and local model roots are not the executor's to spend).
- The round trips with the parameter server, and the θ they start from,
  are ``reference_rounds``'s (its NOTEs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web

from hypha.directives import DirectiveKind
from hypha.errors import HyphaError
from hypha.net.backoff import Backoff
from hypha.v1 import scheduler_pb2
from hypha.worker.bridge_http import UINT32_MAX
from hypha.worker.model_fetch import ResourceSource
from hypha.worker.reference_rounds import ReferenceRounds, link_private
from hypha.worker.reference_wire import (
    CONNECTOR_ERROR,
    INVALID_REQUEST,
    IO_ERROR,
    NETWORK_ERROR,
    SSE_KEEPALIVE,
    BodyRejected,
    Reference,
    ReferenceBridgeError,
    check_fetchable,
    parse_progress,
    parse_reference,
    parse_transfer,
    read_body,
    safe_join,
    sse_event,
)

if TYPE_CHECKING:
    from hypha.worker.bridge import JobBridge

ARTIFACTS = "artifacts"
KEEPALIVE_S = 5.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _guarded(handler: Handler) -> Handler:
    """Answer errors the way the reference does (its JSON or plain-text bodies)."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (BodyRejected, ReferenceBridgeError) as err:
            return err.response()
        except HyphaError as err:
            return ReferenceBridgeError(CONNECTOR_ERROR, err.message).response()
        except grpc.aio.AioRpcError as err:
            return ReferenceBridgeError(NETWORK_ERROR, f"{err.code().name}: {err.details()}").response()
        except OSError as err:
            return ReferenceBridgeError(IO_ERROR, str(err)).response()

    return run


class ReferenceRoutes:
    """The reference API of one execution's bridge, and the round state behind it."""

    def __init__(self, bridge: JobBridge) -> None:
        self.bridge = bridge
        self.ctx = bridge.ctx
        self.round = self.ctx.dispatch.start_round
        self.batches = 0
        self.samples = 0
        self.last_loss = 0.0
        self._last_status: float | None = None
        self._done = False
        self._handed: list[int] = []
        self.rounds = ReferenceRounds(self.ctx)

    def mount(self, app: web.Application) -> None:
        app.router.add_post("/resources/fetch", _guarded(self._fetch))
        app.router.add_post("/resources/send", _guarded(self._send))
        app.router.add_post("/resources/receive", _guarded(self._receive))
        app.router.add_post("/status/send", _guarded(self._status))

    async def close(self) -> None:
        """End the event streams and the background work (the bridge is stopping)."""
        await self.rounds.close()

    @property
    def work_dir(self) -> Path:
        return self.ctx.work_dir

    async def _body(self, request: web.Request) -> Any:
        return await read_body(request, self.ctx.limits.max_body_bytes)

    # ---- fetch --------------------------------------------------------------------------

    async def _fetch(self, request: web.Request) -> web.Response:
        ref = parse_reference(await self._body(request))
        check_fetchable(ref)
        artifacts = safe_join(self.work_dir, ARTIFACTS)
        await asyncio.to_thread(artifacts.mkdir, mode=0o700, parents=True, exist_ok=True)
        if ref.type == "scheduler":
            return web.json_response(await self._next_slice(artifacts))
        if ref.type == "uri":
            raise ReferenceBridgeError(
                CONNECTOR_ERROR, "this worker fetches only the job's model, preprocessor and data"
            )
        return web.json_response(await self._fetch_artifact(ref, artifacts))

    def _source_of(self, ref: Reference) -> tuple[str, ResourceSource]:
        """The spec's source a ``huggingface`` reference names, with the executor's file choice."""
        dispatch = self.ctx.dispatch
        for name, spec in dispatch.profile.job.sources(dispatch.spec).items():
            source = ResourceSource.from_proto(spec)
            if not source.empty and ref.repository in (source.repository, source.local_path):
                patterns = tuple(f for f in ref.filenames if f != "*")
                return name, ResourceSource(
                    source.repository,
                    ref.revision or source.revision,
                    patterns,
                    source.token,
                    source.local_path,
                )
        raise ReferenceBridgeError(INVALID_REQUEST, f"`{ref.repository}` is not a resource of this job")

    async def _fetch_artifact(self, ref: Reference, artifacts: Path) -> list[dict[str, Any]]:
        if self.ctx.resources is None:
            raise ReferenceBridgeError(CONNECTOR_ERROR, "this worker cannot fetch models")
        name, source = self._source_of(ref)
        self.ctx.logs.line("system", f"fetching {name} {ref.repository} for the executor")
        fetched = await self.ctx.resources.fetch(source, self.work_dir / "resources" / f"reference-{name}")
        return await asyncio.to_thread(_place_tree, fetched, artifacts, self.work_dir)

    async def _next_slice(self, artifacts: Path) -> list[dict[str, Any]]:
        # Asking for the next slice means the trainer is done with the ones handed before.
        self._release_handed()
        pause = Backoff(0.05, 1.0)
        while True:
            handed = await self.bridge.slices.next()
            if handed is not None:
                break
            if self._done:
                raise ReferenceBridgeError(CONNECTOR_ERROR, "the job needs no more data")
            await asyncio.sleep(pause.next_delay())
        index, _epoch, path = handed
        self._handed.append(index)
        target = artifacts / str(index)
        size = await asyncio.to_thread(link_private, path, target)
        return [{"path": f"{ARTIFACTS}/{index}", "size": size}]

    def _release_handed(self) -> None:
        if self._handed:
            for index in self._handed:
                (self.work_dir / ARTIFACTS / str(index)).unlink(missing_ok=True)
            self.bridge.slices.mark_used(self._handed)
            self._handed = []

    # ---- status -------------------------------------------------------------------------

    async def _status(self, request: web.Request) -> web.Response:
        progress = parse_progress(await self._body(request))
        self.rounds.start()
        if progress.kind == "status":
            return web.json_response(await self._batch(progress.batch_size))
        if progress.kind == "metrics":
            await self._metrics(progress.metrics)
            return web.json_response({"type": "Ok"})
        if progress.kind == "update":
            self._release_handed()
            return web.json_response({"type": "Ok"})
        if progress.kind == "update-received":
            rounds = self.rounds.rounds
            finished = self._done or (rounds > 0 and self.round >= rounds)
            return web.json_response({"type": "Done" if finished else "Continue"})
        return web.json_response({"type": "Ok"})  # "updated": a parameter server's, nothing to do

    async def _batch(self, batch_size: int) -> dict[str, Any]:
        now = time.monotonic()
        seconds = 0.0 if self._last_status is None else now - self._last_status
        self._last_status = now
        self.batches = min(self.batches + 1, UINT32_MAX)
        self.samples += batch_size
        directive = await self.ctx.link.progress(
            scheduler_pb2.ProgressReport(
                job_id=self.ctx.dispatch.job_id,
                round=self.round,
                batches=self.batches,
                samples=self.samples,
                loss=self.last_loss,
                batch_seconds=seconds,
                batch_size=batch_size,
            )
        )
        kind = DirectiveKind.from_proto(directive.kind) or DirectiveKind.CONTINUE
        if kind is DirectiveKind.DONE:
            self._done = True
            return {"type": "Done"}
        if kind is DirectiveKind.SYNC_NOW:
            return {"type": "ScheduleUpdate", "counter": 0}
        if kind is DirectiveKind.SYNC_AFTER:
            return {"type": "ScheduleUpdate", "counter": int(directive.batches)}
        return {"type": "Continue"}

    async def _metrics(self, metrics: dict[str, float]) -> None:
        if "loss" in metrics:
            self.last_loss = metrics["loss"]
        pushed, pulled = self.ctx.exchange.job_bytes(self.ctx.dispatch.job_id)
        measured = {"tensor_bytes_pushed": float(pushed), "tensor_bytes_pulled": float(pulled)}
        await self.ctx.link.metrics(
            scheduler_pb2.MetricsReport(
                job_id=self.ctx.dispatch.job_id,
                round=max(0, self.round - 1),  # the round whose update was just sent
                values={**metrics, **(measured if pushed or pulled else {})},
            )
        )

    async def _send(self, request: web.Request) -> web.Response:
        ref, rel = parse_transfer(await self._body(request), receive=False)
        assert rel is not None
        path = safe_join(self.work_dir, rel)
        self.rounds.send(ref.peers, path, self.round, self.samples)
        # The round is over for this trainer: the next reports count toward the following one.
        self.round, self.batches, self.samples = self.round + 1, 0, 0
        self._release_handed()
        return web.Response(status=200)

    # ---- receive ------------------------------------------------------------------------

    async def _receive(self, request: web.Request) -> web.StreamResponse:
        _ref, rel = parse_transfer(await self._body(request), receive=True)
        rel = (rel or "incoming").rstrip("/")
        directory = safe_join(self.work_dir, rel)
        await asyncio.to_thread(directory.mkdir, mode=0o700, parents=True, exist_ok=True)
        self.rounds.start()
        queue = self.rounds.subscribe()
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(request)
            while not self.rounds.closing.is_set():
                update = await self.rounds.next_update(queue, KEEPALIVE_S)
                if update is None:
                    await response.write(SSE_KEEPALIVE)
                    continue
                name = update.from_peer or "update"
                size = await asyncio.to_thread(link_private, update.staged, directory / name)
                await response.write(
                    sse_event({"path": f"{rel}/{name}", "size": size, "from_peer": update.from_peer})
                )
        except ConnectionResetError:
            pass  # the executor went away
        finally:
            self.rounds.unsubscribe(queue)
        return response


def _place_tree(fetched: Path, artifacts: Path, work_dir: Path) -> list[dict[str, Any]]:
    """Every file fetched, placed under ``artifacts/`` by its relative path; the reference's answer."""
    out: list[dict[str, Any]] = []
    for source in sorted(p for p in fetched.rglob("*") if p.is_file()):
        target = artifacts / source.relative_to(fetched)
        size = link_private(source, target)
        out.append({"path": str(target.relative_to(work_dir.resolve())), "size": size})
    return out


__all__ = ["ReferenceRoutes"]
