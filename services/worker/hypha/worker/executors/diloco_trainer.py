"""The ``diloco-trainer`` executor: inner steps on local slices, Δ to the parameter server each round.

    python -m hypha.worker.executors.diloco_trainer

The worker starts it with the job bridge's socket in ``HYPHA_BRIDGE_SOCKET``.
One round, from the trainer's side:

1. take slices from the bridge (the scheduler assigns them), cut them into
   batches of this worker's batch size, run one AdamW step per batch and
   report progress after the round's first batch, then after a batch at most
   every ``report_interval_s`` (a quarter second by default); the reply is the
   scheduler's directive, read after the next batch (the report travels while
   it trains, ``reports``);
2. on ``sync_after K`` run K more batches (counted from the reported one),
   on ``sync_now`` stop after the batch in flight, and
   sync: send Δ = θ_local - θ_global for the samples of this round to the
   parameter server (in the job's ``delta_dtype``; int8 and top-k keep the
   compression residual and add it to the next round's Δ, see
   docs/compression.md), then wait for the round's update (the new θ_global)
   and set the model to it;
3. checkpoint (model, inner optimizer, round) so a restarted trainer resumes
   here, then start the next round; the checkpoint is a copy of the state
   written in a thread while that round trains, at most every
   ``checkpoint_interval_s`` (a minute by default) and always after the last
   round (``checkpoint_writer``).

``done``, or reaching the job's round count, ends the process with 0.

Streaming (``streaming_fragments`` F >= 2, docs/compression.md): round r
syncs fragment r mod F only; ``overlap_sync`` runs whole-model rounds the same
way, as one fragment that is the whole model. Its Δ (with the samples since the fragment's
last sync) leaves in a background task, which also waits for the fragment's
new θ_global, while the trainer goes on with round r+1 (inner steps run in a
thread so the exchange proceeds meanwhile). The update is merged between two
steps as soon as it arrives (``rebase_fragment``: θ_global plus the progress
made since the send). At most one fragment is in flight: the next sync first
waits for it. Each round's metrics carry ``sync_idle_seconds``, the time
training stood still at the sync point (for whole-model rounds: Δ, send and
the wait for the update), and ``delta_bytes``.

Decisions (NOTE):
- The inner optimizer's state carries across rounds (as in DiLoCo); only the
  parameters are reset to θ_global.
- A trainer joining late (``start_round`` > 0) or restarting pulls the
  current θ_global ("global") before its first step, and takes the round
  that state belongs to from the payload's metadata.
- Waiting for an update, the trainer re-sends its delta after each fetch
  timeout; the final round's update it tries for only a few times
  (``ps_link``).
- ``sync_after K`` that arrives while counting down keeps the smaller count, so a
  scheduler that repeats its directive cannot postpone the sync forever.
- The checkpoint is written in the background, while the next round trains,
  and not every round when rounds are short (``checkpoint_writer``).
- Every inner step runs on one thread of its own, never on the shared pool
  that ``asyncio.to_thread`` uses for file work: a step that moves from thread
  to thread was ~7 % slower (a 0.85M-parameter GPT-2 on the CPU, 29.1 against
  26.9 ms a batch; docs/performance.md).
- The bridge answering "unavailable" (the scheduler or the parameter server's
  worker cannot be reached for now) never ends the job: a progress report
  counts as ``continue``, a slice request as "no data yet", a delta or an
  update is tried again; anything else the bridge refuses is fatal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from hypha import factories, models
from hypha.directives import DirectiveKind
from hypha.errors import InvalidArgumentError
from hypha.net.backoff import Backoff
from hypha.worker.executors import process
from hypha.worker.executors.batches import BatchStream, batch_rows, to_device
from hypha.worker.executors.bridge_api import Bridge
from hypha.worker.executors.checkpoint_writer import DEFAULT_CHECKPOINT_INTERVAL_S, CheckpointWriter
from hypha.worker.executors.diloco_settings import (
    InnerSettings,
    delta_encoder,
    diloco_spec,
    make_inner_optimizer,
)
from hypha.worker.executors.global_sync import FragmentUpdate, GlobalSync
from hypha.worker.executors.inner_steps import train_step
from hypha.worker.executors.ps_link import ParameterServerLink
from hypha.worker.executors.reports import (
    DEFAULT_REPORT_INTERVAL_S,
    ReportPipe,
    RoundStats,
    report_metrics,
    report_progress,
)
from hypha.worker.executors.slice_feed import SliceFeed
from hypha.worker.executors.trainer_state import TrainerState, load_trainer_state

logger = logging.getLogger("hypha.worker.executors.diloco_trainer")

DEFAULT_BATCH_SIZE = 8


@dataclass
class TrainerOptions:
    """Waits and retries; the defaults suit a real cluster, tests shrink them."""

    #: One bridge fetch of the round's update (the bridge holds the call open until then).
    fetch_timeout_s: float = 60.0
    #: Give up on a round's update (and fail the job) after waiting this long in all.
    update_patience_s: float = 3600.0
    #: Poll interval bounds while the scheduler has no slice for this worker.
    idle_min_s: float = 0.05
    idle_max_s: float = 2.0
    #: Where the inner steps run; None: the first GPU the worker assigned, else the CPU.
    device: str | None = None
    #: Least time between two progress reports within a round (``reports``); 0: every batch.
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S
    #: Least time between two checkpoints (``checkpoint_writer``); 0: every round.
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S
    clock: Callable[[], float] = field(default=time.monotonic)


class DilocoTrainer:
    """One trainer process's job, driven entirely through ``bridge``."""

    def __init__(self, bridge: Bridge, work_dir: Path | None = None, options: TrainerOptions | None = None):
        self.bridge = bridge
        self.options = options or TrainerOptions()
        self._work_dir_arg = work_dir
        self.round_number = 0
        self.samples_total = 0
        #: Mean training loss of each completed round, in order (also reported as metrics).
        self.round_losses: list[float] = []
        self.model: nn.Module | None = None
        #: θ_global and the exchange with the parameter server (set once the job is known).
        self._global_sync: GlobalSync | None = None
        self._inflight: _InFlight | None = None
        #: Batches trained by this process, in all: how late an overlapped update landed.
        self._batches_done = 0
        #: The checkpoint at round boundaries, written in a thread (module NOTE).
        self._checkpoints = CheckpointWriter(self.options.checkpoint_interval_s, self.options.clock)
        #: The progress report travelling while the next batch trains.
        self._reports = ReportPipe(self.options.report_interval_s, self.options.clock)
        #: Where batches come from (set once the job is known).
        self._feed: SliceFeed | None = None
        #: The one thread every inner step runs on (module NOTE).
        self._steps = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hypha-train")

    @property
    def fragments(self) -> list[list[str]] | None:
        """Streaming fragments (parameter names), None for whole-model rounds."""
        return None if self._global_sync is None else self._global_sync.fragments

    @property
    def streaming(self) -> bool:
        """True when syncs run in the background (fragments, or one overlapped whole model)."""
        return self.fragments is not None

    async def run(self) -> int:
        """Train until the job is done; the process exit code."""
        try:
            await self._run()
        except process.FAILURES as exc:
            self._reports.cancel()
            if self._feed is not None:
                self._feed.cancel()
            self._cancel_inflight()
            await self._checkpoints.settled(quiet=True)
            return await process.report_failure(self.bridge, "trainer", exc)
        finally:
            self._steps.shutdown(wait=False)  # a step still running ends with its batch
        return 0

    async def _run(self) -> None:
        bridge = self.bridge
        job = await bridge.job()
        spec = diloco_spec(job.spec)
        self.work_dir = Path(self._work_dir_arg or job.work_dir)
        self.ps = job.parameter_server_id
        if not self.ps:
            raise InvalidArgumentError("the job names no parameter server")
        self.kind = models.model_kind(spec.model)
        self.rounds = int(spec.rounds)
        # NOTE: the error-feedback residual lives in memory only; a restarted trainer starts
        # with none, which loses at most one round's compression error.
        self.encoder = delta_encoder(spec)
        batch_size = int(job.batch_size or spec.max_batch_size or DEFAULT_BATCH_SIZE)

        model_dir = await bridge.fetch_resource("model")
        model = await asyncio.to_thread(
            models.build_model, spec.model, model_dir, factories_allowed=factories.from_env()
        )
        device = torch.device(self.options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model.to(device)
        self.model = model
        inner = InnerSettings.from_proto(spec.inner_optimizer)
        optimizer = make_inner_optimizer(model, inner)
        self._global_sync = GlobalSync(
            ParameterServerLink(
                bridge, self.ps, self.options, job_goes_on=partial(self._job_goes_on, batch_size)
            ),
            self.encoder,
            self.work_dir,
            model,
            int(spec.streaming_fragments),
            overlap=spec.overlap_sync,
        )
        checkpoint_dir = self.work_dir / "trainer-state"
        resumed = load_trainer_state(checkpoint_dir, model, optimizer)
        self.round_number = max(int(job.start_round), resumed.round_number if resumed else 0)
        self.samples_total = resumed.samples_total if resumed else 0
        if (
            self.round_number > 0
            or resumed is not None
            or int(job.attempt) > 0
            or not models.has_pretrained_weights(spec.model, model_dir)
        ):
            await self._join()

        feed = self._feed = SliceFeed(bridge, BatchStream(batch_size, models.MODEL_INPUTS.get(self.kind)))
        stats = RoundStats()
        countdown: int | None = None
        idle = Backoff(self.options.idle_min_s, self.options.idle_max_s)
        reports = self._reports
        while not self._finished():
            batch = await feed.next_batch()
            if batch is None:
                # No data for now: a zero-batch progress report still fetches the directive.
                await feed.settle()
                await reports.settle()
                kind, _ = await self._report(stats, batch_size)
                if kind is DirectiveKind.DONE:
                    break
                if kind is DirectiveKind.SYNC_NOW or (kind is DirectiveKind.SYNC_AFTER and stats.batches):
                    await self._sync(stats, model, optimizer, checkpoint_dir)
                    stats, countdown = RoundStats(), None
                    continue
                await asyncio.sleep(idle.next_delay())
                continue
            idle.reset()

            started = time.perf_counter()
            feed.fetch_ahead()
            # Off the event loop: the last batch's progress report, the next slice (and,
            # streaming, the fragment in flight) move while this one trains.
            loss = await asyncio.get_running_loop().run_in_executor(
                self._steps, train_step, model, optimizer, self.kind, to_device(batch, device), inner
            )
            elapsed = time.perf_counter() - started
            self._batches_done += 1
            stats.batches += 1
            stats.samples += batch_rows(batch)
            stats.loss_sum += loss
            stats.train_seconds += elapsed
            stats.last_batch_seconds = elapsed
            await feed.tell_used()
            if countdown is not None:
                countdown -= 1
            answer = reports.answer()
            if answer is not None:
                if answer.kind is DirectiveKind.DONE:
                    break
                countdown = _sooner(countdown, answer.countdown(stats.batches))
            if countdown is not None and countdown <= 0:
                # The round's last batch: its report is awaited (the scheduler sees the
                # round end, and its slices, before the delta) and may still say the job is done.
                await feed.settle()
                await reports.settle()
                kind, _ = await self._report(stats, batch_size)
                if kind is DirectiveKind.DONE:
                    break
                await self._sync(stats, model, optimizer, checkpoint_dir)
                stats, countdown = RoundStats(), None
                continue
            reports.send(stats.batches, partial(self._report, replace(stats), batch_size, ahead=True))
            if self._inflight is not None and self._inflight.task.done():
                await self._land(model, optimizer, checkpoint_dir)

        feed.cancel()  # a slice fetched ahead stays unused, as a stopped worker's would
        await reports.settle()
        if self._finished():
            await self._land(model, optimizer, checkpoint_dir)  # the final fragment's update, if served
        else:
            self._cancel_inflight()  # told "done" early: the job needs nothing more from this trainer
        if self._checkpoints.behind:  # the last round boundary was not written (checkpoint_writer)
            state = TrainerState(self.round_number, self.samples_total)
            await self._checkpoints.write(checkpoint_dir, model, optimizer, state, last=True)
        await self._checkpoints.settled()
        await bridge.status(
            "succeeded", f"trained to round {self.round_number}, {self.samples_total} samples"
        )

    async def _report(
        self, stats: RoundStats, batch_size: int, *, ahead: bool = False
    ) -> tuple[DirectiveKind, int]:
        """Report the round's progress (``reports``); the scheduler's directive and its batch count."""
        return await report_progress(self.bridge, self.round_number, stats, batch_size, ahead=ahead)

    async def _job_goes_on(self, batch_size: int) -> bool:
        """Whether the scheduler still runs the job (anything but "done"; an error counts as over)."""
        try:
            kind, _ = await self._report(RoundStats(), batch_size)
        except Exception as exc:
            logger.info("the scheduler did not say whether the job goes on (%s): taking it as over", exc)
            return False
        return kind is not DirectiveKind.DONE

    def _finished(self) -> bool:
        return self.rounds > 0 and self.round_number >= self.rounds

    def _final(self, round_number: int) -> bool:
        """Whether ``round_number`` is the job's last (its update may no longer be served)."""
        return self.rounds > 0 and round_number + 1 >= self.rounds

    async def _join(self) -> None:
        """Pull θ_global before training: this trainer is late, restarted, or has no fixed θ_0."""
        assert self.model is not None and self._global_sync is not None
        meta_round = await self._global_sync.join(self.model, self.round_number)
        if meta_round is not None:
            self.round_number = max(self.round_number, meta_round)
        logger.info("joined at round %d with the parameter server's θ_global", self.round_number)

    async def _sync(
        self, stats: RoundStats, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path
    ) -> None:
        if self.streaming:
            await self._sync_fragment(stats, model, optimizer, checkpoint_dir)
            return
        assert self._global_sync is not None
        sync_started = time.perf_counter()
        round_number = self.round_number
        delta_bytes = await self._global_sync.sync_model(
            model, round_number, stats.samples, final=self._final(round_number)
        )
        self.samples_total += stats.samples
        self.round_losses.append(stats.mean_loss)
        await report_metrics(
            self.bridge, round_number, stats, time.perf_counter() - sync_started, delta_bytes
        )
        self.round_number = round_number + 1
        await self._checkpoints.write(
            checkpoint_dir,
            model,
            optimizer,
            TrainerState(self.round_number, self.samples_total),
            last=self._finished(),
        )

    # ---- streaming: one fragment per round, in flight while training goes on ---------------

    async def _sync_fragment(
        self, stats: RoundStats, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path
    ) -> None:
        """Send round r's fragment in the background; idle only while the previous one lands."""
        assert self._global_sync is not None
        sync_started = time.perf_counter()
        if self._inflight is not None:  # at most one fragment in flight: wait for the previous one
            await asyncio.wait([self._inflight.task])
        waited_s = time.perf_counter() - sync_started
        await self._land(model, optimizer, checkpoint_dir)  # its checkpoint is not idle time (as for rounds)
        sync_started = time.perf_counter()
        round_number = self.round_number
        sent, task = self._global_sync.send_fragment(
            model, round_number, stats.samples, final=self._final(round_number)
        )
        # The round's metrics go out when it lands (its delta's size is known then).
        self._inflight = _InFlight(
            round_number, sent, task, stats, waited_s + time.perf_counter() - sync_started, self._batches_done
        )
        self.samples_total += stats.samples
        self.round_losses.append(stats.mean_loss)
        self.round_number = round_number + 1

    async def _land(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path) -> None:
        """Wait for the fragment in flight (if any), merge its θ_global, report its round, checkpoint."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        params, size = await inflight.task
        # How many batches trained on while the update was on its way (0: it was awaited).
        lag = {"update_lag_batches": float(self._batches_done - inflight.sent_after)}
        await report_metrics(
            self.bridge, inflight.round_number, inflight.stats, inflight.idle_s, size, extra=lag
        )
        if params is not None:
            assert self._global_sync is not None
            self._global_sync.merge_fragment(model, inflight.sent, params)
        await self._checkpoints.write(
            checkpoint_dir,
            model,
            optimizer,
            TrainerState(inflight.round_number + 1, self.samples_total),
            last=self._final(inflight.round_number),
        )

    def _cancel_inflight(self) -> None:
        if self._inflight is not None:
            self._inflight.task.cancel()
            self._inflight = None


@dataclass
class _InFlight:
    """A streaming fragment on its way: round, local values sent, the exchange, the round's figures."""

    round_number: int
    sent: dict[str, torch.Tensor]
    task: asyncio.Task[FragmentUpdate]
    stats: RoundStats
    idle_s: float
    #: The trainer's batch count when it was sent (``_batches_done``).
    sent_after: int


def _sooner(countdown: int | None, other: int | None) -> int | None:
    """The smaller countdown: a repeated ``sync_after`` never postpones the sync."""
    if countdown is None:
        return other
    return countdown if other is None else min(countdown, other)


def main() -> None:
    process.main(lambda bridge: DilocoTrainer(bridge).run())


if __name__ == "__main__":
    main()
