"""Wall-clock time at the edges: protobuf ``Timestamp`` and ISO 8601 text.

Inside the code base time is a float of seconds since the epoch (what
``time.time()`` and the injected clocks return); it becomes a
``google.protobuf.Timestamp`` only in a message and ISO 8601 text only in
JSON or on a terminal. These are the only conversions.

NOTE: the fraction of a second becomes nanoseconds by *rounding*, not
truncating. A float such as 1.005 is stored as 1.00499999999…, so truncation
would turn it into 1.004999999 s and a value would not survive the trip to a
message and back; rounding to the nearest nanosecond does. The whole seconds
are split off first: ``seconds * 1e9`` for a current epoch time is about
1.7e18, beyond what a float holds exactly (steps of 256 ns).
"""

from __future__ import annotations

import datetime as dt
import math

from google.protobuf.timestamp_pb2 import Timestamp


def to_timestamp(seconds: float) -> Timestamp:
    """Seconds since the epoch as a protobuf Timestamp (to the nearest nanosecond)."""
    whole = math.floor(seconds)
    nanos = round((seconds - whole) * 1e9)
    if nanos == 1_000_000_000:  # a fraction within half a nanosecond of the next second
        whole, nanos = whole + 1, 0
    return Timestamp(seconds=whole, nanos=nanos)


def to_seconds(stamp: Timestamp) -> float:
    """A protobuf Timestamp as seconds since the epoch."""
    return stamp.seconds + stamp.nanos / 1e9


def iso8601(seconds: float) -> str:
    """Seconds since the epoch as UTC ISO 8601 text ending in ``Z`` (what the REST API and CLI print)."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat().replace("+00:00", "Z")


def timestamp_iso8601(stamp: Timestamp) -> str:
    """A Timestamp as ISO 8601 text; the unset (zero) Timestamp is the empty string."""
    if not stamp.seconds and not stamp.nanos:
        return ""
    return iso8601(to_seconds(stamp))


__all__ = ["iso8601", "timestamp_iso8601", "to_seconds", "to_timestamp"]
