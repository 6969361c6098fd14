"""Jittered exponential backoff: the one retry pacing every reconnect uses."""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, base_s: float, cap_s: float, *, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """Full-range jitter over [delay/2, delay], delay doubling up to the cap."""
        delay = min(self.cap_s, self.base_s * (2**self._attempt))
        self._attempt += 1
        return delay * (0.5 + 0.5 * self._rng.random())

    def reset(self) -> None:
        self._attempt = 0
