"""What a node remembers about its peers between lookups: round-trip times and recent failures.

Without memory every walk pays again for the same dead peer: its neighbours
keep naming it, so each lookup asks it and waits one stall before going on.
``PeerHealth`` makes a dead peer cost one stall, not one per walk, and
``RttWindow`` sets that stall from the round trips this node actually sees,
so the threshold is milliseconds on loopback and grows with a WAN's RTT.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from hypha.errors import InvalidArgumentError


class RttWindow:
    """The last ``size`` round-trip times of answered RPCs; the stall threshold derives from them.

    A high percentile (not the mean) so that one slow answer among fast ones
    does not count as a stall, times a factor for headroom; clamped to
    [floor, cap] so a burst of loopback answers cannot make it absurdly small
    and a congested link cannot make it longer than waiting for the RPC.
    """

    def __init__(self, size: int = 64, *, percentile: float = 0.9, factor: float = 3.0) -> None:
        if size < 1 or not 0 < percentile <= 1 or factor <= 0:
            raise InvalidArgumentError("RTT window size >= 1, percentile in (0, 1], factor > 0")
        self.percentile = percentile
        self.factor = factor
        self._samples: deque[float] = deque(maxlen=size)
        self._estimate: float | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, rtt_s: float) -> None:
        self._samples.append(max(0.0, rtt_s))
        self._estimate = None

    def estimate_s(self) -> float | None:
        """``percentile`` of the window times ``factor``; None before any answer."""
        if not self._samples:
            return None
        if self._estimate is None:
            ordered = sorted(self._samples)
            index = min(len(ordered) - 1, math.ceil(self.percentile * len(ordered)) - 1)
            self._estimate = ordered[max(0, index)] * self.factor
        return self._estimate

    def stall_s(self, floor_s: float, cap_s: float) -> float:
        """The estimate within [floor_s, cap_s]; ``cap_s`` until an RPC has been answered."""
        estimate = self.estimate_s()
        if estimate is None:
            return cap_s
        return min(cap_s, max(floor_s, estimate))


@dataclass
class _Failures:
    count: int
    until: float


class PeerHealth:
    """Peers that failed or stalled recently, each backed off exponentially; bounded.

    ``failed`` doubles a peer's backoff (``base_s``, 2x, ... up to ``cap_s``)
    and says when it has failed ``evict_after`` times in a row, so the caller
    drops it from routing; ``succeeded`` forgets it. At most ``max_peers``
    are remembered, the least recently failed forgotten first: forgetting
    only means that peer is asked again, so a flood of bogus ids cannot grow
    the table or block a good peer for long.
    """

    def __init__(
        self,
        *,
        max_peers: int = 1024,
        base_s: float = 1.0,
        cap_s: float = 30.0,
        evict_after: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_peers < 1 or base_s <= 0 or cap_s < base_s or evict_after < 1:
            raise InvalidArgumentError("max_peers, evict_after >= 1 and 0 < base_s <= cap_s")
        self.max_peers = max_peers
        self.base_s = base_s
        self.cap_s = cap_s
        self.evict_after = evict_after
        self.clock = clock
        self._peers: OrderedDict[bytes, _Failures] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def failed(self, peer: bytes) -> bool:
        """Count one failure of ``peer``; True when it has now failed ``evict_after`` times in a row."""
        entry = self._peers.pop(peer, None)
        count = 1 if entry is None else entry.count + 1
        backoff = min(self.cap_s, self.base_s * 2 ** min(count - 1, 32))
        self._peers[peer] = _Failures(count, self.clock() + backoff)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        return count >= self.evict_after

    def succeeded(self, peer: bytes) -> None:
        self._peers.pop(peer, None)

    def backing_off(self, peer: bytes) -> bool:
        """Whether ``peer`` failed recently enough that lookups should not ask it first."""
        entry = self._peers.get(peer)
        return entry is not None and entry.until > self.clock()

    def failures(self, peer: bytes) -> int:
        entry = self._peers.get(peer)
        return 0 if entry is None else entry.count
