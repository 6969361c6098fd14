"""The iterative Kademlia walk used for announcing and finding providers.

It keeps ``alpha`` queries in flight, stops counting a query against
``alpha`` once it has stalled, skips peers that failed recently (asking them
only if nobody else answered), and finishes without waiting for dead peers
once enough of the closest nodes have answered.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

from kademlia.node import Node

log = logging.getLogger(__name__)


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
    skip: Callable[[Node], bool] | None = None,
    on_stall: Callable[[Node], None] | None = None,
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
    because every record is stored on the ``ksize`` closest nodes that answered
    its announce; it turns a dead peer's full RPC timeout into at most
    ``stall_s``. The price: a live storer that was merely slow when a record
    was announced lacks it until the record's next republish, so one storer's
    answer (``find_providers``' early answer) may name fewer providers than
    the whole walk does. The caller bounds
    the whole walk with ``deadline`` (event-loop time): when it passes, the
    walk returns what it has and abandons the queries still in flight.

    ``skip(node)`` says a node failed recently: it is left out of the walk,
    unless the walk would otherwise end with no answer at all, then the
    skipped nodes get their turn. ``on_stall(node)`` is called once for each
    query that stalled.
    """
    loop = asyncio.get_running_loop()
    target_node = Node(target)
    known: dict[bytes, Node] = {}
    state: dict[bytes, str] = {}  # new | pending | ok | failed | skipped
    started: dict[bytes, float] = {}
    tasks: dict[asyncio.Task[list[Node] | None], Node] = {}

    def learn(nodes: Sequence[Node]) -> None:
        for node in nodes:
            if node.id != self_id and node.id not in known:
                known[node.id] = node
                state[node.id] = "skipped" if skip is not None and skip(node) else "new"

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
    stalled: set[bytes] = set()
    retried_skipped = skip is None
    stall_of = stall_s if callable(stall_s) else lambda: stall_s
    try:
        while True:
            now = loop.time()
            stall = stall_of()
            if deadline is not None and now >= deadline:
                log.debug("lookup for %s reached its deadline", target.hex())
                break
            ranked = sorted(
                (n for n in known.values() if state[n.id] not in ("failed", "skipped")),
                key=target_node.distance_to,
            )[:ksize]
            fresh = 0
            for node in tasks.values():
                if now - started[node.id] < stall:
                    fresh += 1
                elif on_stall is not None and node.id not in stalled:
                    stalled.add(node.id)
                    on_stall(node)
            for node in ranked:
                if fresh >= alpha:
                    break
                if state[node.id] == "new":
                    state[node.id] = "pending"
                    started[node.id] = now
                    tasks[asyncio.ensure_future(ask(node))] = node
                    fresh += 1
            states = [state[n.id] for n in ranked]
            finished = not tasks
            if "new" not in states:
                pending = [n for n in ranked if state[n.id] == "pending"]
                stalled_only = all(now - started[n.id] >= stall for n in pending)
                if not pending or (stalled_only and states.count("ok") >= math.ceil(len(ranked) / 2)):
                    finished = True
            if finished:
                if retried_skipped or "ok" in state.values() or "skipped" not in state.values():
                    break
                retried_skipped = True  # nobody else answered: ask the recently failed after all
                for node_id, value in state.items():
                    if value == "skipped":
                        state[node_id] = "new"
                continue
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
