"""Fixtures shared by every test: a real PKI, and a guard against stray processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hypha.net.tls import PathsTls, TlsMaterial
from hypha.pki import certs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
        certs.make_node(self.org_cert, self.org_key, role, name, self.dir, **kwargs)  # type: ignore[arg-type]
        return self.tls(name)


def make_pki(base: Path) -> Pki:
    base.mkdir(parents=True, exist_ok=True)
    root_cert, root_key = certs.make_root(base)
    org_cert, org_key = certs.make_org(root_cert, root_key, "acme", base)
    for role in ROLES:
        certs.make_node(org_cert, org_key, role, role, base)
    return Pki(base, root_cert, root_key, org_cert, org_key)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def foreign_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A second, unrelated PKI whose certificates nobody trusts."""
    return make_pki(tmp_path_factory.mktemp("foreign-pki"))


@pytest.fixture(autouse=True, scope="session")
def _no_stray_children() -> Iterator[None]:
    yield
    import subprocess

    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True
    )
    leftovers = [line for line in out.stdout.splitlines() if "ps -o" not in line and line.strip()]
    assert not leftovers, f"stray child processes after the test session: {leftovers}"
