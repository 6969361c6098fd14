"""The trainer's per-round checkpoint, written in a thread while the next round trains.

The checkpoint (model, inner optimizer, round: ``training.write_trainer_state``)
lets a restarted trainer resume at the round boundary it was taken at.

Decisions (NOTE):
- The per-round checkpoint is written in the background: a copy of the state
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
from pathlib import Path

import torch
from torch import nn

from hypha.worker.executors.training import TrainerState, snapshot_trainer_state, write_trainer_state

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """At most one checkpoint being written in a thread; the next one waits for it."""

    def __init__(self) -> None:
        #: The checkpoint being written in a thread.
        self._writing: asyncio.Future[Path] | None = None

    async def write(
        self, checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState
    ) -> None:
        """Start writing a copy of the state in a thread, once the previous write is done (NOTE)."""
        await self.settled()
        model_state, optimizer_state = snapshot_trainer_state(model, optimizer)
        self._writing = asyncio.ensure_future(
            asyncio.to_thread(write_trainer_state, checkpoint_dir, model_state, optimizer_state, state)
        )

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
