"""A trainer's bridge calls to its parameter server, and their retry policy.

The trainer sends Δ ("delta") to the parameter server's worker and fetches
θ_global back: the current one when it joins ("global"), a round's new one
after its Δ ("update"). ``ParameterServerLink`` makes those calls; what is
sent and what becomes of the answer is ``global_sync``'s.

Decisions (NOTE):
- While waiting for an update the trainer re-sends its delta after each
  fetch timeout: a parameter server that restarted lost the round in
  progress and collects it afresh; a duplicate is ignored there. The
  previous round's delta goes first, while the trainer keeps it
  (``global_sync``): a server restored from the state its scheduler held may
  be one round behind the update this trainer already has (the state of a
  round is kept while the next one trains, docs/fault-tolerance.md) and
  redoes that round from the same deltas; a server that is not behind drops
  it as late.
- After the final round's delta the trainer tries for the update only a few
  times: the job's result lives at the parameter server, which may already be
  gone.
- The bridge answering "unavailable" for a delta or a fetch is not fatal
  (the trainer's NOTE): a delta not delivered is logged and sent again with
  the next try for the update, a fetch is tried again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hypha.errors import UnavailableError
from hypha.net.backoff import Backoff
from hypha.worker.executors.bridge_api import DELTA, UPDATE, Bridge, raise_if_bridge_gone, send_outcome

logger = logging.getLogger(__name__)

#: Fetches of the final round's update before the trainer ends without it.
FINAL_UPDATE_TRIES = 3


@dataclass(frozen=True)
class SentDelta:
    """A delta this trainer sent and keeps on disk to send again: its file, round and samples."""

    path: Path
    round: int
    samples: int


class LinkOptions(Protocol):
    """The waits a link reads, when it needs them (``diloco_trainer.TrainerOptions``)."""

    @property
    def fetch_timeout_s(self) -> float: ...  # one bridge fetch (held open until the tensors come)
    @property
    def update_patience_s(self) -> float: ...  # give up on a fetch after waiting this long in all
    @property
    def idle_min_s(self) -> float: ...  # pause bounds between fetches that failed at once
    @property
    def idle_max_s(self) -> float: ...
    @property
    def clock(self) -> Callable[[], float]: ...


class ParameterServerLink:
    """Δ to the parameter server ``peer`` and θ_global from it, through ``bridge``."""

    def __init__(
        self,
        bridge: Bridge,
        peer: str,
        options: LinkOptions,
        job_goes_on: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """``job_goes_on``: asked when the final round's update does not come (``fetch_update``)."""
        self.bridge = bridge
        self.peer = peer
        self.options = options
        self.job_goes_on = job_goes_on

    async def send_delta(self, sent: SentDelta) -> None:
        """Send Δ; a failure is logged, not raised (the wait for the update sends it again)."""
        try:
            reply = await self.bridge.send_tensors(
                peer=self.peer, kind=DELTA, round=sent.round, samples=sent.samples, path=sent.path
            )
        except UnavailableError as exc:
            raise_if_bridge_gone(exc)
            logger.warning("delta for round %d not delivered: %s", sent.round, exc.message)
            return
        accepted, message = send_outcome(reply)
        if not accepted:
            logger.warning("delta for round %d not delivered: %s", sent.round, message)

    async def send_again(self, resend: Sequence[SentDelta]) -> None:
        """Send the kept deltas once more, oldest first (a restored server needs them in order)."""
        for sent in resend:
            await self.send_delta(sent)

    async def fetch(
        self, kind: str, round_number: int, *, resend: Sequence[SentDelta] = (), tries: int | None = None
    ) -> bytes:
        """Fetch ``kind`` for the round from the parameter server, re-sending ``resend`` between tries.

        Gives up (UnavailableError) after ``tries`` fetches, or once ``update_patience_s`` is spent.
        """
        deadline = self.options.clock() + self.options.update_patience_s
        attempt = 0
        pause = Backoff(self.options.idle_min_s, self.options.idle_max_s)
        while True:
            attempt += 1
            try:
                data = await self.bridge.fetch_tensors(
                    peer=self.peer, kind=kind, round=round_number, timeout_s=self.options.fetch_timeout_s
                )
            except UnavailableError as exc:  # the parameter server's worker is unreachable for now
                raise_if_bridge_gone(exc)
                logger.warning("fetching %s of round %d: %s", kind, round_number, exc.message)
                data = None
                # A failure answers at once (unlike a fetch that waited): pause before the next try.
                await asyncio.sleep(pause.next_delay())
            if data is not None:
                return data
            if (tries is not None and attempt >= tries) or self.options.clock() >= deadline:
                raise UnavailableError(f"no {kind} for round {round_number} from the parameter server")
            await self.send_again(resend)

    async def fetch_update(
        self, round_number: int, *, resend: Sequence[SentDelta] = (), final: bool
    ) -> bytes | None:
        """The round's update; None when the ``final`` round's is not served (NOTE).

        A final round's update is tried for ``FINAL_UPDATE_TRIES`` fetches at a time: a server
        that ended with the job no longer serves it. Between those, the scheduler is asked
        (``job_goes_on``): while the job is not over, the server may be being restored, and
        it needs this trainer's Δ again to complete the round (without it the restored
        server waited for the round's deadline, and the round's work was lost).
        """
        deadline = self.options.clock() + self.options.update_patience_s
        while True:
            try:
                return await self.fetch(
                    UPDATE, round_number, resend=resend, tries=FINAL_UPDATE_TRIES if final else None
                )
            except UnavailableError:
                if not final:
                    raise
            if self.job_goes_on is None or self.options.clock() >= deadline or not await self.job_goes_on():
                logger.info(
                    "no update for the final round %d; the result is at the parameter server", round_number
                )
                return None
            logger.info(
                "no update for the final round %d yet and the job goes on: sending Δ again", round_number
            )
            await self.send_again(resend)
