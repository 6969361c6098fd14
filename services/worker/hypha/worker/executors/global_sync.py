"""θ_global on the trainer's side: pulled when it joins, Δ out and the update back at each sync.

The trainer (``diloco_trainer``) decides when to sync and keeps each round's
books (samples, metrics, checkpoint); ``GlobalSync`` holds the last θ_global
the parameter server sent and moves the tensors, through a
``ps_link.ParameterServerLink``:

- ``join``: the current θ_global ("global") into the model;
- ``sync_model``, a whole-model round: Δ = θ_local - θ_global for the
  round's samples is encoded with the job's codec (``delta_dtype``; int8 and
  top-k keep the compression residual, docs/compression.md), sent, and the
  round's update replaces the model's parameters;
- streaming (``fragments``): ``send_fragment`` takes round r's fragment
  (r mod F) and its Δ, with the samples since its last sync, and sends it in
  a background task that returns the fragment's new θ_global;
  ``merge_fragment`` merges that into the model (``rebase_fragment``).

Each Δ sent stays on disk until the next round's update has come: while it
waits for an update the trainer sends it again before the current one
(``ps_link``), so a parameter server restored one round behind this trainer
can redo that round from the same deltas.

An update is θ_global itself, or (``update_dtype`` other than fp32,
``hypha.diloco.updates``) its change since the θ_global of the round it names,
added to the one held here. A trainer that holds θ_global of another round
(it missed an update) fetches the next round's θ_global whole instead: adding
a change to the wrong base would leave it on a θ_global nobody else holds.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch
from torch import nn

from hypha.diloco.streaming import fragments_for, rebase_fragment
from hypha.diloco.updates import apply_change, change_base
from hypha.tensors.deltas import DeltaEncoder
from hypha.tensors.payload import read_metadata
from hypha.worker.executors.bridge_api import GLOBAL, GLOBAL_ROUND_KEY
from hypha.worker.executors.inner_steps import (
    apply_global,
    compute_delta,
    decode_global,
    encode_delta,
    parameter_state,
)
from hypha.worker.executors.ps_link import ParameterServerLink, SentDelta

logger = logging.getLogger("hypha.worker.executors.global_sync")

#: What a fragment's exchange returns: its new θ_global (None: the final round's, not
#: served) and the Δ's size in bytes.
FragmentUpdate = tuple[dict[str, torch.Tensor] | None, int]


class GlobalSync:
    """θ_global and the Δ/update exchange of one trainer's model."""

    def __init__(
        self,
        link: ParameterServerLink,
        encoder: DeltaEncoder,
        work_dir: Path,
        model: nn.Module,
        streaming_fragments: int,
        overlap: bool,
    ) -> None:
        self.link = link
        self.encoder = encoder
        self.work_dir = work_dir
        self.theta_global: dict[str, torch.Tensor] = parameter_state(model)
        #: The global round of ``theta_global`` (θ_global after that many rounds).
        self.global_round = 0
        #: Streaming fragments (parameter names), None for whole-model rounds.
        self.fragments = fragments_for(self.theta_global, streaming_fragments)
        if self.fragments is None and overlap:
            # Overlapped whole-model rounds: one fragment that is the whole model (trainer's module doc).
            self.fragments = [list(self.theta_global)]
        #: Samples trained since each fragment's last sync (streaming: a fragment's Δ weight).
        self._unsynced_samples = [0] * len(self.fragments or ())
        #: The last round's Δ, kept until the next round's update comes (module doc).
        self._kept: SentDelta | None = None

    async def join(self, model: nn.Module, round_number: int) -> int | None:
        """Set the model to the current θ_global; the round it belongs to, from its metadata (if said)."""
        data = await self.link.fetch(GLOBAL, round_number)
        params = decode_global(data, self.theta_global)
        apply_global(model, params)
        self.theta_global = params
        meta_round = read_metadata(data).get(GLOBAL_ROUND_KEY)
        joined = int(meta_round) if meta_round is not None and meta_round.isdigit() else None
        self.global_round = round_number if joined is None else joined
        return joined

    async def sync_model(self, model: nn.Module, round_number: int, samples: int, *, final: bool) -> int:
        """Send Δ (when ``samples``), wait for the round's update and set the model to it; Δ's size."""
        sent = None
        if samples > 0:
            delta = compute_delta(model, self.theta_global)
            sent = await self._send(delta, round_number, samples)
            del delta
        try:
            data = await self.link.fetch_update(round_number, resend=self._resend(sent), final=final)
        except BaseException:
            self._keep(sent, final=True)
            raise
        if data is not None:
            params = await self._updated(data, round_number, list(self.theta_global))
            apply_global(model, params)
            self.theta_global = params
        return self._keep(sent, final=final)

    async def _send(self, delta: dict[str, torch.Tensor], round_number: int, samples: int) -> SentDelta:
        """Encode Δ, write it where it is kept, and send it."""
        blob = await asyncio.to_thread(encode_delta, delta, self.encoder, round_number, samples)
        sent = SentDelta(self.work_dir / f"delta-{round_number:08d}.safetensors", round_number, samples)
        await asyncio.to_thread(sent.path.write_bytes, blob)
        await self.link.send_delta(sent)
        return sent

    def _resend(self, sent: SentDelta | None) -> list[SentDelta]:
        """What a wait for the update sends again: the kept Δ of the round before, then this one."""
        return [s for s in (self._kept, sent) if s is not None]

    def _keep(self, sent: SentDelta | None, *, final: bool) -> int:
        """The round's update came: the Δ before it is no longer needed; keep ``sent`` (not after
        the ``final`` round, or a failed wait). Returns ``sent``'s size in bytes."""
        size = 0 if sent is None else sent.path.stat().st_size
        for old in (self._kept, sent if final else None):
            if old is not None:
                old.path.unlink(missing_ok=True)
        self._kept = None if final else sent
        return size

    # ---- streaming: one fragment per round, in flight while training goes on ---------------

    def send_fragment(
        self, model: nn.Module, round_number: int, round_samples: int, *, final: bool
    ) -> tuple[dict[str, torch.Tensor], asyncio.Task[FragmentUpdate]]:
        """Start round r's fragment exchange in the background: the local values sent, and the task."""
        assert self.fragments is not None
        fragment = round_number % len(self.fragments)
        names = self.fragments[fragment]
        self._unsynced_samples = [n + round_samples for n in self._unsynced_samples]
        samples, self._unsynced_samples[fragment] = self._unsynced_samples[fragment], 0
        params = dict(model.named_parameters())
        sent = {n: params[n].detach().to(device="cpu", dtype=torch.float32, copy=True) for n in names}
        delta = {n: sent[n] - self.theta_global[n] for n in names}
        task = asyncio.create_task(self._exchange_fragment(round_number, names, delta, samples, final))
        return sent, task

    async def _exchange_fragment(
        self, round_number: int, names: list[str], delta: dict[str, torch.Tensor], samples: int, final: bool
    ) -> FragmentUpdate:
        """Encode, send and await one fragment's update.

        Returns its new θ_global (None: the final round's, not served) and the Δ's size in bytes.
        """
        sent = await self._send(delta, round_number, samples) if samples > 0 else None
        del delta
        try:
            data = await self.link.fetch_update(round_number, resend=self._resend(sent), final=final)
        except BaseException:
            self._keep(sent, final=True)
            raise
        size = self._keep(sent, final=final)
        if data is None:
            return None, size
        return await self._updated(data, round_number, names), size

    async def _updated(self, data: bytes, round_number: int, names: list[str]) -> dict[str, torch.Tensor]:
        """Round ``round_number``'s new θ_global of ``names`` (of every tensor when θ_global had to be
        fetched whole)."""
        base = change_base(data)
        if base is None:
            params = decode_global(data, {n: self.theta_global[n] for n in names})
        elif base == self.global_round:
            params = await asyncio.to_thread(apply_change, data, {n: self.theta_global[n] for n in names})
        else:
            logger.warning(
                "the update of round %d applies to θ_global of round %d, this trainer holds round %d's: "
                "fetching θ_global whole",
                round_number,
                base,
                self.global_round,
            )
            whole = await self.link.fetch(GLOBAL, round_number + 1)
            params = decode_global(whole, self.theta_global)
        self.global_round = round_number + 1
        return params

    def merge_fragment(
        self, model: nn.Module, sent: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
    ) -> None:
        """Merge a fragment's new θ_global into the model, keeping the steps taken since ``sent``
        (since the θ_global held, for tensors outside the fragment: θ_global fetched whole)."""
        reference = {n: sent[n] if n in sent else self.theta_global[n] for n in params}
        rebase_fragment(dict(model.named_parameters()), reference, params)
        self.theta_global.update(params)
