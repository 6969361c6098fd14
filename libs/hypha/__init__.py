"""Hypha: distributed ML training on heterogeneous, poorly connected machines.

Shared code lives here (libs/hypha); each node role lives in services/<role>
and is importable as ``hypha.<role>``.
"""

import os

__version__ = "0.1.0"

# gRPC's C core prints TLS handshake failures to stderr at INFO level; our
# own logs report them with context. Set GRPC_VERBOSITY yourself to see them.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
