"""A DHT node: bootstrap, announce, find providers.

Gateways run a ``DhtNode`` as the stable bootstrap points; data nodes run one
with a ``Publisher`` (``hypha.dht.publisher``); schedulers call
``find_providers``. Every lookup is bounded by a deadline, and every record is
verified again by the reader, whatever the storer claimed.

A lookup answers as soon as it holds enough verified providers (one by
default: every storer keeps the whole set, so the first answer is usually
all of it) and lets its walk finish in the background, filling the
``ProviderCache`` that the next lookups of that dataset answer from.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import Any

from kademlia.network import Server
from kademlia.node import Node

from hypha.dht.cache import ProviderCache
from hypha.dht.health import PeerHealth, RttWindow
from hypha.dht.lookup import iterative_lookup
from hypha.dht.protocol import MAX_PAGES, NoValues, ProviderProtocol, parse_nodes, provider_key
from hypha.dht.provider_table import ProviderTable
from hypha.dht.records import ProviderRecord, RecordVerifier
from hypha.errors import InvalidArgumentError
from hypha.service import BackgroundTasks, Service

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
        rtt: RttWindow,
        health: PeerHealth,
    ) -> None:
        super().__init__(ksize=ksize, alpha=alpha, storage=NoValues())
        self.verifier = verifier
        self.providers = providers
        self.rpc_timeout_s = rpc_timeout_s
        self.rtt = rtt
        self.health = health

    def _create_protocol(self) -> ProviderProtocol:
        # The library builds its protocol with a hard-coded 5 s timeout here.
        return ProviderProtocol(
            self.node,
            self.storage,
            self.ksize,
            verifier=self.verifier,
            providers=self.providers,
            rpc_timeout_s=self.rpc_timeout_s,
            rtt=self.rtt,
            health=self.health,
        )

    def stop(self) -> None:
        super().stop()
        if self.protocol is not None:
            self.protocol.close()


class DhtNode(Service):
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
        max_stall_s: float | None,
        lookup_timeout_s: float,
        max_providers_per_key: int,
        cache_fresh_s: float,
        max_records_per_provider: int = 256,
        max_stored_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if rpc_timeout_s <= 0 or lookup_timeout_s <= 0 or ksize < 1 or alpha < 1:
            raise InvalidArgumentError("DHT timeouts must be positive and ksize, alpha at least 1")
        if min_stall_s <= 0 or (max_stall_s is not None and max_stall_s < min_stall_s) or cache_fresh_s < 0:
            raise InvalidArgumentError("0 < min_stall_s <= max_stall_s and cache_fresh_s >= 0")
        for address in bootstrap:
            split_host_port(address)
        self.verifier = verifier
        self.providers = ProviderTable(
            max_per_key=max_providers_per_key,
            max_per_provider=max_records_per_provider,
            max_bytes=max_stored_bytes,
            clock=verifier.clock,
            skew_s=verifier.max_skew_s,
        )
        self.rpc_timeout_s = rpc_timeout_s
        #: A query older than this stops holding a lookup slot; None = adaptive (see ``current_stall_s``).
        self.stall_s = stall_s
        self.min_stall_s = min_stall_s
        self.max_stall_s = rpc_timeout_s / 2 if max_stall_s is None else min(max_stall_s, rpc_timeout_s)
        self.lookup_timeout_s = lookup_timeout_s
        self.ksize = ksize
        self.alpha = alpha
        #: A dataset whose walk ended less than this ago is answered from the cache alone.
        self.cache_fresh_s = cache_fresh_s
        self.cache = ProviderCache(verifier, max_per_dataset=max_providers_per_key)
        self.health = PeerHealth()
        self._bootstrap = list(bootstrap)
        self._server = DhtServer(
            ksize=ksize,
            alpha=alpha,
            verifier=verifier,
            providers=self.providers,
            rpc_timeout_s=rpc_timeout_s,
            rtt=RttWindow(),
            health=self.health,
        )
        #: Walks that outlived their lookup's answer, at most one per dataset.
        self._refreshing: dict[str, asyncio.Task[list[Node]]] = {}
        self._background = BackgroundTasks(log)
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
        min_stall_s: float = 0.005,
        max_stall_s: float | None = None,
        lookup_timeout_s: float = 10.0,
        max_providers_per_key: int = 64,
        cache_fresh_s: float = 2.0,
        max_records_per_provider: int = 256,
        max_stored_bytes: int = 64 * 1024 * 1024,
        join: bool = True,
    ) -> DhtNode:
        """Bind UDP ``listen_host:port`` (0 = any free port, read into ``.port``); join via ``bootstrap``.

        Unreachable bootstrap peers are not an error: the first node of a
        network has none that answer yet, so joining is retried on the next
        announce or lookup while the routing table is empty. ``join=False``
        leaves joining to the caller (``bootstrap()``) or to that first use.
        """
        node = cls(
            verifier=verifier,
            bootstrap=bootstrap,
            rpc_timeout_s=rpc_timeout_s,
            ksize=ksize,
            alpha=alpha,
            stall_s=stall_s,
            min_stall_s=min_stall_s,
            max_stall_s=max_stall_s,
            lookup_timeout_s=lookup_timeout_s,
            max_providers_per_key=max_providers_per_key,
            cache_fresh_s=cache_fresh_s,
            max_records_per_provider=max_records_per_provider,
            max_stored_bytes=max_stored_bytes,
        )
        await node._server.listen(port, listen_host)
        node.host, node.port = node._server.transport.get_extra_info("sockname")[:2]
        if join and node._bootstrap:
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

        Adaptive: the 90th percentile of this node's last 64 answered RPCs'
        round trips, times 3, at least ``min_stall_s`` and at most
        ``max_stall_s`` (default half the RPC timeout).
        """
        if self.stall_s is not None:
            return self.stall_s
        return self.protocol.rtt.stall_s(self.min_stall_s, self.max_stall_s)

    def contacts(self) -> int:
        """How many peers the routing table holds."""
        return sum(len(bucket) for bucket in self.protocol.router.buckets)

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self._background.cancel()
            self._server.stop()

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
            skip=lambda node: self.health.backing_off(node.id),
            on_stall=self.protocol.peer_failed,
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

    async def find_providers(
        self, dataset: str, timeout_s: float | None = None, *, min_providers: int | None = 1
    ) -> list[ProviderRecord]:
        """Live, verified providers of ``dataset``, newest seq per provider, ordered by peer id.

        Answers as soon as ``min_providers`` distinct providers are verified
        (from a cache refreshed less than ``cache_fresh_s`` ago, this node's
        own store, or the first storers that answer); the walk then goes on
        in the background to refresh the cache. ``min_providers=None`` waits
        for the whole walk: every provider the closest nodes know. Returns
        within ``timeout_s`` (default ``lookup_timeout_s``) with what was
        found by then, plus unexpired cached records.
        """
        if min_providers is not None and min_providers < 1:
            raise InvalidArgumentError("min_providers must be at least 1 (or None: the whole walk)")
        cached = self.cache.get(dataset)
        if (
            min_providers is not None
            and len(cached) >= min_providers
            and self.cache.is_fresh(dataset, self.cache_fresh_s)
        ):
            return cached
        dkey = provider_key(dataset)
        found: dict[str, ProviderRecord] = {}
        enough = asyncio.Event()

        def consider(blob: bytes) -> None:
            record = self.cache.add(dataset, blob)  # verifies; None when it does not
            if record is None:
                return
            current = found.get(record.provider)
            if current is None or record.seq > current.seq:
                found[record.provider] = record

        def answered() -> None:
            # Counted per whole answer (every page), so the early answer is one storer's full set.
            if min_providers is not None and len(found) >= min_providers:
                enough.set()

        for _, blob in self.providers.get(dkey):
            consider(blob)
        answered()

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
            answered()
            return nodes

        if not enough.is_set():
            await self._ensure_joined()
        walk = self._background.spawn(
            self._walk(dkey, query, timeout_s or self.lookup_timeout_s), name=f"dht-find-{dataset}"
        )
        walk.add_done_callback(lambda done: self._walk_ended(dataset, done))
        early = asyncio.ensure_future(enough.wait())
        try:
            await asyncio.wait({walk, early}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            early.cancel()
            if not walk.done() and (not enough.is_set() or dataset in self._refreshing):
                walk.cancel()  # the caller gave up, or another walk already refreshes this dataset
            elif not walk.done():
                self._refreshing[dataset] = walk
        for record in self.cache.get(dataset):
            current = found.get(record.provider)
            if current is None or record.seq > current.seq:
                found[record.provider] = record
        return [found[p] for p in sorted(found)]

    async def wait_refreshed(self) -> None:
        """Until the walks that outlived their lookups' answers have ended (tests, benchmarks)."""
        while self._refreshing:
            await asyncio.wait(list(self._refreshing.values()))

    def _walk_ended(self, dataset: str, walk: asyncio.Task[list[Node]]) -> None:
        if self._refreshing.get(dataset) is walk:
            del self._refreshing[dataset]
        if not walk.cancelled():
            self.cache.mark_refreshed(dataset)
