"""The ``Worker`` gRPC service: the market's lease calls and the status view.

Thin by design: the caller's peer id comes from the TLS session (or the
relay's gateway stamp), the request becomes domain arguments, the market
decides, and domain errors map to statuses in the server guard. Job dispatch
and tensor transfer are not served yet (the base class answers UNIMPLEMENTED).
"""

from __future__ import annotations

import grpc

from hypha.market.resources import ExecutorKind
from hypha.net.auth import peer_identity
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hypha.worker.market import WorkerMarket


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, market: WorkerMarket, name: str = "") -> None:
        self.market = market
        self.name = name

    async def AcceptOffer(
        self, request: worker_pb2.AcceptOfferRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Lease:
        holder = peer_identity(context).peer_id
        lease = self.market.accept_offer(request.offer_id, holder, request.lease_ttl_s)
        return lease.to_proto(worker_id=self.market.peer_id)

    async def ReleaseOffer(
        self, request: worker_pb2.ReleaseOfferRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseOfferResponse:
        holder = peer_identity(context).peer_id
        return worker_pb2.ReleaseOfferResponse(released=self.market.release_offer(request.offer_id, holder))

    async def RenewLease(
        self, request: worker_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Lease:
        holder = peer_identity(context).peer_id
        lease = self.market.renew_lease(request.lease_id, holder, request.lease_ttl_s)
        return lease.to_proto(worker_id=self.market.peer_id)

    async def ReleaseLease(
        self, request: worker_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseLeaseResponse:
        holder = peer_identity(context).peer_id
        return worker_pb2.ReleaseLeaseResponse(released=self.market.release_lease(request.lease_id, holder))

    async def GetStatus(
        self, request: worker_pb2.GetWorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        status = self.market.status()
        section = self.market.section
        return worker_pb2.WorkerStatus(
            peer_id=self.market.peer_id,
            name=self.name,
            capacity=status.capacity.to_proto(),
            free=status.free.to_proto(),
            leases=[lease.to_proto(worker_id=self.market.peer_id) for lease in status.leases],
            executors=[ExecutorKind.parse(name).to_proto() for name in section.executors],
            price=section.price,
            floor=section.floor,
        )
