"""How a node reaches another node: its direct gRPC address first, the relay
through the gateways when no address answers.

Both kinds of channel take the same generated stubs and fail with the same
``grpc.aio.AioRpcError`` codes, so callers never branch on the path. The
decision is cached per peer and re-made when it goes stale: a direct channel
that has fallen into TRANSIENT_FAILURE (its calls get UNAVAILABLE) is dropped
at the next lookup, and a relay choice is re-checked after
``relay_recheck_s`` in case the peer became reachable. Before a direct
channel is opened, the server's certificate is checked against the CRL
(``hypha.net.channel.check_server``); a revoked server is never dialled, and
neither is one whose certificate is not the peer id asked for (or not one of
the roles the caller expects): an address that a presence record, a DHT record
or an offer named can point anywhere, the certificate cannot. Such an address
is skipped, and the relay, which routes by the id gateways learnt from TLS,
is used instead.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc

from hypha.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from hypha.net.channel import check_server, secure_channel
from hypha.net.relay import Relay, RelayChannel
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import Role

log = logging.getLogger(__name__)

#: A direct grpc.aio channel or a relay channel; the generated stubs take either.
PeerChannel: TypeAlias = "grpc.aio.Channel | RelayChannel"

_BROKEN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


@dataclass
class _Choice:
    channel: PeerChannel
    direct: bool
    address: str
    #: The addresses a relay choice's probe dials (the latest a caller named).
    addresses: list[str] = field(default_factory=list)
    probe: asyncio.Task[None] | None = None


class PeerConnector:
    """Channels to peers by id; owns the direct channels it opens (callers must not close them)."""

    def __init__(
        self,
        tls: TlsMaterial,
        relay: Relay | None,
        connect_timeout_s: float = 2.0,
        *,
        relay_recheck_s: float = 60.0,
        relay_probe_s: float = 1.0,
        check_peer_id: bool = True,
    ) -> None:
        self._tls = tls
        self._relay = relay
        self.connect_timeout_s = connect_timeout_s
        self.relay_recheck_s = relay_recheck_s
        self.relay_probe_s = relay_probe_s
        #: Refuse an address whose certificate is not ``peer_id``'s (off only for a caller that
        #: knows a name, not an id).
        self.check_peer_id = check_peer_id
        self._choices: dict[str, _Choice] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def channel(
        self, peer_id: str, addresses: list[str], *, roles: frozenset[Role] | None = None
    ) -> PeerChannel:
        """A channel to ``peer_id``; raises UnavailableError if neither path exists.

        ``roles``: a direct address must also present one of these roles."""
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            choice = self._choices.get(peer_id)
            if choice is None or not self._still_good(choice):
                await self._drop(peer_id)
                choice = await self._choose(peer_id, addresses, roles)
                self._choices[peer_id] = choice
            if not choice.direct and addresses:
                choice.addresses = list(addresses)
                if choice.probe is None:
                    choice.probe = asyncio.create_task(self._probe(peer_id, choice, roles))
            return choice.channel

    def is_direct(self, peer_id: str) -> bool | None:
        """How the cached channel to ``peer_id`` goes (None when there is none)."""
        choice = self._choices.get(peer_id)
        return None if choice is None else choice.direct

    async def invalidate(self, peer_id: str) -> None:
        """Forget the path to ``peer_id`` (e.g. after UNAVAILABLE); the next lookup re-decides."""
        async with self._locks.setdefault(peer_id, asyncio.Lock()):
            await self._drop(peer_id)

    async def close(self) -> None:
        for peer_id in list(self._choices):
            await self._drop(peer_id)

    @staticmethod
    def _still_good(choice: _Choice) -> bool:
        if choice.direct:
            return choice.channel.get_state() not in _BROKEN
        # A relay choice stands until its probe finds a direct path (or the relay closes).
        return not getattr(choice.channel, "closed", False)

    async def _probe(self, peer_id: str, choice: _Choice, roles: frozenset[Role] | None) -> None:
        """Dial a relayed peer's addresses now and then; the first that answers becomes its path."""
        wait = self.relay_probe_s
        while True:
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.relay_recheck_s)
            for address in list(choice.addresses):
                try:
                    channel = await self._dial(address, peer_id, roles)
                except Exception as err:  # a probe must not die of one odd address
                    log.debug("probing %s of peer %s failed: %r", address, peer_id, err)
                    continue
                if channel is not None:
                    await self._adopt(peer_id, choice, channel, address)
                    return

    async def _adopt(self, peer_id: str, choice: _Choice, channel: grpc.aio.Channel, address: str) -> None:
        """Make a probed direct channel the peer's path, unless the peer was re-decided meanwhile."""
        adopted = False
        try:
            async with self._locks.setdefault(peer_id, asyncio.Lock()):
                if self._choices.get(peer_id) is choice:
                    log.debug("peer %s: direct again at %s", peer_id, address)
                    self._choices[peer_id] = _Choice(channel, True, address)
                    adopted = True
        finally:
            if not adopted:
                await channel.close()

    async def _choose(self, peer_id: str, addresses: list[str], roles: frozenset[Role] | None) -> _Choice:
        for address in addresses:
            channel = await self._dial(address, peer_id, roles)
            if channel is not None:
                log.debug("peer %s: direct at %s", peer_id, address)
                return _Choice(channel, True, address)
        if self._relay is None:
            raise UnavailableError(f"peer {peer_id} unreachable at {addresses or 'no address'} and no relay")
        log.debug("peer %s: through the relay", peer_id)
        return _Choice(self._relay.channel(peer_id), False, "")

    async def _dial(
        self, address: str, peer_id: str, roles: frozenset[Role] | None
    ) -> grpc.aio.Channel | None:
        # The server's certificate is checked against our CRL first (grpcio
        # cannot): a revoked node keeps no direct path to us, whatever it listens on.
        try:
            await check_server(
                self._tls,
                address,
                peer_id=peer_id if self.check_peer_id else None,
                roles=roles,
                timeout_s=self.connect_timeout_s,
            )
        except (UnauthenticatedError, PermissionDeniedError) as err:
            log.warning("refusing direct address %s of peer %s: %s", address, peer_id, err.message)
            return None
        except UnavailableError as err:
            log.debug("direct address %s did not answer: %s", address, err.message)
            return None
        channel = secure_channel(self._tls, address)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await _connected(channel)
        except Exception as err:
            log.debug("direct address %s did not answer: %r", address, err)
            await channel.close()
            return None
        except BaseException:
            await channel.close()
            raise
        return channel

    async def _drop(self, peer_id: str) -> None:
        choice = self._choices.pop(peer_id, None)
        if choice is None:
            return
        if choice.probe is not None:
            choice.probe.cancel()
        if choice.direct:
            await choice.channel.close()


async def _connected(channel: grpc.aio.Channel) -> None:
    """Like ``channel_ready()``, but a refused or failed handshake fails now, not at the timeout.

    ``channel_ready()`` keeps waiting through gRPC's reconnect backoff, so an
    address that refuses at once would still cost the whole connect timeout.
    """
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        if state in _BROKEN:
            raise ConnectionError(f"channel {state.name}")
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
