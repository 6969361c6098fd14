"""The provider sets a DHT storer keeps: verified records, ordered, expired and bounded.

Split from ``records`` (the record's format, signing and verification): a table
holds only records its caller already verified, so nothing here checks a
signature; it decides which record of a provider wins (highest seq), when one
expires, and what a flood of valid records may take (ARCHITECTURE §4).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from hypha.dht.records import Clock, ProviderRecord


class PutOutcome(StrEnum):
    """What a storer did with an offered record."""

    STORED = "stored"  # first record of this provider under the key
    REPLACED = "replaced"  # a higher seq replaced the stored one
    UNCHANGED = "unchanged"  # same seq as stored: a republish of the same record
    STALE = "stale"  # lower seq than stored: a replay, refused
    EXPIRED = "expired"  # already expired, refused
    FULL = "full"  # the key (or the table) holds its maximum, and nothing could be evicted
    OVER_QUOTA = "over_quota"  # the provider holds its maximum of records (``max_per_provider``)

    @property
    def accepted(self) -> bool:
        return self in (PutOutcome.STORED, PutOutcome.REPLACED, PutOutcome.UNCHANGED)


@dataclass
class _Entry:
    record: ProviderRecord
    blob: bytes


@dataclass
class ProviderTable:
    """The provider sets a storer keeps: key -> provider peer id -> newest verified record.

    Records must be verified before ``put``; the table only orders them
    (highest seq wins), expires them and bounds memory, so a flood of valid
    records cannot grow it without limit: at most ``max_keys`` datasets,
    ``max_per_key`` providers each, ``max_per_provider`` records of one
    provider (one certificate's peer id: one data node cannot fill the table
    by announcing many names) and ``max_bytes`` of record blobs in all.
    Every record expires with its own ``expires_at`` (at most a day away).
    """

    max_per_key: int = 64
    max_keys: int = 4096
    max_per_provider: int = 256
    max_bytes: int = 64 * 1024 * 1024
    clock: Clock = time.time
    #: Keep a record this long past its expiry, matching the verifier's skew allowance.
    skew_s: float = 0.0
    _keys: dict[bytes, dict[str, _Entry]] = field(default_factory=dict)
    #: Records held per provider, and blob bytes held in all (kept in step by _add/_remove).
    _per_provider: dict[str, int] = field(default_factory=dict)
    _bytes: int = 0

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def records_of(self, provider: str) -> int:
        return self._per_provider.get(provider, 0)

    def put(self, key: bytes, record: ProviderRecord, blob: bytes) -> PutOutcome:
        now = self.clock()
        if record.is_expired(now, self.skew_s):
            return PutOutcome.EXPIRED
        providers = self._keys.get(key)
        current = None if providers is None else providers.get(record.provider)
        if providers is not None and current is not None:
            if record.seq < current.record.seq:
                return PutOutcome.STALE
            if record.seq == current.record.seq:
                return PutOutcome.UNCHANGED
            if not self._room(len(blob) - len(current.blob)):
                return PutOutcome.FULL
            self._remove(providers, record.provider)
            self._add(providers, record, blob)
            return PutOutcome.REPLACED
        if self.records_of(record.provider) >= self.max_per_provider:
            self.prune()
            if self.records_of(record.provider) >= self.max_per_provider:
                return PutOutcome.OVER_QUOTA
        if not self._room(len(blob)):
            return PutOutcome.FULL
        if providers is None:
            self.prune()
            if len(self._keys) >= self.max_keys:
                return PutOutcome.FULL
            providers = self._keys[key] = {}
        self._drop_expired(providers, now)
        if len(providers) >= self.max_per_key:
            # Evict the record that dies first, but only for one that lives longer.
            victim = min(providers.values(), key=lambda e: e.record.expires_at)
            if victim.record.expires_at >= record.expires_at:
                return PutOutcome.FULL
            self._remove(providers, victim.record.provider)
        self._add(providers, record, blob)
        return PutOutcome.STORED

    def _room(self, extra: int) -> bool:
        """Whether ``extra`` more blob bytes fit, after dropping expired records if they do not."""
        if self._bytes + extra <= self.max_bytes:
            return True
        self.prune()
        return self._bytes + extra <= self.max_bytes

    def _add(self, providers: dict[str, _Entry], record: ProviderRecord, blob: bytes) -> None:
        providers[record.provider] = _Entry(record, blob)
        self._per_provider[record.provider] = self._per_provider.get(record.provider, 0) + 1
        self._bytes += len(blob)

    def _remove(self, providers: dict[str, _Entry], provider: str) -> None:
        entry = providers.pop(provider)
        self._bytes -= len(entry.blob)
        left = self._per_provider[provider] - 1
        if left:
            self._per_provider[provider] = left
        else:
            del self._per_provider[provider]

    def get(self, key: bytes) -> list[tuple[ProviderRecord, bytes]]:
        """Live records under ``key``, ordered by provider id (the paging order)."""
        providers = self._keys.get(key)
        if not providers:
            return []
        self._drop_expired(providers, self.clock())
        return [(providers[p].record, providers[p].blob) for p in sorted(providers)]

    def keys(self) -> list[bytes]:
        return list(self._keys)

    def items(self) -> Iterator[tuple[bytes, list[tuple[ProviderRecord, bytes]]]]:
        for key in list(self._keys):
            live = self.get(key)
            if live:
                yield key, live

    def prune(self) -> None:
        now = self.clock()
        for key in list(self._keys):
            self._drop_expired(self._keys[key], now)
            if not self._keys[key]:
                del self._keys[key]

    def __len__(self) -> int:
        return sum(len(p) for p in self._keys.values())

    def _drop_expired(self, providers: dict[str, _Entry], now: float) -> None:
        for provider in [p for p, e in providers.items() if e.record.is_expired(now, self.skew_s)]:
            self._remove(providers, provider)
