"""What a DHT reader remembers between lookups: the provider cache, the failure table, the RTT window."""

from __future__ import annotations

import time

import pytest

from hypha.dht.cache import ProviderCache
from hypha.dht.health import PeerHealth, RttWindow
from hypha.dht.records import ProviderRecord, RecordVerifier, sign_record
from hypha.errors import InvalidArgumentError
from tests.conftest import Pki
from tests.dht.test_records import Identity, issue_identity, trusted_roots
from tests.helpers import FakeClock


@pytest.fixture(scope="module")
def idents(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    out = tmp_path_factory.mktemp("dht-memory")
    return [issue_identity(pki, "data", f"memory-data-{i}", out) for i in range(4)]


@pytest.fixture(scope="module")
def outsider(foreign_pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return issue_identity(foreign_pki, "data", "memory-stranger", tmp_path_factory.mktemp("dht-memory-f"))


def blob_of(
    ident: Identity,
    dataset: str = "mnist",
    *,
    seq: int = 1,
    now: float | None = None,
    lifetime_s: float = 60.0,
) -> bytes:
    issued = time.time() if now is None else now
    record = ProviderRecord.issue(
        dataset, ident.peer_id, ["127.0.0.1:7000"], 8, seq=seq, now=issued, lifetime_s=lifetime_s
    )
    return sign_record(record, ident.key, ident.chain)


def cache_for(pki: Pki, clock: FakeClock | None = None, **options: int) -> ProviderCache:
    verifier = RecordVerifier(trusted_roots(pki), clock=clock or time.time, max_skew_s=0.0)
    return ProviderCache(verifier, monotonic=FakeClock(), **options)


# -- provider cache ----------------------------------------------------------------


def test_cache_keeps_only_records_that_verify(pki: Pki, idents: list[Identity], outsider: Identity) -> None:
    cache = cache_for(pki)
    forged = bytearray(blob_of(idents[0]))
    forged[len(forged) // 2] ^= 1

    assert cache.add("mnist", blob_of(outsider)) is None  # untrusted chain
    assert cache.add("mnist", bytes(forged)) is None  # broken signature or envelope
    assert cache.add("mnist", blob_of(idents[0], "cifar")) is None  # another dataset's record
    assert cache.add("mnist", b"not a record") is None
    assert cache.get("mnist") == []


def test_cache_keeps_the_newest_seq_per_provider(pki: Pki, idents: list[Identity]) -> None:
    cache = cache_for(pki)
    cache.add("mnist", blob_of(idents[0], seq=5))
    older = cache.add("mnist", blob_of(idents[0], seq=3))
    cache.add("mnist", blob_of(idents[1], seq=1))

    assert older is not None and older.seq == 3  # verified, returned, not kept
    assert [(r.provider, r.seq) for r in cache.get("mnist")] == sorted(
        [(idents[0].peer_id, 5), (idents[1].peer_id, 1)]
    )


def test_cached_records_expire_with_themselves(pki: Pki, idents: list[Identity]) -> None:
    clock = FakeClock(time.time())
    cache = cache_for(pki, clock)
    cache.add("mnist", blob_of(idents[0], now=clock.now, lifetime_s=10))
    cache.add("mnist", blob_of(idents[1], now=clock.now, lifetime_s=100))

    clock.now += 50

    assert [r.provider for r in cache.get("mnist")] == [idents[1].peer_id]


def test_cache_is_bounded_in_datasets_and_records(pki: Pki, idents: list[Identity]) -> None:
    now = time.time()
    cache = cache_for(pki, max_datasets=2, max_per_dataset=2)
    for dataset in ("a", "b", "c"):
        cache.add(dataset, blob_of(idents[0], dataset))
    short, long_lived = blob_of(idents[1], "c", now=now, lifetime_s=30), blob_of(idents[2], "c", now=now)
    cache.add("c", short)
    cache.add("c", long_lived)  # full: replaces the record that expires first

    assert len(cache) == 2 and cache.get("a") == []
    assert {r.provider for r in cache.get("c")} == {idents[0].peer_id, idents[2].peer_id}


def test_cache_freshness_follows_the_last_finished_walk(pki: Pki, idents: list[Identity]) -> None:
    cache = cache_for(pki)
    assert isinstance(cache.monotonic, FakeClock)
    cache.add("mnist", blob_of(idents[0]))
    assert not cache.is_fresh("mnist", 2.0)  # never refreshed by a finished walk

    cache.mark_refreshed("mnist")
    assert cache.is_fresh("mnist", 2.0)
    cache.monotonic.now += 2.0
    assert not cache.is_fresh("mnist", 2.0)


# -- failure table -------------------------------------------------------------------


def test_failures_back_off_exponentially_up_to_the_cap() -> None:
    clock = FakeClock()
    health = PeerHealth(base_s=1.0, cap_s=4.0, evict_after=10, clock=clock)
    peer = b"p" * 20
    expected_backoffs = [1.0, 2.0, 4.0, 4.0]
    for backoff in expected_backoffs:
        health.failed(peer)
        clock.now += backoff - 0.01
        assert health.backing_off(peer)
        clock.now += 0.02
        assert not health.backing_off(peer)


def test_repeated_failures_ask_for_eviction_and_success_forgets() -> None:
    health = PeerHealth(evict_after=3, clock=FakeClock())
    peer = b"p" * 20

    verdicts = [health.failed(peer) for _ in range(3)]
    health.succeeded(peer)

    assert verdicts == [False, False, True]
    assert not health.backing_off(peer) and health.failures(peer) == 0


def test_failure_table_is_bounded_and_forgets_the_oldest() -> None:
    health = PeerHealth(max_peers=3, clock=FakeClock())
    peers = [bytes([i]) * 20 for i in range(5)]
    for peer in peers:
        health.failed(peer)

    assert len(health) == 3
    assert [health.backing_off(p) for p in peers] == [False, False, True, True, True]


# -- adaptive stall ------------------------------------------------------------------


def test_stall_follows_a_high_percentile_of_recent_rtts_within_floor_and_cap() -> None:
    window = RttWindow(size=10, percentile=0.9, factor=3.0)
    assert window.stall_s(0.005, 1.0) == 1.0  # nothing answered yet: the cap

    for _ in range(9):
        window.observe(0.001)
    window.observe(0.050)  # one slow answer in ten is the 100th percentile, not the 90th
    assert window.stall_s(0.001, 1.0) == pytest.approx(0.003)
    assert window.stall_s(0.005, 1.0) == 0.005  # the floor

    for _ in range(10):
        window.observe(0.200)  # a WAN: the old samples leave the window
    assert window.stall_s(0.005, 1.0) == pytest.approx(0.6)
    assert window.stall_s(0.005, 0.5) == 0.5  # the cap


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        RttWindow(size=0)
    with pytest.raises(InvalidArgumentError):
        PeerHealth(base_s=2.0, cap_s=1.0)
