"""Workers as a person reads them: by the name on their certificate, not by their peer id.

Job events and job records carry peer ids (32 characters); the scheduler knows
each worker's name from its offers (``ListWorkers``). The demo's live view and
``hypha watch`` / ``hypha status`` ask it, and ask again when a worker they
have not seen appears (a replacement, or one whose first offer came later).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from hypha.v1 import scheduler_pb2, scheduler_pb2_grpc


async def worker_names(stub: scheduler_pb2_grpc.SchedulerStub) -> dict[str, str]:
    """Peer id -> certificate name of the workers the scheduler knows by name."""
    listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=10)
    return {view.peer.peer_id: view.peer.name for view in listed.workers if view.peer.name}


def shown(names: Mapping[str, str] | None, peer_id: str) -> str:
    """A worker's name, or its peer id where no name is known."""
    return (names or {}).get(peer_id) or peer_id


class WorkerNames:
    """The names a view shows its workers by, learnt as they appear.

    An id not seen before is looked up in the scheduler once: asking only at
    the start showed a late worker by a peer-id prefix beside the others' names.
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, known: dict[str, str] | None = None) -> None:
        self.stub = stub
        #: Peer id -> name; a view may hold this very dict.
        self.known: dict[str, str] = {} if known is None else known
        #: Ids already asked about (once each: the scheduler may know no name for one); None: never asked.
        self._asked: set[str] | None = None

    async def learn(self, worker_ids: Sequence[str]) -> dict[str, str]:
        """Ask the scheduler when an id is new (always on the first call); best effort. The names."""
        new = set(worker_ids) - set(self.known) - (self._asked or set())
        if self._asked is not None and not new:
            return self.known
        self._asked = (self._asked or set()) | new
        try:
            found = await worker_names(self.stub)
        except grpc.aio.AioRpcError:  # a name is a nicety: the view falls back to the peer id
            return self.known
        self.known.update({peer: name for peer, name in found.items() if peer not in self.known})
        return self.known
