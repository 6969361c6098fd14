"""The addresses a node tells peers to dial it at.

A node bound to a wildcard (``0.0.0.0``, ``::``) is reachable at its host's
interface addresses, never at ``127.0.0.1``: advertised, a loopback address
sends every peer to itself. So, in order: the configured
``net.external_addresses`` (NAT, a DNS name, a load balancer); else, for a
wildcard listener, the host's non-loopback addresses; else the bound address
as it is. Only a host with no non-loopback address at all advertises
loopback (only peers on the same host could reach it anyway).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

IPv4_WILDCARDS = frozenset({"0.0.0.0"})
IPv6_WILDCARDS = frozenset({"::", "[::]", ""})
#: Documentation addresses (RFC 5737, RFC 3849): ``connect`` on a UDP socket sends nothing,
#: it only asks the kernel which source address its route to them would use.
_ROUTE_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))

InterfaceFinder = Callable[[], list[str]]


def host_addresses() -> list[str]:
    """This host's usable IP addresses, loopback included (the caller filters): the source
    address of each default route, then whatever the host name resolves to."""
    found: list[str] = []
    for family, target in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                found.append(str(probe.getsockname()[0]))
        except OSError:
            continue  # no route in this family
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    found += [str(info[4][0]) for info in infos]
    return found


def _routable(
    address: str, families: tuple[int, ...]
) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if (
        ip.version not in families
        or ip.is_loopback
        or ip.is_unspecified
        or ip.is_link_local
        or ip.is_multicast
    ):
        return None
    return ip


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_addresses(
    listen: str,
    port: int,
    external: Sequence[str] = (),
    *,
    find_interfaces: InterfaceFinder = host_addresses,
) -> list[str]:
    """Where peers should dial a node that listens on ``listen`` and got ``port``."""
    if external:
        return list(external)
    host = listen.rsplit(":", 1)[0]
    if host not in IPv4_WILDCARDS | IPv6_WILDCARDS:
        return [_host_port(host.strip("[]"), port)]
    # 0.0.0.0 accepts IPv4 only; :: accepts both where the OS maps IPv4 onto it.
    families = (4,) if host in IPv4_WILDCARDS else (4, 6)
    seen: list[str] = []
    for address in find_interfaces():
        ip = _routable(address, families)
        if ip is not None and str(ip) not in seen:
            seen.append(str(ip))
    if seen:
        return [_host_port(ip, port) for ip in seen]
    loopback = "127.0.0.1" if host in IPv4_WILDCARDS else "::1"
    log.warning(
        "listening on %s but this host has no non-loopback address: advertising %s, which only "
        "peers on this host can dial (set net.external_addresses)",
        listen,
        loopback,
    )
    return [_host_port(loopback, port)]
