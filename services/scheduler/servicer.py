"""The scheduler's gRPC services, kept thin: identity from the TLS session (or
the relay's gateway stamp), proto to domain at the edge, the market decides.

``SchedulerControlServicer`` is the worker-facing side (only workers may call
it, per ``hypha.net.policy``); ``SchedulerServicer`` is the client API. Only
the market's parts are served so far: ``SubmitOffer`` and ``ListWorkers``;
every other RPC answers UNIMPLEMENTED from the generated base class until the
job service fills it in.
"""

from __future__ import annotations

from collections import defaultdict

import grpc

from hypha.market.allocator import HeldLease
from hypha.market.policies import OfferView
from hypha.market.resources import Resources
from hypha.net.auth import peer_identity
from hypha.scheduler.market import SchedulerMarket, held_lease_to_proto
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc


class SchedulerControlServicer(scheduler_pb2_grpc.SchedulerControlServicer):
    def __init__(self, market: SchedulerMarket) -> None:
        self.market = market

    async def SubmitOffer(
        self, request: common_pb2.Offer, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitOfferResponse:
        # NOTE: the offer's worker_id field is ignored: only the session says who offers.
        worker_id = peer_identity(context).peer_id
        offer = OfferView.from_proto(request, worker_id=worker_id)
        return scheduler_pb2.SubmitOfferResponse(received=self.market.submit_offer(offer))


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, market: SchedulerMarket) -> None:
        self.market = market

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        """The workers this scheduler holds leases on, one entry per worker."""
        by_worker: dict[str, list[HeldLease]] = defaultdict(list)
        for lease in self.market.leases():
            by_worker[lease.worker_id].append(lease)
        views = []
        for worker_id, leases in sorted(by_worker.items()):
            views.append(
                scheduler_pb2.WorkerView(
                    peer=common_pb2.PeerInfo(
                        peer_id=worker_id,
                        role=common_pb2.ROLE_WORKER,
                        addresses=list(self.market.worker_addresses(worker_id)),
                    ),
                    capacity=self.market.worker_capacity(worker_id).to_proto(),
                    leased=Resources.total(lease.resources for lease in leases).to_proto(),
                    leases=[held_lease_to_proto(lease, self.market.peer_id) for lease in leases],
                    healthy=True,
                    job_id=next((lease.job_id for lease in leases if lease.job_id), ""),
                )
            )
        return scheduler_pb2.ListWorkersResponse(workers=views)
