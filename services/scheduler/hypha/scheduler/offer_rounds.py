"""One allocation round on the network: advertise, collect the offers, choose.

A round publishes an advertisement on ``hypha/worker`` and waits while the
``SchedulerControl.SubmitOffer`` handler feeds the offers workers send into
the round's ``Allocation`` (the worker id is the caller's TLS or relay
identity, never the message's field). When enough distinct workers offered or
the window closed, the policy picks the winners and losers; the market accepts
and releases them. Offers refused on arrival (above the private max, late,
unknown request) are answered ``received=false`` and the worker frees them
itself.

Offers are bounded: once the scheduler knows more workers than it needs
offers (``offer_sampling`` x (count + 2)), an advertisement asks each worker
to answer only with probability wanted / known (the worker draws the lottery
itself), so a pool of hundreds sends a handful of offers, not hundreds of
RPCs that all land at the end of the same batch window. A round that ends
short because too few workers answered asks four times as many on the next
(``WIDEN``), up to the whole pool. Offers that answer an earlier round of the
same allocation late count in the current one, so the first short round is
retried at the same share: it may have been short only because its offers
came late, and a flood of offers is what makes a loaded scheduler late.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from hypha.market.allocator import Allocation, Choice
from hypha.market.arbiter import AdvertisementView
from hypha.market.policies import OfferView, SelectionPolicy
from hypha.market.pricing import PriceRange
from hypha.net.link import NodeLink
from hypha.net.messages import WORKER_TOPIC
from hypha.scheduler.config import SchedulerSection

#: How much a round that ended short widens the next round's lottery.
WIDEN = 4.0


def sampled_share(sampling: float, count: int, pool: int) -> float:
    """The share of a ``pool`` of workers asked to answer for ``count`` workers wanted."""
    wanted = sampling * (count + 2)
    if wanted <= 0:
        return 1.0
    return 1.0 if pool <= wanted else wanted / pool


@dataclass
class _Round:
    allocation: Allocation
    exclude: frozenset[str]
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class OfferRounds:
    """The rounds now collecting offers, each under its own and its earlier rounds' request ids."""

    def __init__(self, section: SchedulerSection, stats: Counter[str], clock: Callable[[], float]) -> None:
        self.section = section
        self.stats = stats
        self._clock = clock
        self._open: dict[str, _Round] = {}

    def submit(self, offer: OfferView) -> bool:
        """Feed one offer to the round it answers; False when no open round keeps it."""
        current = self._open.get(offer.request_id)
        if current is None:
            self.stats["offers_unknown"] += 1
            return False
        if offer.worker_id in current.exclude:
            self.stats["offers_excluded"] += 1
            return False
        if not current.allocation.offer(offer, self._clock()):
            return False
        current.arrived.set()
        return True

    async def collect(
        self,
        link: NodeLink,
        ad: AdvertisementView,
        price: PriceRange,
        policy: SelectionPolicy,
        window_s: float,
        exclude: frozenset[str],
        earlier: frozenset[str],
    ) -> tuple[Allocation, Choice]:
        """Publish ``ad`` and collect offers until enough came or the window closed.

        Offers that answer the ``earlier`` rounds of the same allocation late count in this one.
        """
        now = self._clock()
        window_ends_at = min(now + window_s, ad.deadline)
        allocation = Allocation(
            ad.request_id, ad.requirements, ad.count, price, window_ends_at, policy, earlier=earlier
        )
        current = _Round(allocation, exclude)
        for rid in (ad.request_id, *earlier):
            self._open[rid] = current
        try:
            await link.publish(WORKER_TOPIC, ad.to_proto().SerializeToString())
            self.stats["advertisements"] += 1
            if ad.offer_probability < 1.0:
                self.stats["advertisements_sampled"] += 1
            while not allocation.complete(now := self._clock()):
                closes_at = self._closes_at(allocation)
                if now >= closes_at:
                    break
                current.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(current.arrived.wait(), closes_at - now)
            choice = allocation.choose(self._clock())
        finally:
            for rid in (ad.request_id, *earlier):
                del self._open[rid]
        for reason, dropped in allocation.dropped.items():
            self.stats[f"offers_dropped_{reason}"] += dropped
        return allocation, choice

    def _closes_at(self, allocation: Allocation) -> float:
        """The window's end, or earlier: in time to accept the first kept offer before it lapses.

        NOTE: this is what makes a window longer than the workers' offer ttl
        safe; without it a lone early offer would always lapse before the choice.
        """
        expiries = [offer.expires_at for offer in allocation.candidates()]
        if not expiries:
            return allocation.window_ends_at
        return min(allocation.window_ends_at, min(expiries) - self.section.accept_margin_s)
