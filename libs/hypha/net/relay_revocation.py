"""Relayed calls checked against this node's CRL: when they open, and for as
long as they stay open.

A relayed call's caller is the certificate its gateway stamped on the frames
(serial, issuer and issuer key id). At open the callee refuses an unstamped
caller and a revoked one, as the server guard refuses a direct call. A call
that was let in stays checked: when the CRL changes (its generation moves),
every open call is checked again and a revoked caller's is ended
UNAUTHENTICATED, as the server guard ends a direct stream, so a tensor
transfer or a log follow does not outlive its caller's revocation.

The re-check costs one stat of the CRL file while it is unchanged, however
many calls are open: each call remembers the generation its caller was last
found unrevoked at, and only calls behind the current generation are walked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Protocol

import grpc

from hypha.net.relay_context import RelayServicerContext
from hypha.pki.crl import RevocationChecker
from hypha.pki.identity import PeerIdentity
from hypha.service import BackgroundTasks

log = logging.getLogger(__name__)

#: (reason, status, details) refusing a relayed call to open.
Refusal = tuple[str, grpc.StatusCode, str]


class WatchedCall(Protocol):
    """What the re-check needs of an open relayed call (``relay_server.ServerCall``)."""

    method: str
    peer: str
    #: The caller's issuer exactly as stamped (what the CRL checker keys on).
    issuer: str
    #: The CRL generation the caller was last found unrevoked at (-1: never checked).
    checked_generation: int
    context: RelayServicerContext

    def kill(self, code: grpc.StatusCode | None, details: str) -> None: ...


class OpenCallRevocations:
    """Checks relayed callers against the CRL at open, then re-checks the open calls on a CRL change.

    ``calls`` gives the calls open now; ``refusals`` is the endpoint's count of
    refusals by reason, where calls ended here count as ``revoked_open_call``.
    The watcher task runs only while calls are open.
    """

    def __init__(
        self,
        checker: RevocationChecker,
        recheck_s: float,
        background: BackgroundTasks,
        calls: Callable[[], Collection[WatchedCall]],
        refusals: dict[str, int],
    ) -> None:
        self.checker = checker
        #: How often open calls look for a CRL change (a stat of the file; the walk only on a change).
        self.recheck_s = recheck_s
        self._background = background
        self._calls = calls
        self._refusals = refusals
        self._watcher: asyncio.Task[None] | None = None

    def refusal(self, caller: PeerIdentity, issuer: str) -> Refusal | None:
        """Why ``caller`` may not open a call (unstamped, revoked), or None.

        ``issuer`` is the stamped RFC 4514 text itself, which is what the CRL
        checker keys on (no round trip through a parsed name)."""
        if caller.serial == 0:
            return "unstamped", grpc.StatusCode.UNAUTHENTICATED, "relayed call carries no certificate"
        if self.checker.is_revoked(issuer, caller.serial, caller.authority_key_id):
            return "revoked", grpc.StatusCode.UNAUTHENTICATED, "certificate revoked"
        return None

    def admitted(self, call: WatchedCall) -> None:
        """``call`` has just opened, its caller checked: watch it from the generation it was checked at."""
        call.checked_generation = self.checker.generation
        if self._watcher is None or self._watcher.done():
            self._watcher = self._background.spawn(self._recheck_loop(), name="relay-revocation-recheck")

    def idle(self) -> None:
        """No call is open: stop watching (the next ``admitted`` starts it again)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _recheck_loop(self) -> None:
        while self._calls():
            await asyncio.sleep(self.recheck_s)
            self.recheck()

    def recheck(self) -> int:
        """End the open calls whose caller's certificate (or a CA above it) is now revoked; how many.

        Only calls last checked at an older CRL generation are looked at, so
        an unchanged CRL costs one stat, however many calls are open.
        """
        self.checker.refresh()
        generation = self.checker.generation
        ended = 0
        for call in list(self._calls()):
            if call.checked_generation == generation:
                continue
            call.checked_generation = generation
            caller = call.context.relay_identity
            if self.checker.is_revoked(call.issuer, caller.serial, caller.authority_key_id):
                ended += 1
                self._refusals["revoked_open_call"] = self._refusals.get("revoked_open_call", 0) + 1
                log.info("relay: ending %s from %s: certificate revoked", call.method, call.peer)
                # NOTE: the status a direct stream gets from the server guard in the same case.
                call.kill(grpc.StatusCode.UNAUTHENTICATED, "certificate revoked while the call was open")
        return ended
