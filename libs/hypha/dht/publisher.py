"""The publisher that keeps a data node's provider records alive in the DHT.

Each republish bumps ``seq`` and renews ``issued_at``/``expires_at``, so
storers replace the old record and readers see the newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from hypha.dht.node import DhtNode
from hypha.dht.records import Clock, ProviderRecord, next_seq, sign_record
from hypha.errors import HyphaError, InvalidArgumentError
from hypha.pki.identity import peer_id_of
from hypha.service import Service, cancel_and_wait

log = logging.getLogger(__name__)


@dataclass
class _Published:
    dataset: str
    addresses: tuple[str, ...]
    slice_count: int
    record: ProviderRecord
    #: Clock time of the next republish.
    due: float
    #: The dataset's ``Manifest.digest``, carried by every record (see ``ProviderRecord``).
    manifest_sha256: str = ""


class Publisher(Service):
    """Announces this node's provider records and re-signs each before it expires.

    Each republish bumps ``seq`` and renews ``issued_at``/``expires_at``, so
    storers replace the old record and readers see the newest. A republish
    that reached no remote node is retried after ``retry_s``.
    """

    def __init__(
        self,
        node: DhtNode,
        key: ec.EllipticCurvePrivateKey,
        chain: Sequence[x509.Certificate],
        *,
        lifetime_s: float = 3600.0,
        republish_fraction: float = 0.5,
        retry_s: float = 5.0,
        clock: Clock = time.time,
    ) -> None:
        if lifetime_s <= 0 or not 0 < republish_fraction < 1 or retry_s <= 0:
            raise InvalidArgumentError(
                "lifetime_s and retry_s must be positive, republish_fraction in (0, 1)"
            )
        if not chain:
            raise InvalidArgumentError("a publisher needs its certificate chain")
        self.node = node
        self._key = key
        self._chain = list(chain)
        self.provider = peer_id_of(self._chain[0])
        self.lifetime_s = lifetime_s
        self.republish_fraction = republish_fraction
        self.retry_s = retry_s
        self.clock = clock
        self._published: dict[str, _Published] = {}
        self._last_seq: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def records(self) -> dict[str, ProviderRecord]:
        """The newest record announced per dataset."""
        return {name: entry.record for name, entry in self._published.items()}

    async def publish(
        self, dataset: str, addresses: Sequence[str], slice_count: int, manifest_sha256: str = ""
    ) -> ProviderRecord:
        """Sign and announce a fresh record for ``dataset``, then keep it alive until ``withdraw``.

        ``manifest_sha256`` pins the dataset's content (a data node always passes it)."""
        entry = await self._announce(dataset, tuple(addresses), slice_count, manifest_sha256)
        self._published[dataset] = entry
        self._wake.set()
        return entry.record

    def withdraw(self, dataset: str) -> None:
        """Stop republishing ``dataset``; storers drop its record when it expires."""
        self._published.pop(dataset, None)
        self._wake.set()

    async def _announce(
        self, dataset: str, addresses: tuple[str, ...], slice_count: int, manifest_sha256: str
    ) -> _Published:
        async with self._lock:
            now = self.clock()
            seq = next_seq(self._last_seq.get(dataset), now)
            record = ProviderRecord.issue(
                dataset,
                self.provider,
                addresses,
                slice_count,
                seq=seq,
                now=now,
                lifetime_s=self.lifetime_s,
                manifest_sha256=manifest_sha256,
            )
            blob = sign_record(record, self._key, self._chain)
            self._last_seq[dataset] = seq
            due = now + self.lifetime_s * self.republish_fraction
            if await self.node.announce(blob) == 0:
                log.warning("provider record for %s reached no DHT peer; retrying", dataset)
                due = min(due, self.clock() + self.retry_s)
            return _Published(dataset, addresses, slice_count, record, due, manifest_sha256)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dht-publisher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock()
            wait = min((e.due for e in self._published.values()), default=None)
            if wait is None or wait > now:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), None if wait is None else wait - now)
                continue
            for entry in list(self._published.values()):
                if entry.due > self.clock():
                    continue
                try:
                    renewed = await self._announce(
                        entry.dataset, entry.addresses, entry.slice_count, entry.manifest_sha256
                    )
                except (HyphaError, OSError) as err:
                    log.warning("republishing %s failed: %s", entry.dataset, err)
                    entry.due = self.clock() + self.retry_s
                    continue
                if self._published.get(entry.dataset) is entry:  # not withdrawn or re-published meanwhile
                    self._published[entry.dataset] = renewed
