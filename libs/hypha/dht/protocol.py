"""The Kademlia wire protocol, hardened, plus provider-set RPCs (ARCHITECTURE §4).

What the stock ``kademlia`` 2.2.3 protocol lacks, and this subclass adds:

- a configurable RPC timeout (the library fixes it at 5 s, so one dead peer
  stalls a lookup round for 5 s);
- ``add_provider`` / ``get_providers``: the library keeps one value per key,
  but a dataset has several providers. A storer keeps a verified set per key
  (``ProviderTable``) and answers with pages of record blobs plus closer nodes;
- no plain values: kademlia's ``store`` is refused from every peer (anyone
  on UDP could otherwise fill a storer with unsigned values kept a week),
  and the node keeps none (``NoValues``); the DHT carries signed provider
  records only, in a ``ProviderTable`` bounded per dataset, per provider and
  in bytes;
- validation of everything a peer sends: malformed responses count as no
  response, and malformed datagrams are dropped quietly instead of raising
  in a task;
- the wire codec on the ``msgpack`` C extension: rpcudp's frames and the
  same bytes, but the library's pure-Python u-msgpack spends ~85 us on each
  provider reply (packing and again unpacking), a third of a loopback walk.
  Replies are handled in the datagram callback, without a task each.

Every call this node makes is timed and remembered (``hypha.dht.health``):
answers feed the RTT window the stall threshold comes from, and failures the
backoff table that lets lookups skip a peer that just failed; a peer is
dropped from routing only after repeated failures, not after one lost
datagram. The reply is awaited even after the caller gave up on it (a
stalled query), so a late answer still counts as the peer being alive.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import logging
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.storage import IStorage

from hypha.dht.health import PeerHealth, RttWindow
from hypha.dht.provider_table import ProviderTable
from hypha.dht.records import MAX_RECORD_BYTES, RecordVerifier
from hypha.errors import HyphaError
from hypha.service import BackgroundTasks

log = logging.getLogger(__name__)

#: Largest plain value a peer may store: what kademlia's 8 KiB request limit leaves for it.
MAX_VALUE_BYTES = 8137
#: Bytes of record blobs in one get_providers answer. It keeps a reply near
#: the size of the largest request the library sends, well under a UDP datagram.
PAGE_BUDGET_BYTES = 7000
#: rpcudp's limit on a request body, kept so peers on the stock library accept ours.
MAX_REQUEST_BYTES = 8192
#: A reader follows at most this many pages from one storer.
MAX_PAGES = 32
_SCALARS = (bytes, str, int, float, bool)


def provider_key(dataset: str) -> bytes:
    """The 160-bit DHT key under which providers of ``dataset`` are stored.

    Namespaced so that a plain value stored under the dataset's name cannot
    collide with (or be mistaken for) its provider set.
    """
    return hashlib.sha1(b"hypha/providers/" + dataset.encode("utf-8")).digest()


class NoValues(IStorage):
    """The plain-value store of a node that keeps no plain values: writes vanish, reads find nothing."""

    def __setitem__(self, key: Any, value: Any) -> None:
        return None

    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return default

    def iter_older_than(self, seconds_old: float) -> Iterator[tuple[Any, Any]]:
        return iter(())

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return iter(())


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
        rtt: RttWindow | None = None,
        health: PeerHealth | None = None,
    ) -> None:
        # NOTE: RPCProtocol.__getattr__ turns any unknown attribute into a remote
        # call, so every attribute this class reads is set here, before use.
        self.verifier = verifier
        self.providers = providers
        self._background = BackgroundTasks(log)
        self.rtt = RttWindow() if rtt is None else rtt
        self.health = PeerHealth() if health is None else health
        #: Plain ``store`` requests refused (every one that arrives).
        self.refused_stores = 0
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
        """Always refused: nobody vouches for a plain value (signed provider records only)."""
        self.refused_stores += 1
        log.debug("refusing a plain store from %s", sender)
        return False

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

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._background.spawn(coro, name="dht-push")

    # -- calling -------------------------------------------------------------

    async def _call(self, node: Node, method: str, *args: Any) -> tuple[bool, Any]:
        remote = getattr(self, method)
        started = asyncio.get_running_loop().time()
        reply: asyncio.Future[tuple[bool, Any]] = remote((node.ip, node.port), self.source_node.id, *args)
        reply.add_done_callback(lambda done: self._settle(node, started, done))
        # Shielded: a lookup that stops waiting (stalled query, early answer)
        # leaves the reply to arrive or time out, and _settle to record which.
        return await asyncio.shield(reply)

    def _settle(self, node: Node, started: float, reply: asyncio.Future[tuple[bool, Any]]) -> None:
        if reply.cancelled():
            return
        if reply.result()[0]:
            self.rtt.observe(asyncio.get_running_loop().time() - started)
            self.health.succeeded(node.id)
        else:
            self.peer_failed(node)

    def peer_failed(self, node: Node) -> None:
        """``node`` timed out or stalled: back it off, and drop it from routing once it keeps failing."""
        if self.health.failed(node.id):
            log.debug("dropping %s from routing after %d failures", node, self.health.failures(node.id))
            self.router.remove_contact(node)

    def _nonsense(self, node: Node) -> tuple[bool, None]:
        """A malformed answer counts as a failure of its peer (no answer at all)."""
        self.peer_failed(node)
        return False, None

    def handle_call_response(self, result: Any, node: Node) -> Any:
        """The library drops a peer from routing on its first failure; here ``peer_failed`` decides."""
        if not result[0]:
            return result
        return super().handle_call_response(result, node)

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        ok, value = await self._call(node_to_ask, "find_node", node_to_find.id)
        if ok and parse_nodes(value) is None:
            ok, value = self._nonsense(node_to_ask)
        return self.handle_call_response((ok, value), node_to_ask)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        ok, value = await self._call(node_to_ask, "find_value", node_to_find.id)
        if ok:
            if isinstance(value, dict):
                if set(value) != {"value"} or not is_scalar_value(value["value"]):
                    ok, value = self._nonsense(node_to_ask)
            elif parse_nodes(value) is None:
                ok, value = self._nonsense(node_to_ask)
        return self.handle_call_response((ok, value), node_to_ask)

    async def call_add_provider(self, node: Node, key: bytes, blob: bytes) -> bool:
        ok, value = await self._call(node, "add_provider", key, blob)
        self.handle_call_response((ok, value), node)
        return bool(ok and value is True)

    async def call_get_providers(self, node: Node, key: bytes, after: str = "") -> ProvidersPage | None:
        """One page from ``node``; None when it did not answer or answered nonsense."""
        ok, value = await self._call(node, "get_providers", key, after)
        page = _parse_page(value) if ok else None
        if ok and page is None:
            self._nonsense(node)
        self.handle_call_response((page is not None, value), node)
        return page

    # -- wire: rpcudp's framing, msgpack's C codec ------------------------------
    # NOTE: replaces rpcudp 5.0's (pinned by kademlia 2.2.3) private datagram
    # handling and request closures. A datagram is a kind byte (0 request,
    # 1 reply), a 20-byte message id and a msgpack body; ``msgpack`` packs the
    # same bytes as the library's u-msgpack, so stock peers interoperate.
    # Malformed input is dropped quietly (the library raises in a task).

    def __getattr__(self, name: str) -> Any:
        """``self.ping(address, *args)`` and the like: a request to the peer's ``rpc_<name>``, as rpcudp's."""
        if name.startswith(("_", "rpc_")):
            raise AttributeError(name)
        return functools.partial(self._request, name)

    def _request(self, name: str, address: Any, *args: Any) -> asyncio.Future[tuple[bool, Any]]:
        """Send one request; the future holds (True, answer), or (False, None) after the RPC timeout."""
        body = _pack([name, list(args)])
        if len(body) > MAX_REQUEST_BYTES:
            raise HyphaError(f"a DHT request is at most {MAX_REQUEST_BYTES} bytes, {name} was {len(body)}")
        msg_id = os.urandom(20)
        self.transport.sendto(b"\x00" + msg_id + body, address)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        self._outstanding[msg_id] = (future, loop.call_later(self._wait_timeout, self._timeout, msg_id))
        return future

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(data) < 22:
            log.debug("dropping a %d-byte datagram from %s", len(data), addr)
            return
        try:
            body = _unpack(data[21:])
        except Exception as err:  # a peer's garbage must not become an error here
            log.debug("dropping malformed datagram from %s: %r", addr, err)
            return
        if data[:1] == b"\x01":
            self._accept_response(data[1:21], body, addr)
        elif data[:1] == b"\x00":
            self._accept_request(data[1:21], body, addr)

    def _accept_request(self, msg_id: bytes, data: Any, address: Any) -> None:
        try:
            if not isinstance(data, list) or len(data) != 2 or not isinstance(data[0], str):
                raise ValueError("not a [name, args] request")
            name, args = data
            handler = getattr(self, f"rpc_{name}", None)
            if handler is None or not callable(handler) or not isinstance(args, list):
                raise ValueError(f"no rpc_{name}, or its arguments are not a list")
            response = handler(address, *args)
        except Exception as err:
            log.debug("dropping request from %s that failed: %r", address, err)
            return
        if inspect.isawaitable(response):
            self._background.spawn(self._answer_later(msg_id, response, address), name="dht-answer")
        else:
            self._answer(msg_id, response, address)

    async def _answer_later(self, msg_id: bytes, response: Any, address: Any) -> None:
        try:
            result = await response
        except Exception as err:
            log.debug("dropping request from %s that failed: %r", address, err)
            return
        self._answer(msg_id, result, address)

    def _answer(self, msg_id: bytes, response: Any, address: Any) -> None:
        try:
            body = _pack(response)
        except Exception as err:
            log.debug("cannot encode the answer to %s: %r", address, err)
            return
        if self.transport is not None:
            self.transport.sendto(b"\x01" + msg_id + body, address)

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
        self._background.cancel_nowait()


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    # Any map key, as u-msgpack allows; the parsers check what they read.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


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
