"""Fetching data slices from data nodes onto the worker's disk, verified and cached.

A trainer asks for slice ``index`` of a dataset together with the providers
the scheduler (or the DHT) named. The fetcher tries them in a rotated order so
that many workers spread over many data nodes, streams the slice in chunks,
and keeps a partial download when a stream breaks: the next attempt (on the
same provider or the next one) resumes with ``offset`` instead of starting
over. A slice is accepted only when its bytes hash to the sha256 the last
chunk carries and, when the caller knows it (a manifest, the scheduler), to
the expected sha256 as well; then it is written to the cache dir with an
atomic rename, so a crash never leaves a half file under a real name and a
second fetch of the same slice is a local file lookup.

When the providers carry a manifest pin (the sha256 of the dataset's manifest
from their signed provider records; ``pinned_manifests``), the manifest is
fetched and checked against it first and every slice is then checked against
the manifest's sha256, so no data node can serve other bytes under the name.

The cache (``slice_cache``) is bounded (``max_cache_bytes``, the
``jobs.slice_cache_bytes`` setting, least recently used slices go first) and
re-hashes a cached file before every use, so a rotted or half-written one is
never served.

``prefetch`` starts a background fetch of the slice a trainer will need next,
so it is on disk by the time the current one is used up; a later ``fetch`` of
the same slice joins that download instead of starting another.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from hypha.datasets.format import Manifest, validate_dataset_name
from hypha.dht.records import ProviderRecord
from hypha.errors import (
    HyphaError,
    InvalidArgumentError,
    OutOfRangeError,
    UnavailableError,
)
from hypha.net.backoff import Backoff
from hypha.net.channel import secure_channel
from hypha.net.tls import TlsMaterial
from hypha.service import Resource
from hypha.v1 import common_pb2
from hypha.worker.pinned_manifests import PinnedManifests, PinnedProvider, common_pin
from hypha.worker.slice_cache import SliceCache
from hypha.worker.slice_stream import AttemptError, PartialSlice, stream_attempt

log = logging.getLogger(__name__)

_SHA256_HEX_LEN = 64


@dataclass(frozen=True)
class ProviderInfo:
    """A data node that serves a dataset: who it is and where to call it."""

    peer_id: str
    addresses: tuple[str, ...]
    #: sha256 of the dataset's manifest that the provider's signed record pins ("" = unpinned).
    manifest_sha256: str = ""

    @classmethod
    def from_proto(cls, peer: common_pb2.PeerInfo) -> ProviderInfo:
        return cls(peer.peer_id, tuple(peer.addresses), peer.manifest_sha256)

    @classmethod
    def from_record(cls, record: ProviderRecord) -> ProviderInfo:
        """From a verified DHT provider record (``DhtNode.find_providers``)."""
        return cls(record.provider, tuple(record.addresses), record.manifest_sha256)


#: Opens a channel to a provider: (peer id, addresses) -> a grpc.aio channel
#: (or anything a generated stub accepts, e.g. a relayed channel).
Connect = Callable[[str, Sequence[str]], grpc.aio.Channel]


class PeerChannels(Protocol):
    """Channels owned elsewhere (the node's ``PeerConnector``: direct, else through the relay)."""

    async def channel(self, peer_id: str, addresses: list[str]) -> Any: ...

    async def invalidate(self, peer_id: str) -> None: ...


class SliceFetcher(Resource):
    """Fetches, verifies, caches and prefetches data slices for one worker.

    ``connect`` defaults to a direct mTLS channel to the provider's first
    address; channels it opens are reused per provider and closed by
    ``close()``. ``peers`` (a worker's ``PeerConnector``) replaces it: the
    connector picks the path (direct, else the gateway relay, for workers or
    data nodes with no inbound route), owns the channels, and forgets a path
    that failed.
    """

    def __init__(
        self,
        tls: TlsMaterial,
        cache_dir: Path,
        *,
        connect: Connect | None = None,
        peers: PeerChannels | None = None,
        max_prefetch: int = 2,
        attempts_per_provider: int = 2,
        chunk_timeout_s: float = 30.0,
        stream_timeout_s: float = 300.0,
        max_slice_bytes: int = 1 << 30,
        max_cache_bytes: int = 20 << 30,
        backoff_base_s: float = 0.1,
        backoff_cap_s: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        if max_prefetch < 0 or attempts_per_provider < 1:
            raise InvalidArgumentError("max_prefetch must be >= 0 and attempts_per_provider >= 1")
        self.tls = tls
        self.cache = SliceCache(cache_dir, max_cache_bytes)
        self.max_prefetch = max_prefetch
        self.attempts_per_provider = attempts_per_provider
        self.chunk_timeout_s = chunk_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.max_slice_bytes = max_slice_bytes
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self._connect = connect or self._direct
        self._peers = peers
        self._rng = rng or random.Random()
        self._channels: dict[tuple[str, tuple[str, ...]], grpc.aio.Channel] = {}
        self._inflight: dict[tuple[str, int], asyncio.Task[Path]] = {}
        self._prefetching: set[tuple[str, int]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._manifests: dict[str, Manifest] = {}
        self._pinned = PinnedManifests(chunk_timeout_s)
        self._closed = False
        #: Counters: cache hits, downloads, resumed streams, failed attempts.
        self.stats: dict[str, int] = {
            "hits": 0,
            "downloads": 0,
            "resumes": 0,
            "failed_attempts": 0,
            "evicted": 0,
        }

    # ---- public API -----------------------------------------------------------

    def remember_manifest(self, manifest: Manifest) -> None:
        """Check later fetches of this dataset against the manifest's per-slice sha256."""
        self._manifests[manifest.name] = manifest
        self._pinned.remember(manifest)

    def cached(self, dataset: str, index: int, sha256: str | None = None) -> Path | None:
        """The cached file of a slice if there is one (not re-hashed: ``fetch`` does that)."""
        expected = sha256 or self._manifest_sha(dataset, index)
        return self.cache.find(dataset, index, expected)

    async def fetch(
        self, dataset: str, index: int, providers: Sequence[ProviderInfo], *, sha256: str | None = None
    ) -> Path:
        """The path of a verified local copy of the slice; fetched if it is not cached yet.

        Raises ``UnavailableError`` naming each provider's failure when no
        provider delivered a verified slice.
        """
        self._check_open()
        key = self._key(dataset, index)
        running = self._inflight.get(key)
        if running is not None:
            try:
                return await asyncio.shield(running)
            except HyphaError as err:
                log.info("background fetch of %s slice %d failed (%s); fetching again", dataset, index, err)
        task = self._start(key, providers, sha256)
        # NOTE: shielded so that a cancelled caller leaves the download running (it lands in
        # the cache for the next caller); close() cancels whatever is still in flight.
        return await asyncio.shield(task)

    def prefetch(
        self, dataset: str, index: int, providers: Sequence[ProviderInfo], *, sha256: str | None = None
    ) -> bool:
        """Start fetching a slice in the background; True when a fetch is (now) in flight.

        False when ``max_prefetch`` background fetches are already running: the
        caller's later ``fetch`` then simply downloads the slice itself.
        """
        self._check_open()
        key = self._key(dataset, index)
        if key in self._inflight:
            return True
        if len(self._prefetching) >= self.max_prefetch:
            log.debug(
                "not prefetching %s slice %d: %d prefetches in flight", dataset, index, self.max_prefetch
            )
            return False
        self._prefetching.add(key)
        self._start(key, providers, sha256)
        return True

    async def wait_prefetched(self) -> None:
        """Wait until no background fetch is running (failures are logged, not raised)."""
        while self._inflight:
            await asyncio.wait(list(self._inflight.values()))

    async def close(self) -> None:
        """Cancel background fetches and close every channel. Idempotent."""
        self._closed = True
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)

    # ---- tasks ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("slice fetcher is closed")

    @staticmethod
    def _key(dataset: str, index: int) -> tuple[str, int]:
        validate_dataset_name(dataset)  # it becomes a directory name in the cache
        if index < 0:
            raise InvalidArgumentError(f"slice index must be >= 0, got {index}")
        return dataset, index

    def _start(
        self, key: tuple[str, int], providers: Sequence[ProviderInfo], sha256: str | None
    ) -> asyncio.Task[Path]:
        task = asyncio.create_task(
            self._obtain(key[0], key[1], list(providers), sha256), name=f"fetch-{key[0]}-{key[1]}"
        )
        self._inflight[key] = task
        task.add_done_callback(lambda done: self._finished(key, done))
        return task

    def _finished(self, key: tuple[str, int], task: asyncio.Task[Path]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        # Retrieve every outcome here: a caller that was cancelled no longer awaits its task.
        error = None if task.cancelled() else task.exception()
        if key in self._prefetching:
            self._prefetching.discard(key)
            if error is not None:
                log.warning("prefetch of %s slice %d failed: %s", key[0], key[1], error)

    async def _obtain(
        self, dataset: str, index: int, providers: list[ProviderInfo], sha256: str | None
    ) -> Path:
        expected = (sha256 or await self._pinned_sha(dataset, index, providers) or "").lower()
        if expected and len(expected) != _SHA256_HEX_LEN:
            raise InvalidArgumentError(
                f"expected sha256 of {dataset} slice {index} is malformed: {expected!r}"
            )
        hit = await asyncio.to_thread(self.cache.verified, dataset, index, expected)
        if hit is not None:
            self.stats["hits"] += 1
            return hit
        payload, digest = await self._download(dataset, index, providers, expected)
        path = await asyncio.to_thread(self.cache.store, dataset, index, payload, digest)
        self.stats["downloads"] += 1
        self.stats["evicted"] = self.cache.evicted
        return path

    async def _pinned_sha(self, dataset: str, index: int, providers: list[ProviderInfo]) -> str:
        """The slice's sha256 from the manifest the providers' records pin, else a remembered one."""
        pin = common_pin(dataset, providers)
        if not pin:
            return self._manifest_sha(dataset, index)
        manifest = await self._pinned.get(dataset, pin, providers, self._channel_of)
        # A provider caught serving another manifest is not asked for slices (they would fail
        # their sha256 check anyway, after a stream).
        providers[:] = [p for p in providers if not self._pinned.refused(pin, p.peer_id)]
        if not 0 <= index < manifest.slice_count:
            raise OutOfRangeError(f"{dataset} has {manifest.slice_count} slices; asked for slice {index}")
        return manifest.sha256[index]

    async def _channel_of(self, provider: PinnedProvider) -> Any:
        assert isinstance(provider, ProviderInfo)
        return await self._channel(provider)

    def _manifest_sha(self, dataset: str, index: int) -> str:
        manifest = self._manifests.get(dataset)
        if manifest is None or not 0 <= index < manifest.slice_count:
            return ""
        return manifest.sha256[index]

    # ---- download -----------------------------------------------------------------

    async def _download(
        self, dataset: str, index: int, providers: list[ProviderInfo], expected: str
    ) -> tuple[bytes, str]:
        if not providers:
            raise UnavailableError(f"{dataset} slice {index}: no providers known")
        start = self._rng.randrange(len(providers))
        order = providers[start:] + providers[:start]
        backoff = Backoff(self.backoff_base_s, self.backoff_cap_s, rng=self._rng)
        reasons: list[str] = []
        partial: PartialSlice | None = None
        for attempt in range(self.attempts_per_provider * len(order)):
            if attempt and attempt % len(order) == 0:
                await asyncio.sleep(backoff.next_delay())  # a whole round failed: give them a moment
            provider = order[attempt % len(order)]
            if partial is None:
                partial = PartialSlice(self.max_slice_bytes)
            elif partial.assembler.received:
                self.stats["resumes"] += 1
            try:
                try:
                    channel = await self._channel(provider)
                except Exception as err:  # a connect callable may fail in its own ways
                    raise AttemptError(f"cannot connect: {err}") from None
                await stream_attempt(
                    channel,
                    dataset,
                    index,
                    partial,
                    expected,
                    stream_timeout_s=self.stream_timeout_s,
                    chunk_timeout_s=self.chunk_timeout_s,
                )
            except AttemptError as err:
                self.stats["failed_attempts"] += 1
                reasons.append(f"{provider.peer_id}: {err.reason}")
                log.info(
                    "fetching %s slice %d from %s failed: %s", dataset, index, provider.peer_id, err.reason
                )
                if err.drop_channel:
                    await self._drop_channel(provider)
                if not err.keep_partial:
                    partial = None
                continue
            return partial.assembler.finish(), partial.verified_sha256
        raise UnavailableError(
            f"{dataset} slice {index}: all {len(order)} provider(s) failed: " + "; ".join(reasons)
        )

    # ---- channels ------------------------------------------------------------------

    def _direct(self, peer_id: str, addresses: Sequence[str]) -> grpc.aio.Channel:
        if not addresses:
            raise UnavailableError(f"provider {peer_id} has no direct address")
        return secure_channel(self.tls, addresses[0])

    async def _channel(self, provider: ProviderInfo) -> Any:
        if self._peers is not None:
            return await self._peers.channel(provider.peer_id, list(provider.addresses))
        key = (provider.peer_id, provider.addresses)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._connect(provider.peer_id, provider.addresses)
            self._channels[key] = channel
        return channel

    async def _drop_channel(self, provider: ProviderInfo) -> None:
        """Forget a channel that failed so the next attempt reconnects instead of waiting out
        gRPC's reconnect backoff; it is closed in the background, with a grace for other calls."""
        if self._peers is not None:
            await self._peers.invalidate(provider.peer_id)
            return
        channel = self._channels.pop((provider.peer_id, provider.addresses), None)
        if channel is not None:
            task = asyncio.create_task(channel.close(grace=self.chunk_timeout_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
