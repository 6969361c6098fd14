"""A link lab: network namespaces joined by veth pairs, each link capped with ``tbf``.

The project is for machines joined by poor links, and a benchmark that shares
one loopback between every process cannot show what a slow link does to one
trainer. ``wan_lab`` builds a star instead: a hub namespace (where the
coordinating services would live) and N site namespaces, each joined to the hub
by its own veth pair and capped in both directions at the rate under test.
The hub forwards between sites, so two sites talk through two capped links,
as two machines on slow uplinks would.

Addresses are 10.251.0.1 (hub) and 10.251.0.2, .3, ... (sites); they exist only
inside the lab's namespaces, so concurrent labs (each with its own namespaces)
do not collide. Namespace names carry the owner's pid (``hyw-<pid>-<token>-``),
so ``sweep_leftovers`` can tell the remains of a crashed run from a lab that is
still in use.

``netem`` (delay, loss) is not in every kernel, so a link is a rate cap only.
Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hypha.errors import FailedPreconditionError, InvalidArgumentError

PREFIX = "hyw-"
HUB_ADDRESS = "10.251.0.1"
#: The site's end of its link, in every site namespace (``GLOO_SOCKET_IFNAME`` and the like).
SITE_LINK = "wan0"
MTU = 1500
#: Queueing a capped link may add before tbf drops (tc's ``latency``).
DEFAULT_LATENCY_MS = 100
_COMMAND_TIMEOUT_S = 30.0

# tc(8), "RATES": a bare number is bits per second; SI units are 1000, IEC units 1024; "bps" is bytes.
_RATE_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_rate(text: str) -> int | None:
    """A link rate in tc's syntax (``"20mbit"``, ``"1gbit"``) as bits per second; ``"unlimited"`` is None."""
    lowered = text.strip().lower()
    if lowered == "unlimited":
        return None
    match = _RATE.match(lowered)
    if match is None or match.group(2) not in _RATE_UNITS:
        raise InvalidArgumentError(
            f"link rate {text!r}: expected 'unlimited' or a number with a tc unit "
            f"({', '.join(u for u in _RATE_UNITS if u)}), e.g. '20mbit'"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bits < 8:
        raise InvalidArgumentError(f"link rate {text!r}: must be at least 8 bit/s")
    return bits


def tbf_burst(rate_bits: int) -> int:
    """Bucket size in bytes: 4 ms at the rate, at least 32 KiB.

    tbf drops every packet larger than its burst, and a veth hands it GSO
    packets of up to 64 KiB: a burst below that stalls the link (gloo then
    reports read timeouts) unless tbf segments them, so stay well above the MTU.
    """
    return max(rate_bits // 8 // 250, 32 * 1024)


def unavailable() -> str | None:
    """Why a lab cannot be built here (None: it can)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the link lab needs iproute2: {' and '.join(missing)} not found on PATH"
    if os.geteuid() != 0:
        return "the link lab needs root (network namespaces, veth pairs, tc qdiscs)"
    return None


def require() -> None:
    reason = unavailable()
    if reason is not None:
        raise FailedPreconditionError(reason)


@dataclass(frozen=True)
class Site:
    """One site: its namespace, its address, and the two ends of its link."""

    index: int
    namespace: str
    address: str
    #: The site's end of the link, inside ``namespace``.
    link: str
    #: The hub's end of the link, inside the hub namespace.
    hub_link: str


@dataclass(frozen=True)
class LinkBytes:
    """A site's link counters, as seen from the site: ``sent`` left it, ``received`` came in."""

    sent: int
    received: int

    @property
    def total(self) -> int:
        return self.sent + self.received

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - other.sent, self.received - other.received)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise FailedPreconditionError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *args],
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise FailedPreconditionError(f"tc {' '.join(args)} in {namespace} failed: {done.stderr.strip()}")


class WanLab:
    """A built lab (``wan_lab``): run commands in its namespaces, cap its links, read their counters."""

    def __init__(self, prefix: str, sites: int, latency_ms: int = DEFAULT_LATENCY_MS) -> None:
        self.prefix = prefix
        self.hub = f"{prefix}hub"
        self.hub_address = HUB_ADDRESS
        self.latency_ms = latency_ms
        self.rate = "unlimited"
        self.sites = [
            Site(i, f"{prefix}s{i}", f"10.251.0.{i + 2}", SITE_LINK, f"site{i}") for i in range(sites)
        ]

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, *(site.namespace for site in self.sites)]

    def build(self) -> None:
        _ip("netns", "add", self.hub)
        for site in self.sites:
            _ip("netns", "add", site.namespace)
        for ns in self.namespaces:
            _ip("-n", ns, "link", "set", "lo", "up")
        # The hub routes between sites: a site's traffic to another site crosses both links.
        self.run(self.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for site in self.sites:
            _ip(
                "link", "add", site.link, "netns", site.namespace, "mtu", str(MTU), "type", "veth",
                "peer", "name", site.hub_link, "netns", self.hub, "mtu", str(MTU),
            )  # fmt: skip
            # Point-to-point addresses: each end reaches the other without a shared subnet,
            # so sites never talk past the hub.
            _ip(
                "-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/32", "peer", site.address, "dev", site.hub_link
            )
            _ip(
                "-n",
                site.namespace,
                "addr",
                "add",
                f"{site.address}/32",
                "peer",
                HUB_ADDRESS,
                "dev",
                site.link,
            )
            _ip("-n", self.hub, "link", "set", site.hub_link, "up")
            _ip("-n", site.namespace, "link", "set", site.link, "up")
            _ip("-n", site.namespace, "route", "add", "default", "via", HUB_ADDRESS)

    def set_rate(self, rate: str) -> None:
        """Cap every site's link at ``rate`` in both directions (``"unlimited"``: no qdisc)."""
        bits = parse_rate(rate)
        for site in self.sites:
            for ns, dev in ((site.namespace, site.link), (self.hub, site.hub_link)):
                # "del" fails when the device has only its default qdisc: nothing to remove then.
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                    capture_output=True,
                    timeout=_COMMAND_TIMEOUT_S,
                    check=False,
                )
                if bits is not None:
                    _tc(
                        ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                        "burst", str(tbf_burst(bits)), "latency", f"{self.latency_ms}ms",
                    )  # fmt: skip
        self.rate = rate

    def argv(self, namespace: str, *argv: str) -> list[str]:
        """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: the pid is the command's)."""
        if namespace not in self.namespaces:
            raise InvalidArgumentError(f"{namespace!r} is not a namespace of this lab: {self.namespaces}")
        return ["ip", "netns", "exec", namespace, *argv]

    def run(self, namespace: str, *argv: str, timeout: float = _COMMAND_TIMEOUT_S) -> str:
        """Run to completion inside ``namespace``; its stdout. A failure raises with its stderr."""
        done = subprocess.run(
            self.argv(namespace, *argv), capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise FailedPreconditionError(
                f"{' '.join(argv)} in {namespace} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def popen(self, namespace: str, *argv: str, **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.argv(namespace, *argv), **kwargs)

    async def spawn(self, namespace: str, *argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(*self.argv(namespace, *argv), **kwargs)

    def counters(self, site: Site) -> LinkBytes:
        """Bytes through ``site``'s link so far, read at its end of the veth."""
        out = _ip("-n", site.namespace, "-j", "-s", "link", "show", "dev", site.link).stdout
        stats = json.loads(out)[0]["stats64"]
        return LinkBytes(sent=int(stats["tx"]["bytes"]), received=int(stats["rx"]["bytes"]))

    def all_counters(self) -> list[LinkBytes]:
        return [self.counters(site) for site in self.sites]

    def teardown(self) -> None:
        remove_namespaces(self.namespaces)


def _namespace_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_namespaces(names: Sequence[str]) -> None:
    """End what still runs inside each namespace, then delete it (its veth ends go with it).

    A process left inside keeps the namespace, and so its links, alive after the
    delete: a killed benchmark's ranks must not hold a lab's links open.
    """
    present = set(_namespace_names())
    for name in names:
        if name not in present:
            continue
        _kill_inside(name)
        _ip("netns", "delete", name, check=False)


def _kill_inside(namespace: str, grace_s: float = 5.0) -> None:
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _alive(pid)]
            if pids:
                time.sleep(0.05)  # polling the processes' exit with a deadline
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child nobody reaped yet) holds nothing: it counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _owner(name: str) -> int | None:
    """The pid in a lab namespace's name (``hyw-<pid>-<token>-...``)."""
    parts = name.removeprefix(PREFIX).split("-", 1)
    return int(parts[0]) if name.startswith(PREFIX) and parts[0].isdigit() else None


#: Prefixes of the labs this process holds open: its own pid alone does not tell them from the
#: remains of one whose teardown failed.
_ACTIVE: set[str] = set()


def _in_use_by_self(name: str) -> bool:
    return any(name.startswith(prefix) for prefix in _ACTIVE)


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of labs whose owning process is gone (a run killed before it could
    tear down); the names it deleted. Labs of live processes are left alone."""
    if unavailable() is not None:
        return []
    stale = [
        name
        for name in _namespace_names()
        if (owner := _owner(name)) is not None
        and (owner == os.getpid() or not _alive(owner))
        and not _in_use_by_self(name)
    ]
    remove_namespaces(stale)
    return stale


@contextlib.contextmanager
def wan_lab(sites: int, rate: str = "unlimited", latency_ms: int = DEFAULT_LATENCY_MS) -> Iterator[WanLab]:
    """A hub and ``sites`` site namespaces, each link capped at ``rate``; all of it is deleted on
    exit, after an exception too, ending whatever still runs inside. Leftovers of crashed
    runs are swept first."""
    require()
    if sites < 1:
        raise InvalidArgumentError(f"a lab needs at least one site, got {sites}")
    if sites > 250:
        raise InvalidArgumentError(f"at most 250 sites fit 10.251.0.0/24, got {sites}")
    parse_rate(rate)  # a bad rate fails before anything is built
    sweep_leftovers()
    lab = WanLab(f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-", sites, latency_ms)
    _ACTIVE.add(lab.prefix)
    try:
        lab.build()
        lab.set_rate(rate)
        yield lab
    finally:
        try:
            lab.teardown()
        finally:
            _ACTIVE.discard(lab.prefix)
