"""Bounded offers: a scheduler that knows a large pool asks only a random share of it to
answer, widens the share when a round ends short, and channels are opened while the
batch window runs instead of after it."""

from __future__ import annotations

import asyncio

import pytest

from hypha.market.arbiter import DropReason
from hypha.market.policies import OfferView
from hypha.market.resources import Resources
from hypha.net.connector import PeerConnector
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.market import SchedulerMarket
from tests.conftest import Pki
from tests.helpers import eventually
from tests.market_net.test_market_net import TASK, Market

pytestmark = pytest.mark.timeout(60)


def hear_from(market: SchedulerMarket, *worker_ids: str) -> None:
    """Make workers known the way the network does: they offered (here on no live request)."""
    for worker_id in worker_ids:
        offer = OfferView(f"o-{worker_id}", worker_id, 1.0, Resources(cpu=1.0), request_id="gone")
        assert market.submit_offer(offer) is False


def test_the_share_asked_to_answer_follows_the_known_pool(pki: Pki) -> None:
    pki.issue("scheduler", "s-share")
    market = SchedulerMarket("s-share", None, PeerConnector(pki.tls("s-share"), None), SchedulerSection())

    assert market.offer_probability(4) == 1.0  # knows nobody yet: everyone answers
    hear_from(market, *(f"w{i}" for i in range(24)))
    assert market.offer_probability(4) == 1.0  # 4 x (4 + 2) = 24 wanted: still everyone
    hear_from(market, *(f"w{i}" for i in range(24, 100)))
    assert market.offer_probability(4) == pytest.approx(24 / 100)
    assert market.offer_probability(1) == pytest.approx(12 / 100)
    # Workers it will refuse are not counted as answering: the share grows.
    assert market.offer_probability(4, exclude={f"w{i}" for i in range(20)}) == pytest.approx(24 / 80)

    off = SchedulerSection(offer_sampling=0.0)
    unsampled = SchedulerMarket("s-share", None, PeerConnector(pki.tls("s-share"), None), off)
    hear_from(unsampled, *(f"w{i}" for i in range(100)))
    assert unsampled.offer_probability(4) == 1.0


async def test_a_known_pool_answers_by_lottery_and_still_fills_the_allocation(market: Market) -> None:
    workers = [await market.worker(f"w-lot{i}", gateway=i) for i in range(12)]
    # 0.25 x (1 + 2) = 0.75 offers wanted of 12 workers: p = 1/16 once they are known.
    scheduler = await market.scheduler("s-lot", offer_sampling=0.25)
    await market.workers_listening(12)

    first = await scheduler.market.allocate(TASK, 1)  # knows nobody: everyone answers
    assert len(first) == 1
    assert scheduler.market.stats["advertisements_sampled"] == 0
    await eventually(lambda: len(scheduler.market.known_workers()) == 12, message="all 12 offered")
    await scheduler.market.release_all()

    held = await scheduler.market.allocate(TASK, 1)

    assert len(held) == 1  # found, even if the first lottery left nobody to answer
    assert scheduler.market.stats["advertisements_sampled"] >= 1
    # The sampled advertisement reached every worker, and most stayed silent.
    assert sum(w.market.arbiter.dropped[DropReason.SAMPLED] for w in workers) >= 1


async def test_a_pool_smaller_than_believed_is_still_found_by_widening(market: Market) -> None:
    workers = [await market.worker(f"w-few{i}", gateway=i) for i in range(2)]
    scheduler = await market.scheduler("s-ghosts")
    await market.workers_listening(2)
    # 98 workers it heard of once and that are gone: 16 wanted of 100 known, p = 0.16.
    hear_from(scheduler.market, *(f"ghost{i}" for i in range(98)))

    held = await scheduler.market.allocate(TASK, 2)

    assert sorted(lease.worker_id for lease in held) == sorted(w.peer_id for w in workers)
    assert scheduler.market.stats["advertisements_sampled"] >= 1


async def test_a_worker_opens_its_channel_to_the_scheduler_during_the_batch_window(market: Market) -> None:
    worker = await market.worker("w-warm", batch_window_s=1.5)
    scheduler = await market.scheduler("s-warm", offer_window_s=1.8, allocate_timeout_s=5.0)
    await market.workers_listening(1)
    assert worker.market.connector.is_direct(scheduler.peer_id) is None

    allocation = asyncio.create_task(scheduler.market.allocate(TASK, 1))
    await eventually(
        lambda: worker.market.connector.is_direct(scheduler.peer_id) is True,
        timeout=1.0,
        message="direct channel open before the window closed",
    )
    assert worker.market.arbiter.pending() == 1  # still inside the window: no offer made yet
    assert worker.market.stats["offers_sent"] == 0

    held = await allocation
    assert [lease.worker_id for lease in held] == [worker.peer_id]
