"""Which roles may call which method: the one table the auth interceptor and
the relay endpoint both consult.

Unknown methods are denied (default deny), so a new RPC is unreachable until
someone decides who may call it.
"""

from __future__ import annotations

from hypha.pki.identity import Role

_ANY = frozenset(Role)
_OPERATORS = frozenset({Role.CLIENT, Role.ADMIN})
_NODES = frozenset({Role.GATEWAY, Role.SCHEDULER, Role.WORKER, Role.DATA, Role.CLIENT, Role.ADMIN})

#: Rules by service ("/pkg.Service/") or by full method name; a method rule wins.
RULES: dict[str, frozenset[Role]] = {
    # Standard services every server exposes: any authenticated peer.
    "/grpc.health.v1.Health/": _ANY,
    "/grpc.reflection.v1alpha.ServerReflection/": _ANY,
    "/grpc.reflection.v1.ServerReflection/": _ANY,
    # Gateway: every node may attach; only gateways federate.
    "/hypha.v1.Gateway/Connect": _NODES,
    "/hypha.v1.Gateway/Federate": frozenset({Role.GATEWAY}),
    "/hypha.v1.Gateway/ListPeers": _ANY,
    # Worker: schedulers hold leases and control jobs; workers move tensors.
    "/hypha.v1.Worker/AcceptOffer": frozenset({Role.SCHEDULER}),
    "/hypha.v1.Worker/ReleaseOffer": frozenset({Role.SCHEDULER}),
    "/hypha.v1.Worker/RenewLease": frozenset({Role.SCHEDULER}),
    "/hypha.v1.Worker/ReleaseLease": frozenset({Role.SCHEDULER}),
    "/hypha.v1.Worker/DispatchJob": frozenset({Role.SCHEDULER}),
    "/hypha.v1.Worker/CancelJob": frozenset({Role.SCHEDULER}),
    "/hypha.v1.Worker/GetJobStatus": frozenset({Role.SCHEDULER, Role.ADMIN}),
    # Schedulers push a parameter server's state to its replacement (kind "ps-state" only: the
    # worker checks), and pull it after each round, or a finished job's result files ("result").
    "/hypha.v1.Worker/PushTensors": frozenset({Role.WORKER, Role.SCHEDULER}),
    "/hypha.v1.Worker/PullTensors": frozenset({Role.WORKER, Role.SCHEDULER}),
    "/hypha.v1.Worker/GetStatus": frozenset({Role.SCHEDULER, Role.ADMIN, Role.CLIENT}),
    # Scheduler: the client API is for clients; job control is for workers.
    "/hypha.v1.Scheduler/": _OPERATORS,
    # Growing or shrinking a running job: operators (the servicer further requires its submitter
    # or an admin, as for cancelling).
    "/hypha.v1.Scheduler/ScaleJob": _OPERATORS,
    "/hypha.v1.SchedulerControl/": frozenset({Role.WORKER}),
    # Data nodes serve whoever trains or plans: workers, schedulers, operators.
    "/hypha.v1.DataNode/": frozenset({Role.WORKER, Role.SCHEDULER, Role.ADMIN, Role.CLIENT}),
}


def allowed_roles(method: str) -> frozenset[Role]:
    """The roles that may call ``method`` (a full name, "/pkg.Service/Method")."""
    rule = RULES.get(method)
    if rule is not None:
        return rule
    service = method[: method.rfind("/") + 1]
    return RULES.get(service, frozenset())


def is_allowed(method: str, role: Role) -> bool:
    return role in allowed_roles(method)
