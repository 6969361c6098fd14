"""The workers the scheduler's market has heard from, and the channels it calls them on.

Every offer makes its worker *known* (the offer-sampling lottery sizes itself
on that pool, and ``hypha workers`` lists it); an offer that is kept, or a
lease taken back after a restart, also tells where the worker listens and
what its machine holds, which accepts, renewals and releases dial. A kept
offer's channel is opened at once (``warm``), while the round still collects,
so the accept does not pay for the TLS handshakes.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import grpc

from hypha.errors import HyphaError
from hypha.market.policies import OfferView
from hypha.market.resources import Resources
from hypha.net.connector import PeerConnector
from hypha.scheduler.worker_calls import describe, worker_stub
from hypha.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownWorker:
    """A worker this scheduler has heard from (it offered on an advertisement), leased or not."""

    worker_id: str
    name: str  #: its certificate's name
    capacity: Resources  #: its whole machine, as it last told
    addresses: tuple[str, ...]
    seen_at: float  #: when its last offer arrived (the market's clock)


@dataclass
class _WorkerInfo:
    addresses: tuple[str, ...] = ()
    capacity: Resources = field(default_factory=Resources)


class MarketWorkers:
    """Known workers, where to reach the ones the market deals with, and stubs to call them."""

    def __init__(self, connector: PeerConnector) -> None:
        self.connector = connector
        self._info: dict[str, _WorkerInfo] = {}
        self._known: dict[str, KnownWorker] = {}

    def heard(self, offer: OfferView, name: str, now: float) -> None:
        """Any offer, even a late or refused one, makes its worker known."""
        self._known[offer.worker_id] = KnownWorker(
            offer.worker_id, name, offer.machine(), offer.worker_addresses, now
        )

    def learn(self, worker_id: str, addresses: Collection[str], capacity: Resources | None) -> None:
        """Remember where ``worker_id`` listens (none given: keep the last) and its machine."""
        info = self._info.setdefault(worker_id, _WorkerInfo())
        info.addresses = tuple(addresses) or info.addresses
        if capacity is not None:
            info.capacity = capacity

    def known(self) -> list[KnownWorker]:
        return [self._known[worker_id] for worker_id in sorted(self._known)]

    def known_ids(self) -> Collection[str]:
        return self._known.keys()

    def addresses(self, worker_id: str) -> tuple[str, ...]:
        info = self._info.get(worker_id)
        return () if info is None else info.addresses

    def capacity(self, worker_id: str) -> Resources:
        info = self._info.get(worker_id)
        return Resources() if info is None else info.capacity

    async def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        return await worker_stub(self.connector, worker_id, self.addresses(worker_id))

    async def invalidate(self, worker_id: str, err: BaseException) -> None:
        """After a failed call: forget the path only when it was the path that failed."""
        if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE:
            await self.connector.invalidate(worker_id)

    def dialled(self, worker_id: str) -> bool:
        """Whether a channel to ``worker_id`` is already cached (direct or relayed)."""
        return self.connector.is_direct(worker_id) is not None

    async def warm(self, worker_id: str) -> None:
        """Open the channel to ``worker_id`` now; a failure is left to the call that follows.

        The accept (or release) that follows waits on the connector's lock for
        this dial instead of starting its own.
        """
        try:
            await self.stub(worker_id)
        except HyphaError as err:  # the accept or release will try again and say why
            log.debug("no channel to worker %s yet: %s", worker_id, describe(err))
