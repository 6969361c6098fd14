"""Who serves a dataset: the scheduler's DHT endpoint, used only for provider lookups.

A DiLoCo job names a dataset; the data nodes that serve it announce provider
records in the DHT (signed, checked by ``RecordVerifier``). The scheduler
looks them up once per job and hands them to the trainers with every slice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hypha.dht.node import DhtNode
from hypha.dht.records import ProviderRecord, RecordVerifier
from hypha.errors import FailedPreconditionError, HyphaError, NotFoundError, UnavailableError
from hypha.net.tls import TlsMaterial
from hypha.scheduler.config import SchedulerSection
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)

#: Pause between two lookups while no provider answered.
LOOKUP_RETRY_S = 1.0
#: Longest a submit looks for the dataset before refusing the job (a data node
#: that just started has announced by then; a misspelled name never will).
ADMIT_WAIT_S = 5.0


class DatasetProviders:
    """The scheduler's DHT endpoint: started with the jobs, stopped after them.

    It joins the DHT in the background: the join walks contacts the gateways
    name, some of them nodes that are gone, each costing an RPC timeout, and a
    restarted scheduler must not keep its jobs waiting for that (2 s of a
    scheduler restart's recovery, measured in the compose chaos run). The
    first lookup waits for the join in progress instead.
    """

    def __init__(self, tls: TlsMaterial, section: SchedulerSection) -> None:
        self.tls = tls
        self.section = section
        self.dht: DhtNode | None = None
        self._joining: asyncio.Task[int] | None = None

    async def start(self) -> None:
        self.dht = await DhtNode.create(
            self.section.dht_host,
            self.section.dht_port,
            self.section.dht_bootstrap,
            verifier=RecordVerifier(self.tls.trusted_cas, revocation=self.tls.revocation),
            rpc_timeout_s=self.section.dht_rpc_timeout_s,
            lookup_timeout_s=self.section.dht_lookup_timeout_s,
            min_stall_s=self.section.dht_min_stall_s,
            max_stall_s=self.section.dht_max_stall_s,
            cache_fresh_s=self.section.dht_cache_fresh_s,
            join=False,
        )
        self._joining = asyncio.create_task(self.dht.bootstrap(), name="scheduler DHT join")
        self._joining.add_done_callback(_joined)

    async def stop(self) -> None:
        dht, self.dht = self.dht, None
        joining, self._joining = self._joining, None
        if joining is not None:
            joining.cancel()
            await asyncio.wait([joining])
        if dht is not None:
            await dht.stop()

    async def find(self, dataset: str) -> list[ProviderRecord]:
        dht, joining = self.dht, self._joining
        if dht is None:
            raise UnavailableError("the scheduler's DHT endpoint is not running")
        if joining is not None:
            # A failed join is no error here: the lookup joins again while it knows no one.
            await asyncio.wait([joining])
        return await dht.find_providers(dataset)

    async def find_within(
        self, dataset: str, wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> list[ProviderRecord]:
        """The dataset's providers, looking again until some answer or ``wait_s`` passed (then [])."""
        deadline = clock() + wait_s
        while True:
            try:
                records = await self.find(dataset)
            except HyphaError as err:
                log.info("provider lookup of %s failed: %s", dataset, err.message)
                records = []
            if records or clock() >= deadline:
                return one_content(dataset, records)
            await asyncio.sleep(LOOKUP_RETRY_S)

    async def require(self, dataset: str, wait_s: float = ADMIT_WAIT_S) -> None:
        """Refuse a dataset no data node announces (looking for up to ``wait_s``): NotFoundError."""
        if not await self.find_within(dataset, wait_s):
            raise NotFoundError(f"dataset {dataset!r} not found: no data node announces it in the DHT")


def _joined(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and (err := task.exception()) is not None:
        log.warning("joining the DHT failed (the first lookup tries again): %r", err)


def one_content(dataset: str, records: list[ProviderRecord]) -> list[ProviderRecord]:
    """The records, refused when they pin different contents under one name.

    A dataset is its name *and* its manifest: two data nodes announcing
    different manifests (or one unpinned) under the same name is either a
    mistake or an impostor, and the scheduler cannot tell which copy the job's
    author meant, so the job is refused naming both pins instead of mixing
    slices from two datasets (FailedPreconditionError).
    """
    pins: dict[str, list[str]] = {}
    for record in records:
        pins.setdefault(record.manifest_sha256, []).append(record.provider)
    if len(pins) > 1:
        listed = "; ".join(
            f"{pin[:12] or 'unpinned'} from {', '.join(sorted(peers))}" for pin, peers in sorted(pins.items())
        )
        raise FailedPreconditionError(
            f"data nodes serve different contents under the name {dataset!r} ({listed}); "
            "revoke the wrong node's certificate or rename one dataset"
        )
    return records


def provider_peer(record: ProviderRecord) -> common_pb2.PeerInfo:
    """A provider record as the ``PeerInfo`` a trainer fetches slices from."""
    return common_pb2.PeerInfo(
        peer_id=record.provider,
        role=common_pb2.ROLE_DATA,
        addresses=list(record.addresses),
        manifest_sha256=record.manifest_sha256,
    )


__all__ = ["ADMIT_WAIT_S", "DatasetProviders", "one_content", "provider_peer"]
