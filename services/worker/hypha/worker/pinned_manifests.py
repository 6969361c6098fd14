"""Dataset manifests checked against the pin in the data nodes' signed provider records.

A provider record carries the sha256 of its dataset's manifest
(``Manifest.digest``), and the manifest lists the sha256 of every slice. So a
fetcher that has the pin (the scheduler passes it with each provider, from
the record it verified) asks a provider for the manifest, accepts it only if
it hashes to the pin, and then checks every slice against it: a data node
that serves other bytes under the dataset's name, or the right bytes under
another manifest, is refused before any of its slices is used.

Manifests are cached by pin, so a job asks once; concurrent first fetches
share one lookup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from hypha.datasets.format import Manifest
from hypha.errors import FailedPreconditionError, HyphaError, UnavailableError
from hypha.v1 import data_pb2, data_pb2_grpc

log = logging.getLogger(__name__)


class PinnedProvider(Protocol):
    """What this module needs of a provider: who it is and the pin its record carries."""

    @property
    def peer_id(self) -> str: ...

    @property
    def manifest_sha256(self) -> str: ...


def common_pin(dataset: str, providers: Sequence[PinnedProvider]) -> str:
    """The one manifest pin all ``providers`` carry ("" when none is pinned).

    Providers that pin different contents are refused (FailedPreconditionError):
    the scheduler already refuses such a job, so this is a second line.
    """
    pins = {provider.manifest_sha256.lower() for provider in providers}
    if len(pins) > 1:
        named = sorted(pin[:12] or "unpinned" for pin in pins)
        raise FailedPreconditionError(f"the providers of {dataset} pin different manifests: {named}")
    return pins.pop() if pins else ""


class PinnedManifests:
    """The manifests a fetcher has verified against their pins, by pin."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._by_pin: dict[str, Manifest] = {}
        #: (pin, peer id) of providers that served another manifest: their slices are not asked for.
        self._refused: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()

    def remember(self, manifest: Manifest) -> None:
        """A manifest known by other means (its digest is its pin)."""
        self._by_pin[manifest.digest()] = manifest

    def known(self, pin: str) -> Manifest | None:
        return self._by_pin.get(pin)

    def refused(self, pin: str, peer_id: str) -> bool:
        """Whether ``peer_id`` served a manifest other than the one ``pin`` names."""
        return (pin, peer_id) in self._refused

    async def get(
        self,
        dataset: str,
        pin: str,
        providers: Sequence[PinnedProvider],
        channel_for: Callable[[PinnedProvider], Awaitable[Any]],
    ) -> Manifest:
        """The manifest of ``dataset`` whose digest is ``pin``, asked of the providers in order.

        Raises ``UnavailableError`` naming each provider's failure (a wrong
        manifest is one) when none served the pinned one.
        """
        if (manifest := self._by_pin.get(pin)) is not None:
            return manifest
        async with self._lock:
            if (manifest := self._by_pin.get(pin)) is not None:
                return manifest
            reasons = []
            for provider in providers:
                try:
                    manifest = await self._ask(dataset, pin, await channel_for(provider))
                except (HyphaError, grpc.aio.AioRpcError, TimeoutError) as err:
                    if isinstance(err, FailedPreconditionError):
                        self._refused.add((pin, provider.peer_id))
                    reason = err.message if isinstance(err, HyphaError) else _describe(err)
                    log.warning("manifest of %s from %s refused: %s", dataset, provider.peer_id, reason)
                    reasons.append(f"{provider.peer_id}: {reason}")
                    continue
                self._by_pin[pin] = manifest
                return manifest
        raise UnavailableError(
            f"no provider served the manifest of {dataset} pinned by its provider records "
            f"(sha256 {pin[:12]}...): " + "; ".join(reasons)
        )

    async def _ask(self, dataset: str, pin: str, channel: Any) -> Manifest:
        stub = data_pb2_grpc.DataNodeStub(channel)
        response = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=self.timeout_s)
        for message in response.datasets:
            if message.name == dataset:
                manifest = Manifest.from_proto(message)
                digest = manifest.digest()
                if digest != pin:
                    raise FailedPreconditionError(
                        f"serves a manifest with sha256 {digest[:12]}..., not the pinned {pin[:12]}..."
                    )
                return manifest
        raise UnavailableError(f"does not list {dataset}")


def _describe(err: grpc.aio.AioRpcError | TimeoutError) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    return f"{err.code().name}: {(err.details() or '').splitlines()[0] if err.details() else ''}"
