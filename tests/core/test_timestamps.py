"""One Timestamp conversion: nearest-nanosecond rounding, so a value survives the round trip."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from hypha.timestamps import iso8601, timestamp_iso8601, to_seconds, to_timestamp


def test_seconds_are_rounded_to_the_nearest_nanosecond_not_truncated() -> None:
    # 1.005 is 1.00499999999… as a float: truncation would give 4_999_999 ns.
    assert to_timestamp(1.005) == Timestamp(seconds=1, nanos=5_000_000)
    # An epoch time keeps its exact fraction (seconds * 1e9 would not fit a float's precision).
    assert to_timestamp(1_700_000_000.25) == Timestamp(seconds=1_700_000_000, nanos=250_000_000)


@given(st.floats(min_value=-1e9, max_value=4e9, allow_nan=False))
def test_a_time_survives_the_trip_to_a_message_and_back(seconds: float) -> None:
    stamp = to_timestamp(seconds)
    assert 0 <= stamp.nanos < 1_000_000_000
    assert abs(to_seconds(stamp) - seconds) <= 1e-6


def test_iso8601_is_utc_with_a_z() -> None:
    assert iso8601(0) == "1970-01-01T00:00:00Z"
    assert timestamp_iso8601(to_timestamp(1.5)) == "1970-01-01T00:00:01.500000Z"


def test_the_unset_timestamp_is_empty_text() -> None:
    assert timestamp_iso8601(Timestamp()) == ""
