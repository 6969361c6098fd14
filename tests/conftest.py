"""Fixtures shared by every test: a real PKI (``hypha.testing.pki``), and a guard against stray processes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hypha.testing.pki import ROLES, Pki, make_pki

__all__ = ["ROLES", "Pki", "make_pki"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


@pytest.fixture(autouse=True, scope="session")
def _nothing_written_into_the_repository() -> Iterator[None]:
    """Tests keep their files in tmp dirs: a default like ``./work-NAME`` must not land in the checkout."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    before = set(root.glob("work-*"))
    yield
    stray = sorted(str(p) for p in set(root.glob("work-*")) - before)
    assert not stray, f"tests wrote into the repository: {stray}"
