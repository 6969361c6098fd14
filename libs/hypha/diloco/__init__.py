"""DiLoCo arithmetic and bookkeeping for the parameter server, free of I/O.

``outer`` averages deltas and applies the Nesterov outer step, ``rounds``
decides when a round completes and which deltas count, ``server_core`` runs
the rounds one after another with the outer step, ``checkpoint`` persists
the server after every round. The gRPC servicer wires them to the network.
"""

from hypha.diloco.outer import NesterovOuter, OuterStateDict, weighted_average
from hypha.diloco.rounds import (
    DeltaReceipt,
    Quorum,
    QuorumNotMetError,
    Round,
    RoundState,
    quorum_count,
)
from hypha.diloco.server_core import GlobalState, ParameterServerCore, RoundUpdate

__all__ = [
    "DeltaReceipt",
    "GlobalState",
    "NesterovOuter",
    "OuterStateDict",
    "ParameterServerCore",
    "Quorum",
    "QuorumNotMetError",
    "Round",
    "RoundState",
    "RoundUpdate",
    "quorum_count",
    "weighted_average",
]
