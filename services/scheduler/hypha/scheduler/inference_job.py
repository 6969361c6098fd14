"""Inference jobs: a model run over a dataset or inline inputs on one leased worker, scored.

Driven like a task job (``hypha.scheduler.task_job``, whose attempt handling
it reuses: the end of an attempt is a status report, the lease's loss, a
backstop poll or the timeout): lease one ``inference`` worker by the job's
requirements, price and policy (nothing offered puts the job back PENDING,
pausing longer each time), dispatch, wait, then pull the result
(``outputs.jsonl`` + ``metrics.json``) into the scheduler's state dir so
``hypha fetch`` serves it. The executor reports its figures as round-0
metrics (``GetJobMetrics``, ``hypha status``).

Where the inputs and the model come from:

- ``dataset``: its providers are looked up in the DHT as for a DiLoCo job;
  ``next_slice`` hands the worker every slice once, in order, then none.
- ``model_job``: a SUCCEEDED job of this scheduler; its kept result is
  packed (``hypha.bundles``, a tar.gz named by ``model_bundle_sha256`` in the
  dispatched spec) and pushed to the execution right after the dispatch as
  the tensor kind ``model`` (chunked and verified like a parameter server's
  state, so any size), where the executor unpacks it.

Decisions (NOTE):
- A lost worker (or a failed dispatch) is tried again on a fresh lease, up
  to ``MAX_ATTEMPTS`` attempts, with the slices handed out from the start;
  the executor failing (a bad model, a dataset of the wrong kind) fails the
  job at once with its message: it would fail again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from hypha import bundles
from hypha.bundles import BundleStore
from hypha.errors import HyphaError, NotFoundError
from hypha.market.allocator import HeldLease
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.providers import DatasetProviders, provider_peer
from hypha.scheduler.results import keep_result, result_dir
from hypha.scheduler.retry import AttemptEnd, Outcome
from hypha.scheduler.runs import JobFailed, RunRegistry
from hypha.scheduler.store import JobRecord
from hypha.scheduler.task_job import TaskRun
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2

#: Attempts on fresh leases after losing a worker, before the job fails.
MAX_ATTEMPTS = 3
#: Tensor kind the model job's packed result is pushed as (``hypha.worker.jobs_servicer.MODEL_KIND``).
MODEL_KIND = "model"
#: Largest packed model result (compressed).
MAX_MODEL_BYTES = 8 << 30


class InferenceRun(TaskRun):
    """An inference job while it runs: its attempt, its worker and the slices handed out."""

    kind = "inference"

    def __init__(
        self, job: JobRecord, runs: RunRegistry, providers: DatasetProviders | None, state_dir: Path
    ) -> None:
        super().__init__(job, runs, BundleStore(state_dir / bundles.BUNDLES_DIR), state_dir)
        self.providers = providers
        self.data_providers: list[common_pb2.PeerInfo] = []
        self.slice_count = 0
        self.next_index = 0
        self.model_bundle = b""

    @property
    def inference(self) -> common_pb2.InferenceJobSpec:
        return self.spec.inference

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse:
        dataset = self.inference.dataset
        if worker_id != self.worker_id or self.next_index >= self.slice_count:
            return scheduler_pb2.NextSliceResponse(available=False, dataset=dataset)
        index, self.next_index = self.next_index, self.next_index + 1
        return scheduler_pb2.NextSliceResponse(
            available=True, index=index, dataset=dataset, providers=self.data_providers
        )

    what = "inference worker"
    succeeded_reason = "inference done"

    @property
    def terms(self) -> common_pb2.InferenceJobSpec:
        return self.inference

    async def _after_failure(self, ended: Outcome, code: int, described: str) -> bool:
        """A lost worker is tried again on a fresh lease (up to ``MAX_ATTEMPTS``); anything else
        would fail again."""
        if ended is not Outcome.WORKER_LOST or self.attempt >= MAX_ATTEMPTS:
            raise JobFailed(f"inference attempt {self.attempt}: {described}")
        await self.runs.store.transition(
            self.job_id,
            JobState.PENDING,
            expected=JobState.RUNNING,
            reason=f"attempt {self.attempt}: {described}; trying another worker",
            not_before=time.time(),
        )
        return True

    async def _prepare(self) -> None:
        """Find the dataset's providers and pack the model job's result, before any lease is held."""
        spec = self.inference
        if spec.dataset:
            if self.providers is None:
                raise JobFailed(
                    f"cannot look up dataset {spec.dataset!r}: scheduler.dht_bootstrap is not configured"
                )
            records = await self.providers.find_within(
                spec.dataset, self.runs.jobs_cfg.provider_wait_s, self.runs.clock
            )
            if not records:
                raise JobFailed(f"no data node serves dataset {spec.dataset!r}")
            self.data_providers = [provider_peer(record) for record in records]
            self.slice_count = max(record.slice_count for record in records)
        if spec.model_job:
            self.model_bundle = await self._pack_model(spec.model_job)

    async def _pack_model(self, model_job: str) -> bytes:
        found = await self.runs.store.find(model_job)
        if found is None or found.state is not JobState.SUCCEEDED:
            state = "unknown" if found is None else found.state.value
            raise JobFailed(
                f"model_job {model_job}: must be a succeeded job of this scheduler (it is {state})"
            )
        source = Path(found.result_path) if found.result_path else result_dir(self.state_dir, model_job)
        try:
            names = await asyncio.to_thread(lambda: sorted(p.name for p in source.iterdir()))
            if not names:
                raise NotFoundError("its result is empty")
            return await asyncio.to_thread(bundles.pack, names, source, limit=MAX_MODEL_BYTES)
        except (OSError, HyphaError) as err:
            reason = err.message if isinstance(err, HyphaError) else str(err)
            raise JobFailed(f"model_job {model_job}: its result cannot be shipped: {reason}") from err

    async def _attempt(self, lease: HeldLease, attempt: int, timeout_s: float) -> AttemptEnd:
        """Dispatch attempt ``attempt`` (the job goes RUNNING) and wait for its end."""
        self.attempt, self.worker_id, self.next_index = attempt, lease.worker_id, 0
        self.outcome = asyncio.get_running_loop().create_future()
        spec = common_pb2.JobSpec()
        spec.CopyFrom(self.spec)
        if self.model_bundle:
            spec.inference.model_bundle_sha256 = bundles.sha256_hex(self.model_bundle)

        async def send() -> None:
            await self.runs.calls.dispatch(
                lease.worker_id,
                worker_pb2.DispatchJobRequest(
                    job_id=self.job_id,
                    lease_id=lease.lease_id,
                    executor=common_pb2.EXECUTOR_KIND_INFERENCE,
                    spec=spec,
                    attempt=attempt,
                    scheduler_addresses=self.runs.market.addresses(),
                ),
            )
            if self.model_bundle:
                await self._push_model(lease.worker_id)

        return await self._run_dispatched(lease, attempt, timeout_s, send)

    async def _push_model(self, worker_id: str) -> None:
        """The model job's packed result into the execution's inbox (it waits for it)."""
        reply = await self.runs.calls.push_tensors(
            worker_id,
            self.job_id,
            MODEL_KIND,
            0,
            bundles.as_payload(self.model_bundle),
            self.runs.jobs_cfg.result_timeout_s,
        )
        if not reply.accepted:
            raise JobFailed(
                f"{worker_id} refused the model of model_job {self.inference.model_job}: {reply.message}"
            )

    async def _pull_outputs(self, worker_id: str) -> str:
        """The result (outputs.jsonl, metrics.json), pulled into the scheduler's result dir."""
        failure = "the inference succeeded, but its outputs could not be kept: "
        return str(await keep_result(self.runs, worker_id, self.job_id, self.state_dir, failure=failure))


__all__ = ["MAX_ATTEMPTS", "InferenceRun"]
