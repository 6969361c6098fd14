"""Remembers message ids for a while, so a frame crosses each gateway once."""

from __future__ import annotations

from collections import OrderedDict


class SeenCache:
    """Bounded, time-limited set. Time is passed in (monotonic seconds)."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_time(self, key: str, now: float) -> bool:
        """True (and remember it) if ``key`` was not seen within the TTL."""
        self._evict(now)
        if key in self._seen:
            return False
        self._seen[key] = now
        return True

    def _evict(self, now: float) -> None:
        cutoff = now - self.ttl_s
        while self._seen:
            _, at = next(iter(self._seen.items()))
            if at >= cutoff and len(self._seen) < self.max_entries:
                return
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)
