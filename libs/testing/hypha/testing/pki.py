"""A throwaway PKI: a root CA, one org CA under it, and one node certificate per role.

Its node certificates carry the loopback SANs (``certs.make_node(loopback=True)``):
every test node listens, and is dialled, on 127.0.0.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypha.net.tls import PathsTls, TlsMaterial
from hypha.pki import certs

#: Roles ``make_pki`` issues a certificate for, each named after its role.
ROLES = ("gateway", "scheduler", "worker", "data", "client", "admin")


@dataclass
class Pki:
    """A root CA, one org CA under it, and one node certificate per role (named after the role)."""

    dir: Path
    root_cert: Path
    root_key: Path
    org_cert: Path
    org_key: Path

    def paths(self, name: str) -> PathsTls:
        return PathsTls.from_certs_dir(self.dir, name)

    def tls(self, name: str, crl: Path | None = None) -> TlsMaterial:
        paths = self.paths(name)
        return TlsMaterial.load(PathsTls(paths.cert, paths.key, paths.trust, crl))

    def issue(self, role: str, name: str, **kwargs: object) -> TlsMaterial:
        """A new certificate ``name`` with ``role`` (kwargs as ``certs.make_node`` takes them).

        Loopback SANs unless ``loopback=False``: test nodes are dialled on 127.0.0.1.
        """
        kwargs.setdefault("loopback", True)
        certs.make_node(self.org_cert, self.org_key, role, name, self.dir, **kwargs)  # type: ignore[arg-type]
        return self.tls(name)


def make_pki(base: Path) -> Pki:
    """Create the PKI in ``base`` (made if missing); the org CA is named ``acme``."""
    base.mkdir(parents=True, exist_ok=True)
    root_cert, root_key = certs.make_root(base)
    org_cert, org_key = certs.make_org(root_cert, root_key, "acme", base)
    for role in ROLES:
        certs.make_node(org_cert, org_key, role, role, base, loopback=True)
    return Pki(base, root_cert, root_key, org_cert, org_key)
