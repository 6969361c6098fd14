"""The resource market's pure core: resources, pricing, leases, selection
policies, the worker's arbiter and the scheduler's allocator.

Nothing here does I/O or imports grpc/asyncio; time is always an argument.
The gRPC and pub/sub wiring lives in the worker and scheduler services.
"""

from hypha.market.allocator import Allocation, Choice, HeldLease, LeaseBook, renew_at
from hypha.market.arbiter import AdvertisementView, Arbiter, ArbiterConfig, OfferDecision, OfferStrategy
from hypha.market.leases import Lease, LeaseLedger, LeaseState
from hypha.market.policies import POLICY_NAMES, OfferView, SelectionPolicy, get_policy
from hypha.market.pricing import DEFAULT_WEIGHTS, PriceRange, Weights, capacity_units, score
from hypha.market.resources import ExecutorKind, Requirements, Resources

__all__ = [
    "DEFAULT_WEIGHTS",
    "POLICY_NAMES",
    "AdvertisementView",
    "Allocation",
    "Arbiter",
    "ArbiterConfig",
    "Choice",
    "ExecutorKind",
    "HeldLease",
    "Lease",
    "LeaseBook",
    "LeaseLedger",
    "LeaseState",
    "OfferDecision",
    "OfferStrategy",
    "OfferView",
    "PriceRange",
    "Requirements",
    "Resources",
    "SelectionPolicy",
    "Weights",
    "capacity_units",
    "get_policy",
    "renew_at",
    "score",
]
