"""The Kademlia wire protocol, hardened, plus provider-set RPCs (ARCHITECTURE §4).

What the stock ``kademlia`` 2.2.3 protocol lacks, and this subclass adds:

- a configurable RPC timeout (the library fixes it at 5 s, so one dead peer
  stalls a lookup round for 5 s);
- ``add_provider`` / ``get_providers``: the library keeps one value per key,
  but a dataset has several providers. A storer keeps a verified set per key
  (``ProviderTable``) and answers with pages of record blobs plus closer nodes;
- validation of everything a peer sends: a plain ``store`` of a non-scalar
  value is refused (the library would keep it and every later ``get()`` of
  that key would raise), malformed responses count as no response, and
  malformed datagrams are dropped quietly instead of raising in a task.

``iterative_lookup`` is the one lookup loop used for announcing and finding
providers: it keeps ``alpha`` queries in flight, stops counting a query
against ``alpha`` once it has stalled, and finishes without waiting for dead
peers once enough of the closest nodes have answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.storage import IStorage

from hypha.dht.records import MAX_RECORD_BYTES, ProviderTable, RecordVerifier
from hypha.errors import HyphaError

log = logging.getLogger(__name__)

#: Largest plain value a peer may store: what kademlia's 8 KiB request limit leaves for it.
MAX_VALUE_BYTES = 8137
#: Bytes of record blobs in one get_providers answer. It keeps a reply near
#: the size of the largest request the library sends, well under a UDP datagram.
PAGE_BUDGET_BYTES = 7000
#: A reader follows at most this many pages from one storer.
MAX_PAGES = 32
_SCALARS = (bytes, str, int, float, bool)


def provider_key(dataset: str) -> bytes:
    """The 160-bit DHT key under which providers of ``dataset`` are stored.

    Namespaced so that a plain value stored under the dataset's name cannot
    collide with (or be mistaken for) its provider set.
    """
    return hashlib.sha1(b"hypha/providers/" + dataset.encode("utf-8")).digest()


def is_scalar_value(value: object) -> bool:
    """Whether a plain ``store`` may keep ``value``: the library's scalar types, within the size limit."""
    if type(value) not in _SCALARS:
        return False
    if isinstance(value, bytes | str):
        return len(value) <= MAX_VALUE_BYTES
    return True


def _is_id(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == 20


def parse_nodes(value: object) -> list[Node] | None:
    """Nodes from a peer's (id, ip, port) list, or None when anything in it is malformed."""
    if not isinstance(value, list | tuple) or len(value) > 256:
        return None
    nodes = []
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 3:
            return None
        node_id, ip, port = item
        if not _is_id(node_id) or not isinstance(ip, str) or not ip or len(ip) > 255:
            return None
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            return None
        nodes.append(Node(node_id, ip, port))
    return nodes


class RttEstimator:
    """Smoothed round-trip time of this node's answered RPCs (Jacobson/Karels, as TCP's RTO).

    Lookups use it to decide when a query has stalled: a peer that has not
    answered within ``srtt + 4 * rttvar`` is probably dead, whatever the
    fixed RPC timeout says, so on a fast network a dead peer costs
    milliseconds and on a slow one the threshold grows with the RTT.
    """

    def __init__(self) -> None:
        self.srtt_s: float | None = None
        self.rttvar_s = 0.0

    def observe(self, rtt_s: float) -> None:
        if self.srtt_s is None:
            self.srtt_s, self.rttvar_s = rtt_s, rtt_s / 2
            return
        self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(self.srtt_s - rtt_s)
        self.srtt_s = 0.875 * self.srtt_s + 0.125 * rtt_s

    def stall_s(self, floor_s: float, cap_s: float) -> float:
        """``srtt + 4 * rttvar`` within [floor_s, cap_s]; ``cap_s`` until an RPC has been answered."""
        if self.srtt_s is None:
            return cap_s
        return min(cap_s, max(floor_s, self.srtt_s + 4 * self.rttvar_s))


@dataclass(frozen=True)
class ProvidersPage:
    """One get_providers answer: record blobs (unverified), closer nodes, and the paging cursor."""

    blobs: list[bytes]
    nodes: list[Node]
    next_after: str | None


class ProviderProtocol(KademliaProtocol):
    """kademlia's protocol with a configurable timeout, provider sets and input validation."""

    def __init__(
        self,
        source_node: Node,
        storage: IStorage,
        ksize: int,
        *,
        verifier: RecordVerifier,
        providers: ProviderTable,
        rpc_timeout_s: float,
    ) -> None:
        # NOTE: RPCProtocol.__getattr__ turns any unknown attribute into a remote
        # call, so every attribute this class reads is set here, before use.
        self.verifier = verifier
        self.providers = providers
        self._background: set[asyncio.Task[Any]] = set()
        self.rtt = RttEstimator()
        super().__init__(source_node, storage, ksize)
        self._wait_timeout = rpc_timeout_s

    # -- serving -------------------------------------------------------------

    def _source(self, sender: Any, nodeid: object) -> Node | None:
        if not _is_id(nodeid) or nodeid == self.source_node.id:
            return None
        return Node(nodeid, sender[0], sender[1])

    def rpc_ping(self, sender: Any, nodeid: object) -> bytes | None:
        if self._source(sender, nodeid) is None:
            return None
        return super().rpc_ping(sender, nodeid)

    def rpc_find_node(self, sender: Any, nodeid: object, key: object) -> list[Any] | None:
        if self._source(sender, nodeid) is None or not _is_id(key):
            return None
        return super().rpc_find_node(sender, nodeid, key)

    def rpc_find_value(self, sender: Any, nodeid: object, key: object) -> Any:
        if self._source(sender, nodeid) is None or not _is_id(key):
            return None
        return super().rpc_find_value(sender, nodeid, key)

    def rpc_store(self, sender: Any, nodeid: object, key: object, value: object) -> bool:
        if self._source(sender, nodeid) is None or not _is_id(key):
            return False
        if not is_scalar_value(value):
            log.debug("refusing store of a %s from %s", type(value).__name__, sender)
            return False
        return bool(super().rpc_store(sender, nodeid, key, value))

    def rpc_add_provider(self, sender: Any, nodeid: object, key: object, blob: object) -> bool:
        """Keep a provider record if it verifies and belongs under ``key``."""
        source = self._source(sender, nodeid)
        if source is None or not _is_id(key) or not isinstance(blob, bytes) or len(blob) > MAX_RECORD_BYTES:
            return False
        self.welcome_if_new(source)
        try:
            record = self.verifier.verify(blob)
        except HyphaError as err:
            log.debug("refusing provider record from %s: %s", sender, err.message)
            return False
        if provider_key(record.dataset) != key:
            log.debug("refusing provider record from %s: stored under the wrong key", sender)
            return False
        return self.providers.put(key, record, blob).accepted

    def rpc_get_providers(self, sender: Any, nodeid: object, key: object, after: object) -> Any:
        """A page of record blobs under ``key`` (providers after ``after``) plus closer nodes."""
        source = self._source(sender, nodeid)
        if source is None or not isinstance(key, bytes) or not _is_id(key) or not isinstance(after, str):
            return None
        self.welcome_if_new(source)
        blobs: list[bytes] = []
        used = 0
        next_after: str | None = None
        last_provider = after
        for record, blob in self.providers.get(key):
            if record.provider <= after:
                continue
            if blobs and used + len(blob) > PAGE_BUDGET_BYTES:
                next_after = last_provider
                break
            blobs.append(blob)
            used += len(blob)
            last_provider = record.provider
        neighbors = self.router.find_neighbors(Node(key), exclude=source)
        return {"providers": blobs, "next": next_after, "nodes": [tuple(n) for n in neighbors]}

    def welcome_if_new(self, node: Node) -> None:
        """Also hand provider sets to a new node that is now among their closest (Kademlia §2.5)."""
        if self.router.is_new_node(node):
            for key, entries in self.providers.items():
                if self._should_replicate_to(node, Node(key)):
                    for _, blob in entries:
                        self._spawn(self.call_add_provider(node, key, blob))
        super().welcome_if_new(node)

    def _should_replicate_to(self, node: Node, keynode: Node) -> bool:
        neighbors = self.router.find_neighbors(keynode)
        if not neighbors:
            return True
        new_node_close = node.distance_to(keynode) < neighbors[-1].distance_to(keynode)
        this_closest = self.source_node.distance_to(keynode) < neighbors[0].distance_to(keynode)
        return bool(new_node_close and this_closest)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- calling -------------------------------------------------------------

    async def _call(self, node: Node, method: str, *args: Any) -> tuple[bool, Any]:
        remote = getattr(self, method)
        loop = asyncio.get_running_loop()
        started = loop.time()
        ok, value = await remote((node.ip, node.port), self.source_node.id, *args)
        if ok:
            self.rtt.observe(loop.time() - started)
        return ok, value

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        ok, value = await self._call(node_to_ask, "find_node", node_to_find.id)
        if ok and parse_nodes(value) is None:
            ok, value = False, None
        return self.handle_call_response((ok, value), node_to_ask)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        ok, value = await self._call(node_to_ask, "find_value", node_to_find.id)
        if ok:
            if isinstance(value, dict):
                if set(value) != {"value"} or not is_scalar_value(value["value"]):
                    ok, value = False, None
            elif parse_nodes(value) is None:
                ok, value = False, None
        return self.handle_call_response((ok, value), node_to_ask)

    async def call_add_provider(self, node: Node, key: bytes, blob: bytes) -> bool:
        ok, value = await self._call(node, "add_provider", key, blob)
        self.handle_call_response((ok, value), node)
        return bool(ok and value is True)

    async def call_get_providers(self, node: Node, key: bytes, after: str = "") -> ProvidersPage | None:
        """One page from ``node``; None when it did not answer or answered nonsense."""
        ok, value = await self._call(node, "get_providers", key, after)
        page = _parse_page(value) if ok else None
        self.handle_call_response((page is not None, value), node)
        return page

    # -- rpcudp hardening ----------------------------------------------------
    # NOTE: these override private rpcudp methods (pinned by kademlia 2.2.3's
    # rpcudp 5.0): the library raises inside fire-and-forget tasks on malformed
    # input and on a reply to a request whose caller gave up.

    async def _solve_datagram(self, datagram: bytes, address: Any) -> None:
        try:
            await super()._solve_datagram(datagram, address)
        except Exception as err:  # a peer's garbage must not become a task error
            log.debug("dropping malformed datagram from %s: %r", address, err)

    async def _accept_request(self, msg_id: bytes, data: Any, address: Any) -> None:
        try:
            await super()._accept_request(msg_id, data, address)
        except Exception as err:
            log.debug("dropping request from %s that failed: %r", address, err)

    def _accept_response(self, msg_id: bytes, data: Any, address: Any) -> None:
        entry = self._outstanding.pop(msg_id, None)
        if entry is None:
            log.debug("ignoring reply %s from %s: unknown or timed out", msg_id.hex(), address)
            return
        future, timeout = entry
        timeout.cancel()
        if not future.done():
            future.set_result((True, data))

    def _timeout(self, msg_id: bytes) -> None:
        entry = self._outstanding.pop(msg_id, None)
        if entry is not None and not entry[0].done():
            log.debug("no reply to %s within %.2fs", msg_id.hex(), self._wait_timeout)
            entry[0].set_result((False, None))

    def close(self) -> None:
        """Fail every outstanding call and stop background pushes (the transport is closing)."""
        for future, timeout in list(self._outstanding.values()):
            timeout.cancel()
            if not future.done():
                future.set_result((False, None))
        self._outstanding.clear()
        for task in list(self._background):
            task.cancel()


def _parse_page(value: object) -> ProvidersPage | None:
    if not isinstance(value, dict) or set(value) != {"providers", "next", "nodes"}:
        return None
    blobs, next_after = value["providers"], value["next"]
    if not isinstance(blobs, list) or not all(isinstance(b, bytes) for b in blobs):
        return None
    if next_after is not None and not (isinstance(next_after, str) and blobs):
        return None
    nodes = parse_nodes(value["nodes"])
    if nodes is None:
        return None
    return ProvidersPage(blobs, nodes, next_after)


#: A lookup query: ask one node, return the closer nodes it named, or None if it failed.
Query = Callable[[Node], Awaitable[list[Node] | None]]


async def iterative_lookup(
    self_id: bytes,
    target: bytes,
    seeds: Sequence[Node],
    query: Query,
    *,
    ksize: int,
    alpha: int,
    stall_s: float | Callable[[], float],
    deadline: float | None = None,
) -> list[Node]:
    """Walk toward ``target``; return the closest nodes that answered (at most ``ksize``).

    Unlike the library's lock-step rounds (each round waits for its slowest,
    possibly dead, peer), up to ``alpha`` queries are kept in flight, and a
    query older than ``stall_s`` (a number, or a function read at every step
    so it can adapt as answers arrive) stops counting against ``alpha``. The walk
    ends when every one of the ``ksize`` closest known nodes has answered or
    failed, or when only stalled queries remain among them and at least half
    of them answered.

    NOTE: ending with stalled peers unasked-for is safe for provider lookups
    because every record is stored on all ``ksize`` closest nodes; it turns a
    dead peer's full RPC timeout into at most ``stall_s``. The caller bounds
    the whole walk with ``deadline`` (event-loop time): when it passes, the
    walk returns what it has and abandons the queries still in flight.
    """
    loop = asyncio.get_running_loop()
    target_node = Node(target)
    known: dict[bytes, Node] = {}
    state: dict[bytes, str] = {}  # new | pending | ok | failed
    started: dict[bytes, float] = {}
    tasks: dict[asyncio.Task[list[Node] | None], Node] = {}

    def learn(nodes: Sequence[Node]) -> None:
        for node in nodes:
            if node.id != self_id and node.id not in known:
                known[node.id] = node
                state[node.id] = "new"

    async def ask(node: Node) -> list[Node] | None:
        try:
            return await query(node)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a query must never break the walk
            log.debug("lookup query to %s failed: %r", node, err)
            return None

    learn(seeds)
    ranked: list[Node] = []
    stall_of = stall_s if callable(stall_s) else lambda: stall_s
    try:
        while True:
            now = loop.time()
            stall = stall_of()
            if deadline is not None and now >= deadline:
                log.debug("lookup for %s reached its deadline", target.hex())
                break
            ranked = sorted(
                (n for n in known.values() if state[n.id] != "failed"), key=target_node.distance_to
            )[:ksize]
            fresh = sum(1 for n in tasks.values() if now - started[n.id] < stall)
            for node in ranked:
                if fresh >= alpha:
                    break
                if state[node.id] == "new":
                    state[node.id] = "pending"
                    started[node.id] = now
                    tasks[asyncio.ensure_future(ask(node))] = node
                    fresh += 1
            states = [state[n.id] for n in ranked]
            if "new" not in states:
                pending = [n for n in ranked if state[n.id] == "pending"]
                stalled_only = all(now - started[n.id] >= stall for n in pending)
                if not pending or (stalled_only and states.count("ok") >= math.ceil(len(ranked) / 2)):
                    break
            if not tasks:
                break
            wake = [started[n.id] + stall - now for n in tasks.values() if now - started[n.id] < stall]
            if deadline is not None:
                wake.append(deadline - now)
            done, _ = await asyncio.wait(
                tasks, timeout=min(wake) if wake else None, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                node = tasks.pop(task)
                found = task.result()
                if found is None:
                    state[node.id] = "failed"
                else:
                    state[node.id] = "ok"
                    learn(found)
    finally:
        for task in tasks:
            task.cancel()
    return [n for n in ranked if state[n.id] == "ok"]
