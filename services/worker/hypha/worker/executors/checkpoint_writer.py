"""The trainer's checkpoint at round boundaries, written in a thread while the next round trains.

The checkpoint (model, inner optimizer, round: ``trainer_state.write_trainer_state``)
lets a restarted trainer resume at the round boundary it was taken at.

Decisions (NOTE):
- A round boundary is checkpointed when ``interval_s`` has passed since the
  last checkpoint (or since the trainer started), and the job's last one
  always, not every round: with short rounds the write (three copies of the
  model's size, serialised, hashed and fsynced) took a core for 35-60 ms of
  every 300 ms round and slowed the steps beside it. Nothing accepted is lost by skipping
  one: after a sync the model is θ_global, which the parameter server keeps,
  and a restarted trainer pulls the current θ_global in any case (it joins);
  what a skipped checkpoint leaves older is the inner optimizer's moments and
  the sample count. ``interval_s`` 0 checkpoints every round. A trainer that
  stops early (told ``done``) writes the state it stops with when the last
  boundary was skipped, so a restarted one counts every sample synced.
- The checkpoint is written in the background: a copy of the state
  is taken at the round boundary (a few ms) and serialised, hashed and
  fsynced in a thread while the next round trains, which took 60-180 ms of
  every round before (docs/performance.md). A crash before that write
  commits leaves the previous round's checkpoint, as a crash during a
  synchronous write did; the resumed trainer then pulls θ_global as any
  restarted one does. Writes never overlap each other (each awaits the one
  before), and the last one has committed before the trainer reports its
  outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hypha.worker.executors.trainer_state import TrainerState, snapshot_trainer_state, write_trainer_state

logger = logging.getLogger(__name__)

#: Least seconds between two checkpoints (``TrainerOptions.checkpoint_interval_s``).
DEFAULT_CHECKPOINT_INTERVAL_S = 60.0


class CheckpointWriter:
    """At most one checkpoint being written in a thread; the next one waits for it."""

    def __init__(self, interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._written_at = clock()  # a trainer that has just started has nothing to lose yet
        #: A round boundary passed since the last checkpoint (``write`` skipped it).
        self.behind = False
        #: The checkpoint being written in a thread.
        self._writing: asyncio.Future[Path] | None = None

    async def write(
        self,
        checkpoint_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        *,
        last: bool = False,
    ) -> bool:
        """Start writing a copy of the state in a thread, once the previous write is done, if
        ``interval_s`` has passed since the last one or this is the job's ``last`` boundary
        (NOTE); whether it started."""
        now = self._clock()
        if not last and now - self._written_at < self.interval_s:
            self.behind = True
            return False
        self._written_at, self.behind = now, False
        await self.settled()
        model_state, optimizer_state = snapshot_trainer_state(model, optimizer)
        self._writing = asyncio.ensure_future(
            asyncio.to_thread(write_trainer_state, checkpoint_dir, model_state, optimizer_state, state)
        )
        return True

    async def settled(self, *, quiet: bool = False) -> None:
        """Wait for the checkpoint being written, if any; ``quiet`` logs its failure instead of raising."""
        pending, self._writing = self._writing, None
        if pending is None:
            return
        try:
            await pending
        except Exception as exc:  # the trainer is failing already when quiet; its reason comes first
            if not quiet:
                raise
            logger.warning("trainer checkpoint not written: %s", exc)
