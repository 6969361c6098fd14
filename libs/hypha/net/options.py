"""gRPC channel and server options shared by both ends.

Chunks on the wire are at most 1 MiB; framing adds bytes, so the message
limit sits a little above it on both sides (a 4 MiB message fails under the
default 4 MiB limit, measured).
"""

from __future__ import annotations

CHUNK_BYTES = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
DEFAULT_KEEPALIVE_S = 20.0
#: gRPC calls one server runs at once (``net.max_concurrent_rpcs``), and one peer of them.
DEFAULT_MAX_CONCURRENT_RPCS = 1024
DEFAULT_MAX_RPCS_PER_PEER = 256


#: Longest pause between attempts to reconnect to a peer that went away.
MAX_RECONNECT_BACKOFF_MS = 2000


def grpc_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keepalive_s: float = DEFAULT_KEEPALIVE_S
) -> list[tuple[str, int]]:
    keepalive_ms = int(keepalive_s * 1000)
    timeout_ms = max(keepalive_ms // 2, 1000)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # NOTE: gRPC (1.85, measured) closes a connection whose keepalive ping goes
        # unanswered only after this ping timeout (default one minute), whatever
        # keepalive_timeout_ms says; without it a silently cut path (a container
        # taken off its network) went unnoticed for over a minute on both ends.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Accept pings as often as our own peers send them.
        ("grpc.http2.min_ping_interval_without_data_ms", max(keepalive_ms // 2, 1000)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(keepalive_ms // 2, 1000)),
        # NOTE: gRPC's reconnect backoff grows to 120 s by default: a peer back after a
        # 15 s outage (a restarted scheduler, a worker's container) was reached ~10 s after it
        # was up, one back after 60 s up to ~40 s after. Capped, it is retried every 2 s at
        # most: a connect attempt to a dead address costs next to nothing.
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]
