"""Networking shared by every role: mTLS servers and channels, the guard
(authentication, roles, revocation, error mapping), and telemetry."""

import os

# gRPC's C core prints TLS handshake failures to stderr at INFO level; our
# own logs report them with context. Set GRPC_VERBOSITY yourself to see them.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
