"""A reference-style trainer's rounds with our parameter server: Δ out, each round's update back.

The trainer (reference API, ``reference_bridge``) sends a file and listens on
an event stream; this side does what our trainer's ``GlobalSync`` and
``ParameterServerLink`` do for ours: it keeps the θ_global the trainer holds,
converts the file to our Δ (``reference_tensors``), sends it to the parameter
server as the round's ``delta``, pulls the round's ``update`` (sending the Δ
again after each wait that came back empty: a restarted server collects the
round afresh), converts it to the difference the trainer merges, and queues
it for the event streams, in round order.

Decisions (NOTE):
- The trainer's θ at its start is taken to be the parameter server's
  θ_global at the job's start round (both load the same pretrained weights);
  it is pulled as soon as the trainer reports or subscribes, since the
  reference trainer never pulls θ_global itself.
- The final round's update may no longer be served (the parameter server
  ends with the job): after a few short tries an all-zero update is queued,
  so the trainer reports ``update-received`` and hears ``Done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypha.errors import HyphaError

if TYPE_CHECKING:
    import torch

    from hypha.worker.bridge import BridgeContext
    from hypha.worker.reference_tensors import SentLayout
    from hypha.worker.tensor_inbox import TensorPayload

#: Where converted tensors wait in the work dir (the executor never names them).
STAGING = ".reference-bridge"
#: One wait for a round's update before the Δ is sent again; the final round's, and its tries.
UPDATE_WAIT_S = 30.0
FINAL_UPDATE_WAIT_S = 5.0
FINAL_UPDATE_TRIES = 3
#: Pause after a pull that failed at once (the parameter server's worker unreachable).
PULL_RETRY_S = 1.0


@dataclass(frozen=True)
class SentRound:
    round: int
    samples: int
    delta: Path
    layout: SentLayout


@dataclass(frozen=True)
class Announced:
    """A round's converted update, staged for the trainer's event stream."""

    staged: Path
    from_peer: str


class ReferenceRounds:
    """θ_global, Δ and updates of one reference-style trainer; ``close()`` ends its tasks."""

    def __init__(self, ctx: BridgeContext) -> None:
        self.ctx = ctx
        self._theta: dict[str, torch.Tensor] | None = None
        self._theta_task: asyncio.Task[dict[str, torch.Tensor]] | None = None
        self._sent: asyncio.Queue[SentRound] = asyncio.Queue()
        self._driver: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._subscribers: set[asyncio.Queue[Announced]] = set()
        self._unannounced: list[Announced] = []
        self.closing = asyncio.Event()

    async def close(self) -> None:
        self.closing.set()
        tasks: list[asyncio.Task[Any]] = [*self._tasks]
        tasks += [t for t in (self._driver, self._theta_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def rounds(self) -> int:
        return int(self.ctx.dispatch.spec.diloco.rounds)

    def _log(self, line: str) -> None:
        self.ctx.logs.line("system", f"reference bridge: {line}")

    # ---- θ_global ---------------------------------------------------------------------------

    def start(self) -> None:
        """Pull the trainer's starting θ_global now, if not yet asked for."""
        if self._theta_task is None:
            self._theta_task = asyncio.create_task(self._fetch_theta(), name="reference-theta")

    async def _fetch_theta(self) -> dict[str, torch.Tensor]:
        while True:
            payload = await self._pull("global", self.ctx.dispatch.start_round, UPDATE_WAIT_S)
            if payload is not None:
                return await asyncio.to_thread(_decoded, payload)

    async def _theta_now(self) -> dict[str, torch.Tensor]:
        if self._theta is None:
            self.start()
            assert self._theta_task is not None
            self._theta = await self._theta_task
        return self._theta

    async def _pull(self, kind: str, round_number: int, wait_s: float) -> TensorPayload | None:
        dispatch = self.ctx.dispatch
        ps = dispatch.parameter_server_id
        try:
            return await self.ctx.exchange.fetch(
                dispatch.job_id, ps, dispatch.addresses_of(ps), kind, round_number, wait_s
            )
        except HyphaError as err:
            self._log(f"pulling {kind} of round {round_number}: {err.message}")
            await asyncio.sleep(PULL_RETRY_S)
            return None

    # ---- Δ out ------------------------------------------------------------------------------

    def send(self, peers: tuple[str, ...], path: Path, round_number: int, samples: int) -> None:
        """Send the trainer's file as round ``round_number``'s Δ, in the background."""
        task = asyncio.create_task(
            self._deliver(peers, path, round_number, samples), name=f"reference-send-{round_number}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, peers: tuple[str, ...], path: Path, round_number: int, samples: int) -> None:
        from hypha.worker.reference_tensors import delta_payload

        try:
            theta = await self._theta_now()
            blob, layout = await asyncio.to_thread(delta_payload, path, theta, round_number, samples)
            staged = self.ctx.work_dir / STAGING / f"delta-{round_number:08d}.safetensors"
            await asyncio.to_thread(write_private, staged, blob)
        except (HyphaError, OSError) as err:
            self._log(f"{path.name} not sent: {err.message if isinstance(err, HyphaError) else err}")
            return
        for peer in peers:
            if not self.ctx.dispatch.is_parameter_server(peer):
                self._log(f"{peer} is not this job's parameter server; the Δ goes to the server")
        sent = SentRound(round_number, samples, staged, layout)
        await self._send_delta(sent)
        await self._sent.put(sent)
        if self._driver is None:
            self._driver = asyncio.create_task(self._updates(), name="reference-updates")

    async def _send_delta(self, sent: SentRound) -> None:
        dispatch = self.ctx.dispatch
        ps = dispatch.parameter_server_id
        try:
            accepted, message = await self.ctx.exchange.send(
                dispatch.job_id, ps, dispatch.addresses_of(ps), "delta", sent.round, sent.samples, sent.delta
            )
        except HyphaError as err:
            accepted, message = False, err.message
        if not accepted:
            self._log(f"delta of round {sent.round} not delivered: {message}")

    # ---- updates back -----------------------------------------------------------------------

    async def _updates(self) -> None:
        """Each sent round's update, in order: pulled, converted, queued for the event streams."""
        from hypha.worker.reference_tensors import update_file, zero_update

        while True:
            sent = await self._sent.get()
            final = self.rounds > 0 and sent.round + 1 >= self.rounds
            payload = None
            for attempt in range(1, 1 << 30):
                payload = await self._pull(
                    "update", sent.round, FINAL_UPDATE_WAIT_S if final else UPDATE_WAIT_S
                )
                if payload is not None or (final and attempt >= FINAL_UPDATE_TRIES):
                    break
                await self._send_delta(sent)
            before = await self._theta_now()
            if payload is None:
                self._log(f"no update for the final round {sent.round}; announcing an empty one")
                blob = await asyncio.to_thread(zero_update, sent.layout)
            else:
                theta_new = await asyncio.to_thread(_decoded, payload, before)
                blob = await asyncio.to_thread(update_file, theta_new, before, sent.layout)
                self._theta = {**before, **theta_new}
            staged = self.ctx.work_dir / STAGING / f"update-{sent.round:08d}.safetensors"
            await asyncio.to_thread(write_private, staged, blob)
            sent.delta.unlink(missing_ok=True)
            self._announce(Announced(staged, self.ctx.dispatch.parameter_server_id))

    def _announce(self, update: Announced) -> None:
        if not self._subscribers:
            self._unannounced.append(update)
        for queue in self._subscribers:
            queue.put_nowait(update)

    def subscribe(self) -> asyncio.Queue[Announced]:
        """A queue of the updates to come (and those no stream has taken yet)."""
        queue: asyncio.Queue[Announced] = asyncio.Queue()
        for update in self._unannounced:
            queue.put_nowait(update)
        self._unannounced = []
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Announced]) -> None:
        self._subscribers.discard(queue)

    async def next_update(self, queue: asyncio.Queue[Announced], wait_s: float) -> Announced | None:
        """The next queued update; None after ``wait_s`` or once closing."""
        getter = asyncio.ensure_future(queue.get())
        closer = asyncio.ensure_future(self.closing.wait())
        try:
            done, _ = await asyncio.wait(
                {getter, closer}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            closer.cancel()
            if not getter.done():
                getter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if getter in done:
                return getter.result()
        return None


def _decoded(payload: TensorPayload, held: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A pulled θ_global in fp32 (from ``held`` and the change, when the job's ``update_dtype``
    sends changes: this side pulls every round's update in order, so ``held`` is their base);
    a payload spooled to disk is removed once read."""
    from hypha.diloco.updates import apply_change, change_base
    from hypha.worker.reference_tensors import decode_global

    if payload.path is None:
        data = payload.data
    else:
        try:
            data = payload.path.read_bytes()
        finally:
            payload.release()
    if held is not None and change_base(data) is not None:
        return apply_change(data, held)
    return decode_global(data)


def write_private(path: Path, data: bytes) -> Path:
    """``data`` as a file only the worker's user reads (0600, in a 0700 dir)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def link_private(source: Path, target: Path) -> int:
    """``source`` at ``target`` (a hard link within the work dir, else a copy), 0600; its size."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        write_private(target, source.read_bytes())
    os.chmod(target, 0o600)
    return target.stat().st_size


__all__ = ["STAGING", "Announced", "ReferenceRounds", "SentRound", "link_private", "write_private"]
