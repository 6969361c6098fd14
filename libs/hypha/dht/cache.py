"""A reader's cache of verified provider records, per dataset: bounded, expiring with the records.

A lookup answers as soon as it holds enough providers and lets its walk go
on in the background; what the walk still finds lands here, so the next
lookup of the same dataset (within ``fresh_s``) is answered without a walk,
and a lookup whose walk finds nothing in time falls back to what is here.
Nothing enters unverified: ``add`` takes the signed blob and runs the
reader's ``RecordVerifier`` on it (chain, signature, role, expiry) and keeps
the highest ``seq`` per provider; ``get`` verifies each blob again (a digest
lookup in the verifier's own cache plus the time checks), so a record or a
certificate that expired meanwhile is dropped, never returned.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hypha.dht.records import ProviderRecord, RecordVerifier
from hypha.errors import HyphaError, InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass
class _Dataset:
    #: Provider peer id -> (verified record, its signed blob).
    records: dict[str, tuple[ProviderRecord, bytes]] = field(default_factory=dict)
    #: Monotonic time a walk for this dataset last ran to its end; None: never.
    refreshed_at: float | None = None


class ProviderCache:
    """At most ``max_datasets`` datasets (least recently used dropped) of ``max_per_dataset`` records."""

    def __init__(
        self,
        verifier: RecordVerifier,
        *,
        max_datasets: int = 256,
        max_per_dataset: int = 64,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_datasets < 1 or max_per_dataset < 1:
            raise InvalidArgumentError("a provider cache holds at least one dataset of one record")
        self.verifier = verifier
        self.max_datasets = max_datasets
        self.max_per_dataset = max_per_dataset
        self.monotonic = monotonic
        self._datasets: OrderedDict[str, _Dataset] = OrderedDict()

    def __len__(self) -> int:
        return len(self._datasets)

    def add(self, dataset: str, blob: bytes) -> ProviderRecord | None:
        """Verify ``blob`` and keep it if it is ``dataset``'s newest from its provider.

        Returns the verified record (kept or not: an older seq is still a
        valid record), or None when it does not verify or is for another
        dataset. When the dataset is full, the record expiring first makes
        room for a later-expiring one.
        """
        try:
            record = self.verifier.verify(blob)
        except HyphaError as err:
            log.debug("dropping provider record for %s: %s", dataset, err.message)
            return None
        if record.dataset != dataset:
            return None
        entry = self._entry(dataset)
        self._reverify(dataset, entry)
        current = entry.records.get(record.provider)
        if current is not None and current[0].seq >= record.seq:
            return record
        if current is None and len(entry.records) >= self.max_per_dataset:
            soonest, _ = min(entry.records.values(), key=lambda kept: kept[0].expires_at)
            if soonest.expires_at >= record.expires_at:
                return record
            del entry.records[soonest.provider]
        entry.records[record.provider] = (record, bytes(blob))
        return record

    def get(self, dataset: str) -> list[ProviderRecord]:
        """The unexpired records of ``dataset``, ordered by provider peer id."""
        entry = self._datasets.get(dataset)
        if entry is None:
            return []
        self._datasets.move_to_end(dataset)
        self._reverify(dataset, entry)
        return [entry.records[p][0] for p in sorted(entry.records)]

    def mark_refreshed(self, dataset: str) -> None:
        """A walk for ``dataset`` ran to its end: what is cached is what the closest nodes know."""
        entry = self._datasets.get(dataset)
        if entry is not None:
            entry.refreshed_at = self.monotonic()

    def is_fresh(self, dataset: str, fresh_s: float) -> bool:
        """Whether a walk for ``dataset`` ended less than ``fresh_s`` ago."""
        entry = self._datasets.get(dataset)
        return (
            entry is not None
            and entry.refreshed_at is not None
            and self.monotonic() - entry.refreshed_at < fresh_s
        )

    def _entry(self, dataset: str) -> _Dataset:
        entry = self._datasets.get(dataset)
        if entry is None:
            entry = self._datasets[dataset] = _Dataset()
            while len(self._datasets) > self.max_datasets:
                self._datasets.popitem(last=False)
        else:
            self._datasets.move_to_end(dataset)
        return entry

    def _reverify(self, dataset: str, entry: _Dataset) -> None:
        for provider, (_, blob) in list(entry.records.items()):
            try:
                self.verifier.verify(blob)
            except HyphaError as err:
                log.debug("dropping cached provider record for %s: %s", dataset, err.message)
                del entry.records[provider]
