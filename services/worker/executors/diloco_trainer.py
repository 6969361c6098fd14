"""The ``diloco-trainer`` executor: inner steps on local slices, Δ to the parameter server each round.

    python -m hypha.worker.executors.diloco_trainer

The worker starts it with the job bridge's socket in ``HYPHA_BRIDGE_SOCKET``.
One round, from the trainer's side:

1. take slices from the bridge (the scheduler assigns them), cut them into
   batches of this worker's batch size, run one AdamW step per batch and
   report progress after each; the reply is the scheduler's directive;
2. on ``sync_after K`` run K more batches, on ``sync_now`` stop at once, and
   sync: send Δ = θ_local - θ_global for the samples of this round to the
   parameter server, then wait for the round's update (the new θ_global) and
   set the model to it;
3. checkpoint (model, inner optimizer, round) so a restarted trainer resumes
   here, then start the next round.

``done``, or reaching the job's round count, ends the process with 0.

Decisions (NOTE):
- The inner optimizer's state carries across rounds (as in DiLoCo); only the
  parameters are reset to θ_global.
- A trainer joining late (``start_round`` > 0) or restarting pulls the
  current θ_global ("global") before its first step, and takes the round
  that state belongs to from the payload's metadata.
- While waiting for an update the trainer re-sends its delta after each
  fetch timeout: a parameter server that restarted lost the round in
  progress and collects it afresh; a duplicate is ignored there.
- After the final round's delta the trainer tries for the update only a few
  times: the job's result lives at the parameter server, which may already be
  gone.
- ``sync_after K`` that arrives while counting down keeps the smaller count, so a
  scheduler that repeats its directive cannot postpone the sync forever.
- The bridge answering "unavailable" (the scheduler or the parameter server's
  worker cannot be reached for now) never ends the job: a progress report
  counts as ``continue``, a slice request as "no data yet", a delta or an
  update is tried again; anything else the bridge refuses is fatal.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hypha.errors import HyphaError, InvalidArgumentError, UnavailableError
from hypha.tensors.payload import read_metadata
from hypha.worker.executors import models
from hypha.worker.executors.training import (
    DELTA,
    GLOBAL,
    GLOBAL_ROUND_KEY,
    MODEL_INPUTS,
    UPDATE,
    Batch,
    BatchStream,
    Bridge,
    DirectiveKind,
    InnerSettings,
    TrainerState,
    apply_global,
    batch_rows,
    compute_delta,
    decode_global,
    delta_wire_dtype,
    diloco_spec,
    encode_delta,
    load_slice,
    load_trainer_state,
    make_inner_optimizer,
    parameter_state,
    save_trainer_state,
    send_outcome,
    to_device,
    train_step,
)

logger = logging.getLogger("hypha.worker.executors.diloco_trainer")

DEFAULT_BATCH_SIZE = 8
#: Fetches of the final round's update before the trainer ends without it.
FINAL_UPDATE_TRIES = 3


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
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass
class RoundStats:
    """What this worker did in the current round (reset at each sync)."""

    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    train_seconds: float = 0.0
    last_batch_seconds: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.batches if self.batches else math.nan


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
        self._theta_global: dict[str, torch.Tensor] = {}

    async def run(self) -> int:
        """Train until the job is done; the process exit code."""
        try:
            await self._run()
        except (HyphaError, OSError, RuntimeError, ValueError) as exc:
            message = exc.message if isinstance(exc, HyphaError) else f"{type(exc).__name__}: {exc}"
            logger.error("trainer failed: %s", message)
            await self._report_failure(message)
            return 1
        return 0

    async def _report_failure(self, message: str) -> None:
        try:
            await self.bridge.status("failed", message)
        except Exception as exc:  # the bridge itself may be what failed
            logger.warning("could not report the failure to the bridge: %s", exc)

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
        self.dtype = delta_wire_dtype(spec)
        batch_size = int(job.batch_size or spec.max_batch_size or DEFAULT_BATCH_SIZE)

        model_dir = await bridge.fetch_resource("model")
        model = await asyncio.to_thread(models.build_model, spec.model, model_dir)
        device = torch.device(self.options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model.to(device)
        self.model = model
        optimizer = make_inner_optimizer(model, InnerSettings.from_proto(spec.inner_optimizer))
        self._theta_global = parameter_state(model)
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

        stream = BatchStream(batch_size, MODEL_INPUTS.get(self.kind))
        stats = RoundStats()
        countdown: int | None = None
        idle_s = self.options.idle_min_s
        while not self._finished():
            batch = await self._next_batch(stream)
            if batch is None:
                # No data for now: a zero-batch progress report still fetches the directive.
                kind, _ = await self._report(stats, batch_size)
                if kind is DirectiveKind.DONE:
                    break
                if kind is DirectiveKind.SYNC_NOW or (kind is DirectiveKind.SYNC_AFTER and stats.batches):
                    await self._sync(stats, model, optimizer, checkpoint_dir)
                    stats, countdown = RoundStats(), None
                    continue
                await asyncio.sleep(idle_s)
                idle_s = min(idle_s * 2, self.options.idle_max_s)
                continue
            idle_s = self.options.idle_min_s

            started = time.perf_counter()
            loss = train_step(model, optimizer, self.kind, to_device(batch, device))
            elapsed = time.perf_counter() - started
            stats.batches += 1
            stats.samples += batch_rows(batch)
            stats.loss_sum += loss
            stats.train_seconds += elapsed
            stats.last_batch_seconds = elapsed
            used = stream.take_consumed()
            if used:
                await bridge.slices_used(used)
            if countdown is not None:
                countdown -= 1
            kind, more = await self._report(stats, batch_size)
            if kind is DirectiveKind.DONE:
                break
            if kind is DirectiveKind.SYNC_NOW:
                countdown = 0
            elif kind is DirectiveKind.SYNC_AFTER:
                countdown = more if countdown is None else min(countdown, more)
            if countdown is not None and countdown <= 0:
                await self._sync(stats, model, optimizer, checkpoint_dir)
                stats, countdown = RoundStats(), None

        await bridge.status(
            "succeeded", f"trained to round {self.round_number}, {self.samples_total} samples"
        )

    async def _report(self, stats: RoundStats, batch_size: int) -> tuple[DirectiveKind, int]:
        """Report the round's progress; the scheduler's directive and its batch count.

        An unreachable scheduler is not fatal: training continues and the next
        report asks again.
        """
        try:
            directive = await self.bridge.progress(
                round=self.round_number,
                batches=stats.batches,
                samples=stats.samples,
                loss=_finite(stats.mean_loss),
                batch_seconds=stats.last_batch_seconds,
                batch_size=batch_size,
            )
        except UnavailableError as exc:
            _raise_if_bridge_gone(exc)
            logger.warning("progress report failed: %s; continuing", exc.message)
            return DirectiveKind.CONTINUE, 0
        try:
            kind = DirectiveKind(directive.kind)
        except ValueError:
            logger.warning("unknown directive %r; continuing", directive.kind)
            kind = DirectiveKind.CONTINUE
        return kind, max(0, int(directive.batches))

    def _finished(self) -> bool:
        return self.rounds > 0 and self.round_number >= self.rounds

    async def _next_batch(self, stream: BatchStream) -> Batch | None:
        """The next full batch, pulling slices as needed; a short one when the slices run dry."""
        while (batch := stream.next_batch()) is None:
            try:
                info = await self.bridge.next_slice()
            except UnavailableError as exc:
                _raise_if_bridge_gone(exc)
                logger.warning("no slice for now: %s", exc.message)
                info = None
            if info is None:
                return stream.flush()
            tensors = await asyncio.to_thread(load_slice, info.path)
            stream.add_slice(int(info.index), tensors)
        return batch

    async def _join(self) -> None:
        """Pull θ_global before training: this trainer is late, restarted, or has no fixed θ_0."""
        data = await self._await_tensors(GLOBAL, self.round_number, resend=None)
        assert self.model is not None
        params = decode_global(data, self._theta_global)
        apply_global(self.model, params)
        self._theta_global = params
        meta_round = read_metadata(data).get(GLOBAL_ROUND_KEY)
        if meta_round is not None and meta_round.isdigit():
            self.round_number = max(self.round_number, int(meta_round))
        logger.info("joined at round %d with the parameter server's θ_global", self.round_number)

    async def _sync(
        self, stats: RoundStats, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path
    ) -> None:
        round_number = self.round_number
        delta_path: Path | None = None
        if stats.samples > 0:
            delta = compute_delta(model, self._theta_global)
            blob = encode_delta(delta, self.dtype, round_number, stats.samples)
            del delta
            delta_path = self.work_dir / f"delta-{round_number:08d}.safetensors"
            await asyncio.to_thread(delta_path.write_bytes, blob)
            del blob
            await self._send_delta(delta_path, round_number, stats.samples)
        final = self.rounds > 0 and round_number + 1 >= self.rounds
        resend = None if delta_path is None else (delta_path, stats.samples)
        try:
            data = await self._await_tensors(
                UPDATE, round_number, resend=resend, tries=FINAL_UPDATE_TRIES if final else None
            )
        except UnavailableError:
            if not final:
                raise
            logger.info(
                "no update for the final round %d; the result is at the parameter server", round_number
            )
            data = None
        if data is not None:
            params = decode_global(data, self._theta_global)
            apply_global(model, params)
            self._theta_global = params
        if delta_path is not None:
            delta_path.unlink(missing_ok=True)
        self.samples_total += stats.samples
        self.round_losses.append(stats.mean_loss)
        values = {
            "loss": _finite(stats.mean_loss),
            "batches": float(stats.batches),
            "samples": float(stats.samples),
            "samples_per_second": stats.samples / stats.train_seconds if stats.train_seconds else 0.0,
        }
        try:
            await self.bridge.metrics(round_number, values)
        except UnavailableError as exc:  # figures are best effort; training goes on
            _raise_if_bridge_gone(exc)
            logger.warning("metrics of round %d not delivered: %s", round_number, exc.message)
        self.round_number = round_number + 1
        await asyncio.to_thread(
            save_trainer_state,
            checkpoint_dir,
            model,
            optimizer,
            TrainerState(self.round_number, self.samples_total),
        )

    async def _send_delta(self, path: Path, round_number: int, samples: int) -> None:
        """Send Δ; a failure is logged, not raised (the wait for the update sends it again)."""
        try:
            reply = await self.bridge.send_tensors(
                peer=self.ps, kind=DELTA, round=round_number, samples=samples, path=path
            )
        except UnavailableError as exc:
            _raise_if_bridge_gone(exc)
            logger.warning("delta for round %d not delivered: %s", round_number, exc.message)
            return
        accepted, message = send_outcome(reply)
        if not accepted:
            logger.warning("delta for round %d not delivered: %s", round_number, message)

    async def _await_tensors(
        self, kind: str, round_number: int, *, resend: tuple[Path, int] | None, tries: int | None = None
    ) -> bytes:
        """Fetch ``kind`` for the round from the parameter server, re-sending the delta between tries.

        Gives up (UnavailableError) after ``tries`` fetches, or once ``update_patience_s`` is spent.
        """
        deadline = self.options.clock() + self.options.update_patience_s
        attempt = 0
        pause_s = self.options.idle_min_s
        while True:
            attempt += 1
            try:
                data = await self.bridge.fetch_tensors(
                    peer=self.ps, kind=kind, round=round_number, timeout_s=self.options.fetch_timeout_s
                )
            except UnavailableError as exc:  # the parameter server's worker is unreachable for now
                _raise_if_bridge_gone(exc)
                logger.warning("fetching %s of round %d: %s", kind, round_number, exc.message)
                data = None
                # A failure answers at once (unlike a fetch that waited): pause before the next try.
                await asyncio.sleep(pause_s)
                pause_s = min(pause_s * 2, self.options.idle_max_s)
            if data is not None:
                return data
            if (tries is not None and attempt >= tries) or self.options.clock() >= deadline:
                raise UnavailableError(f"no {kind} for round {round_number} from the parameter server")
            if resend is not None:
                await self._send_delta(resend[0], round_number, resend[1])


def _raise_if_bridge_gone(exc: UnavailableError) -> None:
    """Re-raise when the job bridge itself cannot be reached: the worker is gone.

    NOTE: the bridge is a local Unix socket, so a refused or missing
    connection (an OSError behind the error, other than a timeout) does not
    heal; carrying on would leave an orphaned executor retrying for as long as
    its patience lasts. Failures the bridge reports (503: a peer or the
    scheduler is unreachable) stay retryable.
    """
    cause = exc.__cause__
    if isinstance(cause, OSError) and not isinstance(cause, TimeoutError):
        raise exc


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


async def _main() -> int:
    from hypha.executor import BridgeClient

    async with BridgeClient.from_env() as client:
        bridge: Bridge = client  # the real client satisfies the protocol the tests fake
        return await DilocoTrainer(bridge).run()


def configure_process() -> None:
    """Process-wide settings of an executor: logging, and one torch thread count per process.

    Several trainers share a machine: with torch's default (every core each)
    four trainers on two cores ran 3x slower than with one thread each.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, int(os.environ.get("HYPHA_TORCH_THREADS", "1"))))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file bars would flood the job's log stream


def main() -> None:
    configure_process()
    sys.exit(asyncio.run(_main()))


if __name__ == "__main__":
    main()
