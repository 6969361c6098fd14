"""The gateway's seen-message cache: a message id is let through once per TTL, and memory stays
bounded by evicting the oldest ids first, so a flood of new ids cannot grow the gateway without end."""

from __future__ import annotations

from hypha.gateway.dedup import SeenCache


def test_an_id_passes_once_within_the_ttl() -> None:
    # Prepare
    cache = SeenCache(ttl_s=10.0, max_entries=100)

    # Execute / Assert: the first sight passes, repeats within the TTL do not.
    assert cache.first_time("a", now=0.0)
    assert not cache.first_time("a", now=5.0)
    assert not cache.first_time("a", now=10.0)  # exactly TTL old is still remembered
    assert cache.first_time("b", now=10.0)  # other ids are independent
    assert len(cache) == 2


def test_an_id_passes_again_once_its_ttl_has_run_out() -> None:
    cache = SeenCache(ttl_s=10.0, max_entries=100)
    cache.first_time("a", now=0.0)

    # A repeat inside the TTL does not refresh it: the id expires 10 s after it was first seen.
    assert not cache.first_time("a", now=9.0)
    assert cache.first_time("a", now=10.5)
    assert not cache.first_time("a", now=20.0)  # remembered anew from 10.5


def test_expired_ids_are_forgotten_so_the_cache_shrinks() -> None:
    cache = SeenCache(ttl_s=1.0, max_entries=100)
    for i in range(10):
        cache.first_time(f"old-{i}", now=float(i) * 0.01)
    assert len(cache) == 10

    cache.first_time("new", now=5.0)

    assert len(cache) == 1  # every old id was past its TTL


def test_at_the_bound_the_oldest_id_is_evicted_first() -> None:
    # Prepare: the cache is full; nothing has expired (the TTL is far away).
    cache = SeenCache(ttl_s=1_000.0, max_entries=3)
    for i, key in enumerate(("a", "b", "c")):
        assert cache.first_time(key, now=float(i))

    # Execute: a fourth id makes room by dropping the oldest.
    assert cache.first_time("d", now=3.0)

    # Assert: never more than the bound; "a" was the one evicted (it passes again), "d" is known.
    assert len(cache) == 3
    assert cache.first_time("a", now=4.0)
    assert not cache.first_time("d", now=4.0)
    assert len(cache) <= 3


def test_a_flood_of_new_ids_never_exceeds_the_bound() -> None:
    cache = SeenCache(ttl_s=1_000.0, max_entries=50)
    for i in range(1_000):
        assert cache.first_time(f"id-{i}", now=i * 0.001)
        assert len(cache) <= 50
    # The newest 50 are the ones remembered.
    assert not cache.first_time("id-999", now=1.0)
    assert not cache.first_time("id-951", now=1.0)
    assert cache.first_time("id-900", now=1.0)
