"""A DHT node (bootstrap, announce, find providers) and the publisher that keeps records alive.

Gateways run a ``DhtNode`` as the stable bootstrap points; data nodes run one
with a ``Publisher`` that announces a signed provider record per dataset and
republishes it before it expires; schedulers call ``find_providers``. Every
lookup is bounded by a deadline, and every record is verified again by the
reader, whatever the storer claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from kademlia.network import Server
from kademlia.node import Node

from hypha.dht.protocol import (
    MAX_PAGES,
    ProviderProtocol,
    is_scalar_value,
    iterative_lookup,
    parse_nodes,
    provider_key,
)
from hypha.dht.records import (
    Clock,
    ProviderRecord,
    ProviderTable,
    RecordVerifier,
    next_seq,
    sign_record,
)
from hypha.errors import HyphaError, InvalidArgumentError
from hypha.pki.identity import peer_id_of

log = logging.getLogger(__name__)


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); InvalidArgumentError otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"DHT address must be host:port, got {address!r}")
    return host, int(port)


class DhtServer(Server):
    """kademlia's Server wired to ``ProviderProtocol`` with the configured RPC timeout."""

    protocol_class = ProviderProtocol

    def __init__(
        self,
        *,
        ksize: int,
        alpha: int,
        verifier: RecordVerifier,
        providers: ProviderTable,
        rpc_timeout_s: float,
    ) -> None:
        super().__init__(ksize=ksize, alpha=alpha)
        self.verifier = verifier
        self.providers = providers
        self.rpc_timeout_s = rpc_timeout_s

    def _create_protocol(self) -> ProviderProtocol:
        # The library builds its protocol with a hard-coded 5 s timeout here.
        return ProviderProtocol(
            self.node,
            self.storage,
            self.ksize,
            verifier=self.verifier,
            providers=self.providers,
            rpc_timeout_s=self.rpc_timeout_s,
        )

    def stop(self) -> None:
        super().stop()
        if self.protocol is not None:
            self.protocol.close()


class DhtNode:
    """One DHT participant over UDP. Build with ``await DhtNode.create(...)``; ``stop()`` is idempotent."""

    def __init__(
        self,
        *,
        verifier: RecordVerifier,
        bootstrap: Sequence[str],
        rpc_timeout_s: float,
        ksize: int,
        alpha: int,
        stall_s: float | None,
        min_stall_s: float,
        lookup_timeout_s: float,
        max_providers_per_key: int,
    ) -> None:
        if rpc_timeout_s <= 0 or lookup_timeout_s <= 0 or ksize < 1 or alpha < 1:
            raise InvalidArgumentError("DHT timeouts must be positive and ksize, alpha at least 1")
        for address in bootstrap:
            split_host_port(address)
        self.verifier = verifier
        self.providers = ProviderTable(
            max_per_key=max_providers_per_key, clock=verifier.clock, skew_s=verifier.max_skew_s
        )
        self.rpc_timeout_s = rpc_timeout_s
        #: A query older than this stops holding a lookup slot; None = adaptive (see ``current_stall_s``).
        self.stall_s = stall_s
        self.min_stall_s = min_stall_s
        self.lookup_timeout_s = lookup_timeout_s
        self.ksize = ksize
        self.alpha = alpha
        self._bootstrap = list(bootstrap)
        self._server = DhtServer(
            ksize=ksize, alpha=alpha, verifier=verifier, providers=self.providers, rpc_timeout_s=rpc_timeout_s
        )
        self.host = ""
        self.port = 0
        self._stopped = False

    @classmethod
    async def create(
        cls,
        listen_host: str = "127.0.0.1",
        port: int = 0,
        bootstrap: Sequence[str] = (),
        *,
        verifier: RecordVerifier,
        rpc_timeout_s: float = 2.0,
        ksize: int = 20,
        alpha: int = 3,
        stall_s: float | None = None,
        min_stall_s: float = 0.02,
        lookup_timeout_s: float = 10.0,
        max_providers_per_key: int = 64,
    ) -> DhtNode:
        """Bind UDP ``listen_host:port`` (0 = any free port, read into ``.port``); join via ``bootstrap``.

        Unreachable bootstrap peers are not an error: the first node of a
        network has none that answer yet, so joining is retried on the next
        announce or lookup while the routing table is empty.
        """
        node = cls(
            verifier=verifier,
            bootstrap=bootstrap,
            rpc_timeout_s=rpc_timeout_s,
            ksize=ksize,
            alpha=alpha,
            stall_s=stall_s,
            min_stall_s=min_stall_s,
            lookup_timeout_s=lookup_timeout_s,
            max_providers_per_key=max_providers_per_key,
        )
        await node._server.listen(port, listen_host)
        node.host, node.port = node._server.transport.get_extra_info("sockname")[:2]
        if node._bootstrap:
            await node.bootstrap()
        return node

    @property
    def node_id(self) -> bytes:
        return self._server.node.id

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def protocol(self) -> ProviderProtocol:
        return self._server.protocol

    def current_stall_s(self) -> float:
        """When a lookup stops waiting on a query: the fixed ``stall_s``, or else adaptive.

        Adaptive: ``srtt + 4 * rttvar`` of this node's answered RPCs, at least
        ``min_stall_s`` and at most half the RPC timeout.
        """
        if self.stall_s is not None:
            return self.stall_s
        return self.protocol.rtt.stall_s(self.min_stall_s, self.rpc_timeout_s / 2)

    def contacts(self) -> int:
        """How many peers the routing table holds."""
        return sum(len(bucket) for bucket in self.protocol.router.buckets)

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._server.stop()

    async def __aenter__(self) -> DhtNode:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- joining ---------------------------------------------------------------

    async def bootstrap(self, addresses: Sequence[str] | None = None) -> int:
        """Ping the bootstrap peers, then walk toward our own id to fill the routing table.

        Returns the number of contacts afterwards.
        """
        targets = await self._resolve(self._bootstrap if addresses is None else addresses)
        answers = await asyncio.gather(*(self.protocol.ping(addr, self.node_id) for addr in targets))
        seeds = []
        for (ip, port), (ok, node_id) in zip(targets, answers, strict=True):
            if ok and isinstance(node_id, bytes) and len(node_id) == 20 and node_id != self.node_id:
                seed = Node(node_id, ip, port)
                self.protocol.welcome_if_new(seed)
                seeds.append(seed)
        if not seeds:
            log.warning(
                "no DHT bootstrap peer answered (%s)", ", ".join(self._bootstrap) or "none configured"
            )
            return self.contacts()
        await self._walk(self.node_id, self._find_node_query(self.node_id), self.lookup_timeout_s)
        return self.contacts()

    async def _resolve(self, addresses: Sequence[str]) -> list[tuple[str, int]]:
        loop = asyncio.get_running_loop()
        family = self._server.transport.get_extra_info("socket").family
        resolved: list[tuple[str, int]] = []
        for address in addresses:
            host, port = split_host_port(address)
            try:
                infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
            except OSError as err:
                log.warning("cannot resolve DHT bootstrap peer %s: %s", address, err)
                continue
            if infos:
                sockaddr = infos[0][4]
                resolved.append((str(sockaddr[0]), int(sockaddr[1])))
        return resolved

    async def _ensure_joined(self) -> None:
        if self.contacts() == 0 and self._bootstrap:
            await self.bootstrap()

    # -- lookups ---------------------------------------------------------------

    def _find_node_query(self, target: bytes) -> Any:
        target_node = Node(target)

        async def query(node: Node) -> list[Node] | None:
            ok, value = await self.protocol.call_find_node(node, target_node)
            return parse_nodes(value) if ok else None

        return query

    async def _walk(self, target: bytes, query: Any, timeout_s: float) -> list[Node]:
        seeds = self.protocol.router.find_neighbors(Node(target), k=self.ksize)
        return await iterative_lookup(
            self.node_id,
            target,
            seeds,
            query,
            ksize=self.ksize,
            alpha=self.alpha,
            stall_s=self.current_stall_s,
            deadline=asyncio.get_running_loop().time() + timeout_s,
        )

    async def announce(
        self, record_blob: bytes, key: str | None = None, *, timeout_s: float | None = None
    ) -> int:
        """Store a signed provider record locally and on the ``ksize`` closest nodes to its dataset.

        ``key`` is the dataset name and defaults to the record's; a mismatch
        is refused. Our own verifier checks the record first, so a record no
        peer would accept fails here, loudly. Returns how many remote nodes
        accepted it (0 means only this node holds it). Takes at most
        ``timeout_s`` (default ``lookup_timeout_s``) plus one RPC timeout.
        """
        record = self.verifier.verify(record_blob)
        if key is not None and key != record.dataset:
            raise InvalidArgumentError(f"record is for dataset {record.dataset!r}, not {key!r}")
        dkey = provider_key(record.dataset)
        self.providers.put(dkey, record, record_blob)
        await self._ensure_joined()
        nodes = await self._walk(dkey, self._find_node_query(dkey), timeout_s or self.lookup_timeout_s)
        stored = await asyncio.gather(*(self.protocol.call_add_provider(n, dkey, record_blob) for n in nodes))
        accepted = sum(stored)
        log.debug("announced %s seq %d on %d/%d nodes", record.dataset, record.seq, accepted, len(nodes))
        return accepted

    async def find_providers(self, dataset: str, timeout_s: float | None = None) -> list[ProviderRecord]:
        """Every live, verified provider of ``dataset`` the closest nodes know, newest seq per provider.

        Returns within ``timeout_s`` (default ``lookup_timeout_s``) with what
        was found by then. Ordered by provider peer id.
        """
        dkey = provider_key(dataset)
        best: dict[str, ProviderRecord] = {}

        def consider(blob: bytes) -> None:
            try:
                record = self.verifier.verify(blob)
            except HyphaError as err:
                log.debug("dropping provider record for %s: %s", dataset, err.message)
                return
            if record.dataset != dataset:
                return
            current = best.get(record.provider)
            if current is None or record.seq > current.seq:
                best[record.provider] = record

        for _, blob in self.providers.get(dkey):
            consider(blob)

        async def query(node: Node) -> list[Node] | None:
            nodes: list[Node] | None = None
            after = ""
            for _ in range(MAX_PAGES):
                page = await self.protocol.call_get_providers(node, dkey, after)
                if page is None:
                    break
                if nodes is None:
                    nodes = page.nodes
                for blob in page.blobs:
                    consider(blob)
                if page.next_after is None or page.next_after <= after:
                    break
                after = page.next_after
            return nodes

        await self._ensure_joined()
        await self._walk(dkey, query, timeout_s or self.lookup_timeout_s)
        return [best[p] for p in sorted(best)]

    # -- plain values ------------------------------------------------------------

    async def set_value(self, key: str, value: bytes | str | int | float | bool) -> bool:
        """Store an unsigned scalar under ``key`` (kademlia's own store; nobody vouches for it)."""
        if not is_scalar_value(value):
            raise InvalidArgumentError("a DHT value must be bytes, str, int, float or bool within 8137 bytes")
        await self._ensure_joined()
        return bool(await self._server.set(key, value))

    async def get_value(self, key: str) -> Any:
        """The scalar some node stored under ``key``, or None."""
        await self._ensure_joined()
        return await self._server.get(key)


@dataclass
class _Published:
    dataset: str
    addresses: tuple[str, ...]
    slice_count: int
    record: ProviderRecord
    #: Clock time of the next republish.
    due: float


class Publisher:
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

    async def publish(self, dataset: str, addresses: Sequence[str], slice_count: int) -> ProviderRecord:
        """Sign and announce a fresh record for ``dataset``, then keep it alive until ``withdraw``."""
        entry = await self._announce(dataset, tuple(addresses), slice_count)
        self._published[dataset] = entry
        self._wake.set()
        return entry.record

    def withdraw(self, dataset: str) -> None:
        """Stop republishing ``dataset``; storers drop its record when it expires."""
        self._published.pop(dataset, None)
        self._wake.set()

    async def _announce(self, dataset: str, addresses: tuple[str, ...], slice_count: int) -> _Published:
        async with self._lock:
            now = self.clock()
            seq = next_seq(self._last_seq.get(dataset), now)
            record = ProviderRecord.issue(
                dataset, self.provider, addresses, slice_count, seq=seq, now=now, lifetime_s=self.lifetime_s
            )
            blob = sign_record(record, self._key, self._chain)
            self._last_seq[dataset] = seq
            due = now + self.lifetime_s * self.republish_fraction
            if await self.node.announce(blob) == 0:
                log.warning("provider record for %s reached no DHT peer; retrying", dataset)
                due = min(due, self.clock() + self.retry_s)
            return _Published(dataset, addresses, slice_count, record, due)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dht-publisher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

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
                    renewed = await self._announce(entry.dataset, entry.addresses, entry.slice_count)
                except (HyphaError, OSError) as err:
                    log.warning("republishing %s failed: %s", entry.dataset, err)
                    entry.due = self.clock() + self.retry_s
                    continue
                if self._published.get(entry.dataset) is entry:  # not withdrawn or re-published meanwhile
                    self._published[entry.dataset] = renewed
