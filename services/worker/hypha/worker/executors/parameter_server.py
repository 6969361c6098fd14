"""The ``parameter-server`` executor: averages the trainers' deltas and steps θ_global.

    python -m hypha.worker.executors.parameter_server

The worker starts it with the job bridge's socket in ``HYPHA_BRIDGE_SOCKET``.
All arithmetic and round bookkeeping is ``hypha.diloco`` (``ParameterServerCore``:
weighted average by samples, Nesterov outer step, quorum and deadline); this
module wires it to the bridge:

- start: fetch and build the job's model (θ_0 = its parameters), or resume
  from the checkpoint in the work dir, or (a replacement parameter server,
  dispatched with ``start_round`` > 0) restore the state the scheduler kept
  and pushes into the "ps-state" inbox; publish θ_global as "global";
- each delta from the bridge's inbox goes to the core; whenever a round
  completes, its state is written once as a pack file (``checkpoint.write_pack``),
  published as "ps-state" and committed as the local checkpoint
  (``checkpoint.commit``); the new θ_global is published as that round's
  "update" and as the next round's "global" (for late or replacement
  trainers); then the round's figures go out as metrics, with
  ``state_round``: the scheduler pulls the pack before it acknowledges them
  (the round's commit, ``docs/fault-tolerance.md``), while the next round
  trains;
- after the job's rounds, the final model is written as a ``from_pretrained``
  directory (``config.json`` + ``model.safetensors``, plus the preprocessor's
  files when the job has one) and handed to the bridge as the job's result.

Decisions (NOTE):
- Checkpoint locally before publishing: once a trainer may have seen round N's
  update, a restart of this process must not redo round N. A restarted server
  re-publishes the last update and the current global, since a crash can
  fall between the two.
- The scheduler's copy of round N's state is pulled while round N+1 trains
  (over a slow link the pull of θ_global and momentum, twice the model in
  fp32, used to be most of the wait between rounds), and round N+1's update
  waits for that commit: at most one published round is not yet held
  elsewhere. A server restored elsewhere from round N-1's state redoes round
  N from the same deltas (each trainer keeps its last Δ until the next
  update, ``ps_link``). The final round is the exception: its update ends
  the trainers, who keep nothing after it, so it goes out only once its
  state is held (a server lost before it reported the result is restored
  at the job's last round and only writes the result). A delta for the
  round after the current one waits here until that round starts. Since the trainers may hold a θ_global the
  restored server rebuilds only up to rounding (the change of an
  ``update_dtype`` round carries a residual the state does not), a restored
  server sends its first updates whole, one per fragment and one more,
  which sets every trainer to its θ_global.
- A scheduler that cannot be reached does not stop the rounds: the metrics
  call failing is logged and the update published anyway (liveness over the
  state's durability for that round).
- A delta from a peer the job does not know makes the server re-read the job:
  the scheduler may have replaced a lost trainer, whose successor takes its
  place (``ParameterServerCore.replace_worker``), or grown the job (``hypha
  scale``), the newcomer joining with that delta (``set_workers``). While a
  round waits on someone, the job is re-read too: a trainer the scheduler let
  go (the job shrank) is no longer waited for.
- Duplicates (a trainer re-sends while it waits for an update), late deltas and
  malformed ones are logged and dropped; none of them stops the job.
- Streaming (``streaming_fragments`` F >= 2): round r's deltas hold fragment
  r mod F only, the core steps that fragment's outer optimizer, and round r's
  "update" holds only that fragment's new θ_global (1/F of the bytes back too);
  "global" stays the whole θ_global (for joining trainers and the result).
- ``update_dtype`` other than fp32: round r's "update" is the change of
  θ_global over the round, encoded (``hypha.diloco.updates``), and θ_global is
  set to what the trainers rebuild from it *before* the round's state is
  written, so the checkpoint, "global" and every trainer agree bit for bit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hypha import factories, models
from hypha.diloco import checkpoint
from hypha.diloco.outer import NesterovOuter
from hypha.diloco.rounds import DeltaReceipt
from hypha.diloco.server_core import ParameterServerCore, RoundUpdate
from hypha.diloco.streaming import fragments_for
from hypha.diloco.updates import UpdateEncoder
from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from hypha.tensors.payload import decode_state, encode_state
from hypha.worker.executors import process
from hypha.worker.executors.bridge_api import DELTA, GLOBAL, GLOBAL_ROUND_KEY, UPDATE, Bridge, Received
from hypha.worker.executors.diloco_settings import (
    diloco_spec,
    has_preprocessor,
    outer_settings,
    quorum,
    update_wire_dtype,
)
from hypha.worker.executors.inner_steps import apply_global, parameter_state

logger = logging.getLogger("hypha.worker.executors.parameter_server")

DEFAULT_ROUND_TIMEOUT_S = 300.0
#: Tensor kind of a packed state (``checkpoint.pack``): published each round, pushed to a replacement.
STATE_KIND = "ps-state"
#: Metrics value naming the round whose state was published (the scheduler pulls it).
STATE_ROUND_KEY = "state_round"


@dataclass
class ServerOptions:
    """Waits; the defaults suit a real cluster, tests shrink them."""

    #: Longest single wait on the inbox (the loop also wakes at a round's deadline).
    poll_s: float = 1.0
    #: Published θ files kept on disk (trainers may still fetch a recent round's update).
    keep_published: int = 4
    #: Grace after the result before exiting, so trainers can still pull the last update.
    linger_s: float = 5.0
    #: How long a replacement server waits for the state the scheduler pushes.
    restore_wait_s: float = 120.0
    clock: Callable[[], float] = field(default=time.monotonic)


class ParameterServer:
    """One parameter-server process's job, driven entirely through ``bridge``."""

    def __init__(self, bridge: Bridge, work_dir: Path | None = None, options: ServerOptions | None = None):
        self.bridge = bridge
        self.options = options or ServerOptions()
        self._work_dir_arg = work_dir
        self.core: ParameterServerCore | None = None
        #: Every completed round's outcome since this process started, in order.
        self.updates: list[RoundUpdate] = []
        self.result_dir: Path | None = None
        #: The codec of each round's update when it comes down as a change (``update_dtype``).
        self.downlink: UpdateEncoder | None = None
        #: The job's model, built in the background from ``start`` on (``_model``).
        self._model_task: asyncio.Future[nn.Module] | None = None
        #: The last completed round's report to the scheduler (its commit), in flight.
        self._committing: asyncio.Future[None] | None = None
        #: Deltas that came for the round after the current one, by sender (module NOTE).
        self._early: dict[str, Received] = {}
        #: Updates still to be sent whole after a restore (module NOTE).
        self._whole_updates = 0

    async def run(self) -> int:
        """Serve the job's rounds, then publish the result; the process exit code."""
        try:
            await self.start()
            while not self.finished:
                received = await self.bridge.inbox(DELTA, timeout_s=self._wait_s())
                if received is not None:
                    await self.handle(received)
                elif self._waiting():
                    await self._follow_trainers()  # a trainer may have left (``hypha scale``)
                await self.tick()
                self._model_failed()
            await self.finish()
        except process.FAILURES as exc:
            return await process.report_failure(self.bridge, "parameter server", exc)
        finally:
            for task in (self._model_task, self._committing):
                if task is not None and not task.done():
                    task.cancel()
        if self.options.linger_s > 0:
            await asyncio.sleep(self.options.linger_s)
        return 0

    # ---- steps (public so tests can drive them one at a time) ------------------------------

    async def start(self) -> ParameterServerCore:
        job = await self.bridge.job()
        self.spec = diloco_spec(job.spec)
        self.work_dir = Path(self._work_dir_arg or job.work_dir)
        self.rounds = int(self.spec.rounds)
        if self.rounds < 1:
            raise InvalidArgumentError("a DiLoCo job needs rounds >= 1")
        trainers = [t for t in job.trainer_ids if t]
        if not trainers:
            raise InvalidArgumentError("the job names no trainers")
        self.checkpoint_dir = self.work_dir / "ps-checkpoint"
        self.published_dir = self.work_dir / "published"
        self.published_dir.mkdir(parents=True, exist_ok=True)

        # The model is built beside the restore: a replacement takes its tensors' names and
        # shapes from the state it restores and needs the model itself only for the result, so
        # its rounds do not wait for the model's libraries to import (docs/fault-tolerance.md).
        self._model_task = asyncio.ensure_future(self._build_model())
        local = None
        if checkpoint.exists(self.checkpoint_dir):
            local = await asyncio.to_thread(checkpoint.load, self.checkpoint_dir)
        pushed = await self._pushed_state() if int(job.start_round) > 0 else None
        if pushed is not None and (local is None or pushed.round_number >= local.round_number):
            core = pushed
            _adopt_trainers(core, trainers)
            await asyncio.to_thread(checkpoint.save, self.checkpoint_dir, core)
        elif local is not None:
            core = local
            logger.info("resumed from the checkpoint at round %d", core.round_number)
        elif int(job.start_round) > 0:
            raise FailedPreconditionError(
                f"no state to resume round {job.start_round} from: the scheduler pushed none "
                f"within {self.options.restore_wait_s:g} s"
            )
        else:
            theta_0 = parameter_state(await self._model())
            core = ParameterServerCore(
                NesterovOuter(theta_0, *outer_settings(self.spec)),
                trainers,
                self.spec.round_timeout_s or DEFAULT_ROUND_TIMEOUT_S,
                quorum(self.spec),
                fragments=fragments_for(theta_0, int(self.spec.streaming_fragments)),
            )
        await self._serve(core)
        return core

    async def _serve(self, core: ParameterServerCore) -> None:
        """Serve ``core`` from now on: θ_global (and the last round's update) published."""
        self.core = core
        # Deltas are checked against the names and shapes of the θ_global being served.
        self.template = dict(core.outer.parameters())
        update_dtype = update_wire_dtype(self.spec)
        if update_dtype != "fp32":
            # A restart starts with no residual (hypha.diloco.updates): what the trainers hold is
            # the checkpoint's θ_global, re-published whole below.
            self.downlink = UpdateEncoder(update_dtype, core.outer.parameters())
        if core.fragments is not None:
            logger.info("streaming DiLoCo: %d fragments, one synced per round", len(core.fragments))
        # Restored: the trainers may hold a θ_global one round on (module NOTE).
        self._whole_updates = 0 if core.round_number == 0 else len(core.fragments or [()]) + 1
        path = await asyncio.to_thread(self._write_theta, core.round_number, core.outer.parameters())
        if core.round_number > 0:
            # The fragment of the last round has not moved since: its update, re-published.
            update_path = await asyncio.to_thread(
                self._write_update, core.round_number - 1, core.outer.parameters()
            )
            await self.bridge.publish_tensors(kind=UPDATE, round=core.round_number - 1, path=update_path)
        await self.bridge.publish_tensors(kind=GLOBAL, round=core.round_number, path=path)

    @property
    def finished(self) -> bool:
        return self.core is not None and self.core.round_number >= self.rounds

    async def handle(self, received: Received) -> DeltaReceipt | None:
        """Give one received delta to the core; None when it was refused (and logged)."""
        core = self._core()
        peer, round_number = received.from_peer, int(received.round)
        if received.kind != DELTA:
            logger.warning("ignoring a %r payload from %s", received.kind, peer)
            return None
        try:
            names = core.fragment_names(round_number)
            template = self.template if names is None else {n: self.template[n] for n in names}
            delta = decode_state(received.data, torch.float32, expected=template)
            try:
                receipt = core.add_delta(
                    peer, round_number, int(received.samples), delta, self.options.clock()
                )
            except FailedPreconditionError:
                # A delta for a round this server has not reached: the job went on without it
                # (a partition outlasted its lease, another server was restored) and its
                # scheduler took this execution back to serve the newer kept state it pushes.
                if await self._catch_up(round_number):
                    return await self.handle(received)
                if round_number != core.round_number + 1:
                    raise
                # This server was restored one round behind its trainers; it redoes that round
                # from their kept deltas first (module NOTE).
                self._early[peer] = received
                logger.info("delta from %s for round %d kept until that round starts", peer, round_number)
                return None
            except PermissionDeniedError:
                if not await self._adopt_replacement(peer):
                    raise
                receipt = core.add_delta(
                    peer, round_number, int(received.samples), delta, self.options.clock()
                )
        except AlreadyExistsError:
            logger.info("duplicate delta from %s for round %d ignored", peer, round_number)
            return None
        except (PermissionDeniedError, FailedPreconditionError, InvalidArgumentError) as exc:
            logger.warning("delta from %s for round %d refused: %s", peer, round_number, exc.message)
            return None
        if not receipt.accepted:
            logger.info("delta from %s dropped: %s", peer, receipt.reason)
        return receipt

    async def tick(self) -> RoundUpdate | None:
        """Complete the current round if it is ready: checkpoint, publish, report."""
        core = self._core()
        update = core.maybe_complete(self.options.clock())
        if update is None:
            return None
        # The round before must be held by the scheduler before this one's state and update go out.
        await self._committed()
        whole = self._whole_updates > 0
        change = None
        if self.downlink is not None and not whole:
            # Before the state is written: θ_global becomes what the trainers rebuild.
            change = await asyncio.to_thread(self._write_change, update)
        # The round's state is written once, as a pack file in the checkpoint directory, and
        # committed there before its update goes out (a restarted process resumes from it;
        # fsyncs and a sha256), while the new θ_global is encoded and the same file published
        # for the scheduler to pull. Nothing changes the core meanwhile: the next delta is
        # handled only after this tick.
        written = await asyncio.to_thread(checkpoint.write_pack, self.checkpoint_dir, core)
        saving = asyncio.ensure_future(asyncio.to_thread(checkpoint.commit, written))
        theta = asyncio.ensure_future(
            asyncio.to_thread(self._write_theta, update.next_round, core.outer.parameters())
        )
        try:
            state_path = await asyncio.to_thread(self._publish_copy, core.round_number, written.path)
            await self.bridge.publish_tensors(kind=STATE_KIND, round=core.round_number, path=state_path)
            logger.info(
                "round %d complete: %d samples from %s%s",
                update.round_number,
                update.samples,
                ", ".join(update.contributors),
                f"; missing {', '.join(update.missing)}" if update.missing else "",
            )
        finally:
            await asyncio.wait([saving, theta])  # never leave a thread behind
        saving.result()  # a failed local checkpoint fails the server before the update leaves
        path = update_path = theta.result()
        if change is not None:
            update_path = change
        elif update.fragment is not None:
            update_path = await asyncio.to_thread(self._write_update, update.round_number, update.params)
        if whole:
            self._whole_updates -= 1
            if self.downlink is not None:  # every trainer holds θ_global as sent whole
                self.downlink = UpdateEncoder(update_wire_dtype(self.spec), core.outer.parameters())
        figures = {
            "contributors": float(len(update.contributors)),
            "missing": float(len(update.missing)),
            "samples": float(update.samples),
            "outer_steps": float(core.outer.steps),
            STATE_ROUND_KEY: float(core.round_number),
        }
        if self.finished:
            # The final update ends the trainers: no Δ will come to redo this round from, so its
            # state must be held before they can have it (module NOTE).
            await self._commit(update.round_number, figures)
        await self.bridge.publish_tensors(kind=UPDATE, round=update.round_number, path=update_path)
        await self.bridge.publish_tensors(kind=GLOBAL, round=update.next_round, path=path)
        if not self.finished:
            self._committing = asyncio.ensure_future(self._commit(update.round_number, figures))
        self.updates.append(update)
        self._prune_published(update.next_round)
        early, self._early = self._early, {}
        for received in early.values():  # deltas that came for the round that starts now
            await self.handle(received)
        return update

    async def _commit(self, round_number: int, figures: dict[str, float]) -> None:
        """Report the round: the scheduler answers once it holds the round's state (its commit)."""
        try:
            await self.bridge.metrics(round_number, figures)
        except UnavailableError as exc:  # the rounds go on (see the module's NOTE)
            logger.warning("metrics of round %d not delivered: %s", round_number, exc.message)

    async def _committed(self) -> None:
        """Wait for the last round's commit (if one is in flight)."""
        committing, self._committing = self._committing, None
        if committing is not None:
            await committing

    async def finish(self) -> Path:
        """Write θ_global as the job's model directory and hand it over as the result."""
        core = self._core()
        await self._committed()
        model = await self._model()
        apply_global(model, core.outer.parameters())
        result_dir = self.work_dir / "result"
        if result_dir.exists():
            await asyncio.to_thread(shutil.rmtree, result_dir)
        await asyncio.to_thread(models.save_model_dir, model, result_dir, self.spec.model)
        if has_preprocessor(self.spec):
            source = await self.bridge.fetch_resource("preprocessor")
            await asyncio.to_thread(_copy_missing, source, result_dir)
        await self.bridge.result(path=result_dir)
        await self.bridge.status("succeeded", f"{core.round_number} rounds, {core.outer.steps} outer steps")
        self.result_dir = result_dir
        return result_dir

    # ---- helpers ---------------------------------------------------------------------------

    async def _build_model(self) -> nn.Module:
        model_dir = await self.bridge.fetch_resource("model")
        return await asyncio.to_thread(
            models.build_model, self.spec.model, model_dir, factories_allowed=factories.from_env()
        )

    async def _model(self) -> nn.Module:
        """The job's model (θ_0 for a new job; the result's architecture for every server)."""
        if self._model_task is None:
            raise FailedPreconditionError("the parameter server has not started")
        return await self._model_task

    def _model_failed(self) -> None:
        """Raise a failed background build at once, not after the job's last round."""
        task = self._model_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            task.result()

    def _core(self) -> ParameterServerCore:
        if self.core is None:
            raise FailedPreconditionError("the parameter server has not started")
        return self.core

    def _wait_s(self) -> float:
        """Until the round's deadline (so quorum completes on time), at most ``poll_s``."""
        deadline = self._core().current_round.deadline
        if not math.isfinite(deadline):
            return self.options.poll_s
        return min(self.options.poll_s, max(0.0, deadline - self.options.clock()) + 0.001)

    def _write_theta(self, global_round: int, params: dict[str, torch.Tensor]) -> Path:
        blob = encode_state(params, "fp32", metadata={GLOBAL_ROUND_KEY: str(global_round)})
        path = self.published_dir / f"theta-{global_round:08d}.safetensors"
        path.write_bytes(blob)
        return path

    def _write_update(self, round_number: int, params: dict[str, torch.Tensor]) -> Path:
        """Round ``round_number``'s update: θ_global, or only the round's fragment when streaming."""
        names = self._core().fragment_names(round_number)
        if names is None:
            return self._write_theta(round_number + 1, params)
        blob = encode_state(
            {n: params[n] for n in names}, "fp32", metadata={GLOBAL_ROUND_KEY: str(round_number + 1)}
        )
        path = self.published_dir / f"update-{round_number:08d}.safetensors"
        path.write_bytes(blob)
        return path

    def _write_change(self, update: RoundUpdate) -> Path:
        """Round ``update``'s change of θ_global, encoded with the job's ``update_dtype``; θ_global
        (and the update's snapshot) set to what a trainer rebuilds from it."""
        assert self.downlink is not None
        live = self._core().outer.parameters()
        names = list(update.params)
        blob = self.downlink.encode(
            live, names, update.round_number, {GLOBAL_ROUND_KEY: str(update.next_round)}
        )
        for name in names:
            update.params[name] = live[name].clone()
        path = self.published_dir / f"update-{update.round_number:08d}.safetensors"
        path.write_bytes(blob)
        return path

    def _publish_copy(self, round_number: int, pack_file: Path) -> Path:
        """The round's pack under the published directory: a hard link to the checkpoint's file
        (never rewritten: a new checkpoint is a new file), a copy where links do not work."""
        path = self.published_dir / f"state-{round_number:08d}.safetensors"
        path.unlink(missing_ok=True)
        try:
            os.link(pack_file, path)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(pack_file, path)
        return path

    def _prune_published(self, newest: int) -> None:
        keep = max(1, self.options.keep_published)
        for prefix in ("theta-", "state-", "update-"):
            for path in self.published_dir.glob(f"{prefix}*.safetensors"):
                stem = path.stem.removeprefix(prefix)
                if stem.isdigit() and int(stem) <= newest - keep:
                    path.unlink(missing_ok=True)

    async def _catch_up(self, wanted: int) -> bool:
        """Serve a state the scheduler pushed since the start if it is newer than ours (True)."""
        core = self._core()
        newest = None
        while (received := await self.bridge.inbox(STATE_KIND, timeout_s=0)) is not None:
            pushed = await _restored(received)
            if pushed is None:
                continue
            if pushed.round_number > max(core.round_number, -1 if newest is None else newest.round_number):
                newest = pushed
        if newest is None:
            return False
        job = await self.bridge.job()
        _adopt_trainers(newest, [t for t in job.trainer_ids if t])
        await asyncio.to_thread(checkpoint.save, self.checkpoint_dir, newest)
        logger.warning(
            "a delta for round %d came while this server was at round %d: serving the state of round "
            "%d its scheduler pushed since",
            wanted,
            core.round_number,
            newest.round_number,
        )
        await self._serve(newest)
        return True

    async def _pushed_state(self) -> ParameterServerCore | None:
        """The state the scheduler pushes to a replacement server (None: none came in time).

        Only the dispatching scheduler may push this kind (the worker checks);
        a damaged pack is logged and the next one awaited.
        """
        deadline = self.options.clock() + self.options.restore_wait_s
        while (left := deadline - self.options.clock()) > 0:
            received = await self.bridge.inbox(STATE_KIND, timeout_s=min(left, self.options.poll_s * 10))
            core = None if received is None else await _restored(received)
            if core is None:
                continue
            logger.info(
                "restored round %d from the state the scheduler kept (θ_global and momentum sha256 %s)",
                core.round_number,
                checkpoint.state_digest(core.outer.state_dict()),
            )
            return core
        return None

    async def _adopt_replacement(self, peer: str) -> bool:
        """Re-read the job; True if ``peer`` is now one of its trainers (a replacement takes its
        predecessor's place, a newcomer of ``hypha scale`` joins from the next round)."""
        await self._follow_trainers(peer)
        return peer in self._core().expected

    def _waiting(self) -> bool:
        """The current round has deltas and still waits for someone (who may have left)."""
        current = self._core().current_round
        return bool(current.arrived) and bool(current.missing)

    async def _follow_trainers(self, delivered: str | None = None) -> None:
        """Follow the job's trainer list: trainers gone (lost, replaced, or let go by ``hypha
        scale``) are no longer waited for, and a newcomer (a replacement or a grown trainer)
        joins once its first delta (from ``delivered``) arrives, taking a gone one's place: one
        still starting holds no round up, so the round in flight completes with the others."""
        core = self._core()
        job = await self.bridge.job()
        current = {t for t in job.trainer_ids if t}
        expected = core.expected
        if not current or current == expected:
            return
        gone, new = sorted(expected - current), sorted(current - expected)
        if delivered is None:
            if not gone:
                return  # newcomers join when they deliver
            wanted = set(expected & current)
        else:
            wanted = set(expected & current) | set(new[: len(gone)])
            if delivered in current:
                wanted.add(delivered)
        added, removed = core.set_workers(wanted, delivering=delivered or "")
        if delivered is not None:
            for old, newcomer in zip(gone, new, strict=False):
                logger.info("trainer %s replaces %s", newcomer, old)
        if added or removed:
            logger.info("trainers now %s (joined %s, left %s)", sorted(current), added, removed)


async def _restored(received: Received) -> ParameterServerCore | None:
    """The state a pushed pack holds; None (logged) for a damaged one."""
    try:
        saved = await asyncio.to_thread(checkpoint.unpack, received.data)
    except HyphaError as exc:
        logger.warning("state pushed by %s refused: %s", received.from_peer, exc.message)
        return None
    return checkpoint.restore(saved)


def _adopt_trainers(core: ParameterServerCore, trainers: list[str]) -> None:
    """Trainers replaced since the state was saved take their predecessors' places."""
    gone = sorted(core.expected - set(trainers))
    new = sorted(set(trainers) - core.expected)
    for old, newcomer in zip(gone, new, strict=False):
        core.replace_worker(old, newcomer)
        logger.info("trainer %s replaces %s", newcomer, old)


def _copy_missing(source: Path, target: Path) -> None:
    """Add the preprocessor's files beside the model, never overwriting the model's own."""
    if not source.is_dir():
        raise NotFoundError(f"preprocessor directory {source} does not exist")
    for path in sorted(source.iterdir()):
        if path.is_file() and not (target / path.name).exists():
            shutil.copy2(path, target / path.name)


def main() -> None:
    process.main(lambda bridge: ParameterServer(bridge).run())


if __name__ == "__main__":
    main()
